"""What the HTTP fuzzing (tests/test_http_fuzz.py, bench/fuzz_http.py) found, pinned with plain
requests to in-process apps: the crashes it found stay fixed, and the OpenAPI documents keep
saying what the services do (schemathesis' every check: a schema-valid request is accepted, a
schema-violating one refused, `Allow` names a path's methods)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from core.kit.metrics import new_registry


def _call(app, method: str, path: str, **kwargs) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())


@pytest.fixture(scope="module")
def engine_app():
    from services.engine.core import EngineCore
    from services.engine.metrics import EngineMetrics
    from services.engine.service import build_http_app
    from services.engine.settings import EngineSettings

    settings = EngineSettings(admin_token="secret")
    registry = new_registry()
    return build_http_app(
        EngineCore(settings, EngineMetrics(registry)), settings, registry, load_on_startup=False
    )


@pytest.mark.parametrize("body", ["[1]", '"rid"', "3", '{"rid": 5}', '{"abort_all": "yes"}'])
def test_engine_abort_request_refuses_a_body_of_the_wrong_shape_with_a_400(engine_app, body):
    # A JSON list or string here was a 500 (the handler called .get on it). An admin route, as in SGLang.
    auth = {"Authorization": "Bearer secret"}
    response = _call(engine_app, "POST", "/abort_request", content=body, headers=auth)
    assert response.status_code == 400
    assert response.json()["error"]["message"]


def test_engine_openapi_names_each_operation_once_and_marks_the_admin_ones(engine_app):
    doc = _call(engine_app, "GET", "/openapi.json").json()
    operations = {(m.upper(), p): op for p, ops in doc["paths"].items() for m, op in ops.items()}
    ids = [op["operationId"] for op in operations.values()]
    assert len(ids) == len(set(ids))  # PUT /generate and GET /flush_cache shared their POST's id
    admin = {key for key, op in operations.items() if op.get("security")}
    assert admin == {
        ("POST", "/flush_cache"), ("GET", "/flush_cache"), ("POST", "/pause_generation"),
        ("POST", "/continue_generation"), ("POST", "/update_weights_from_disk"), ("POST", "/abort_request"),
    }  # fmt: skip
    for key in admin:
        assert {"401", "403"} <= set(operations[key]["responses"]), key
    generate = operations[("POST", "/generate")]
    body = generate["requestBody"]["content"]["application/json"]["schema"]
    assert {"text", "input_ids", "sampling_params"} <= set(body["properties"])
    assert {"200", "400", "413", "503"} <= set(generate["responses"])
    assert "text/event-stream" in generate["responses"]["200"]["content"]


def test_engine_admin_operations_refuse_without_the_token(engine_app):
    for method, path in [("POST", "/pause_generation"), ("GET", "/flush_cache"), ("PUT", "/generate")]:
        response = _call(engine_app, method, path)
        if path == "/generate":  # not admin: refused for its empty body, not for auth
            assert response.status_code == 400
        else:
            assert response.status_code == 401


@pytest.mark.parametrize("checkpoint", ["ckpt\x00", "\ud932ckpt"])
def test_worker_reload_refuses_a_checkpoint_path_the_os_cannot_take_with_a_400(tmp_path, checkpoint):
    # A NUL byte or a lone surrogate in POST /admin/reload's checkpoint was a 500.
    from services.worker.reload import ReloadRefused, resolve_checkpoint

    with pytest.raises(ReloadRefused) as refused:
        resolve_checkpoint(tmp_path, checkpoint)
    assert refused.value.status == 400
    assert "not a usable path" in refused.value.error


def test_coordinator_llm_documents_its_one_model_and_its_errors():
    from services.coordinator_llm.service import build_app
    from services.coordinator_llm.settings import CoordinatorLlmSettings

    app = build_app(CoordinatorLlmSettings(model_name="the-model"))
    doc = _call(app, "GET", "/openapi.json").json()
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    body = chat["requestBody"]["content"]["application/json"]["schema"]
    assert body["properties"]["model"]["enum"] == ["the-model"]
    assert {"400", "404", "422"} <= set(chat["responses"])
    assert doc["paths"]["/admin/faults"]["put"]["security"]
    assert _call(app, "GET", "/admin/faults").status_code == 403  # no token configured: disabled


def test_gateway_refuses_a_worker_budget_the_wire_cannot_carry():
    # max_tokens above int32 passed validation, then the protobuf message raised: a 500 after the
    # episode was admitted. It is now a 422 before anything runs.
    from pydantic import ValidationError

    from services.coordinator.gateway import EpisodeRequest

    with pytest.raises(ValidationError) as refused:
        EpisodeRequest.model_validate({"question": "q", "worker_budget": {"max_tokens": 2**58}})
    assert refused.value.errors()[0]["loc"] == ("worker_budget", "max_tokens")
    EpisodeRequest.model_validate({"question": "q", "worker_budget": {"max_tokens": 2**31 - 1}})


def test_worker_sampling_and_the_gold_bit_reach_the_worker_request_as_asked():
    from google.protobuf import json_format
    from pydantic import ValidationError

    from core.v1 import coordinator_pb2
    from services.coordinator.gateway import EpisodeRequest, worker_request
    from services.coordinator.service import request_of

    base = {"question": "q", "question_id": "7", "gold_answer": "1738"}
    plain = worker_request(EpisodeRequest.model_validate(base), "e.w0", "task", "prompt")
    # By default the gold answer reaches the no-search guard (FoldAgent's rule) and the worker samples
    # with its own settings.
    assert plain.gold_answer == "1738" and not plain.sampling.HasField("top_p")
    rl = EpisodeRequest.model_validate({**base, "worker_sampling": {"top_p": 1.0}, "worker_gold": False})
    sent = worker_request(rl, "e.w0", "task", "prompt")
    assert sent.sampling.top_p == 1.0 and not sent.sampling.HasField("temperature")
    assert not sent.HasField("gold_answer")  # nothing of the gold answer reaches a worker
    # A seed fans out: each branch its own, the same branch the same in every run of the request.
    seeded = EpisodeRequest.model_validate({**base, "worker_sampling": {"seed": 5}})
    first, second = (worker_request(seeded, f"e.w{i}", "task", "prompt", i).sampling.seed for i in (0, 1))
    assert first != second and first != 5
    assert worker_request(seeded, "other.w0", "task", "prompt", 0).sampling.seed == first
    # The gRPC request carries the same two fields, mapped onto the same model.
    message = json_format.ParseDict(
        {**base, "worker_sampling": {"top_p": 1.0}, "worker_gold": False},
        coordinator_pb2.RunCoordinatorEpisodeRequest(),
    )
    assert request_of(message) == rl
    assert request_of(coordinator_pb2.RunCoordinatorEpisodeRequest(question="q")).worker_gold is True
    with pytest.raises(ValidationError):
        EpisodeRequest.model_validate({**base, "worker_gold": 0})  # found by schemathesis: 0 is no bool
    for bad in (
        {"top_p": 0},
        {"top_p": 1.5},
        {"temperature": -1},
        {"top_k": 0},
        {"min_p": 0.1},
        {"seed": 2**63},
    ):
        with pytest.raises(ValidationError):
            EpisodeRequest.model_validate({**base, "worker_sampling": bad})


# --- found by schemathesis with every check (`st run --checks all`, tests/http_fuzz.py) ----------


def test_a_path_served_by_one_route_per_method_names_them_all_in_allow():
    # Starlette's 405 named the first route's methods only: OPTIONS /flush_cache said `Allow: POST`
    # though GET /flush_cache is served too (engine; worker /admin/reload, gateway /admin/coordinator
    # and /v1/episodes, coordinator-llm /admin/faults alike).
    from core.kit.http import create_app
    from core.kit.settings import ServiceSettings, load_settings

    app = create_app("t", load_settings(ServiceSettings))
    app.get("/x")(lambda: {})
    app.post("/x")(lambda: {})
    response = _call(app, "OPTIONS", "/x")
    assert response.status_code == 405
    assert set(response.headers["allow"].split(", ")) - {"HEAD"} == {"GET", "POST"}


@pytest.mark.parametrize(
    ("path", "methods"), [("/flush_cache", {"GET", "POST"}), ("/generate", {"POST", "PUT"})]
)
def test_engine_answers_options_with_every_method_of_the_path(engine_app, path, methods):
    response = _call(engine_app, "OPTIONS", path)
    assert response.status_code == 405
    assert methods <= set(response.headers["allow"].split(", "))


def _llm_app():
    from services.coordinator_llm.service import build_app
    from services.coordinator_llm.settings import CoordinatorLlmSettings

    return build_app(CoordinatorLlmSettings(model_name="the-model"))


def test_coordinator_llm_answers_a_method_a_route_does_not_take_with_405_and_allow():
    # A catch-all route answered 404 "Invalid URL" to PUT /v1/chat/completions and PUT /v1/models.
    app = _llm_app()
    for method, path, allow in [("PUT", "/v1/chat/completions", "POST"), ("DELETE", "/v1/models", "GET")]:
        response = _call(app, method, path)
        assert response.status_code == 405, (method, path, response.text)
        assert allow in response.headers["allow"].split(", ")
    unknown = _call(app, "POST", "/v1/embeddings", json={})
    assert unknown.status_code == 404 and unknown.json()["error"]["message"].startswith("Invalid URL")


@pytest.mark.parametrize(
    "extra", [{"top_logprobs": False}, {"logprobs": 0.0}, {"max_tokens": True}, {"temperature": "1"}]
)
def test_coordinator_llm_refuses_a_value_of_another_json_type(extra):
    # pydantic's lax types took false for top_logprobs 0 and 0.0 for logprobs false: answered 200.
    body = {"model": "the-model", "messages": [{"role": "user", "content": "hi"}], **extra}
    response = _call(_llm_app(), "POST", "/v1/chat/completions", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["param"] == next(iter(extra))


def test_coordinator_llm_documents_the_chat_values_it_refuses():
    # `messages: []`, n 2, logprobs true and a content part other than text were schema-valid 400s.
    doc = _call(_llm_app(), "GET", "/openapi.json").json()
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"][
        "schema"
    ]
    props = body["properties"]
    assert props["messages"]["minItems"] == 1
    assert props["n"]["anyOf"][0] == {"const": 1}
    assert props["logprobs"]["anyOf"][0] == {"const": False}
    content = props["messages"]["items"]["properties"]["content"]["anyOf"]
    assert {"type": "string"} in content
    assert any(c.get("items", {}).get("properties", {}).get("type") == {"const": "text"} for c in content)


def test_engine_abort_request_takes_null_as_the_default(engine_app):
    # `{"abort_all": null}` fits the schema (bool | null) and was a 400.
    body, auth = {"rid": None, "abort_all": None}, {"Authorization": "Bearer secret"}
    response = _call(engine_app, "POST", "/abort_request", json=body, headers=auth)
    assert response.status_code == 503, response.text  # parsed; this app's engine is not loaded


@pytest.mark.parametrize(
    ("sampling", "refused"),
    [
        ({"stop_token_ids": [None]}, True),  # was accepted: the schema says integers
        ({"presence_penalty": False}, True),  # false == 0 in Python: was accepted
        ({"max_new_tokens": 8.0, "top_k": 5.0, "sampling_seed": 3.0}, False),  # integers in JSON: were 400s
    ],
)
def test_engine_sampling_params_take_the_json_types_of_the_schema(sampling, refused):
    from services.engine.protocol import RequestError, parse_generate_request

    if refused:
        with pytest.raises(RequestError):
            parse_generate_request({"input_ids": [1, 2], "sampling_params": sampling})
        return
    parsed = parse_generate_request(
        {"input_ids": [1.0, 2], "logprob_start_len": 1.0, "sampling_params": sampling}
    )
    assert parsed.input_ids == (1, 2) and parsed.logprob_start_len == 1
    assert (parsed.sampling.max_new_tokens, parsed.sampling.top_k, parsed.sampling.sampling_seed) == (8, 5, 3)
    assert all(type(v) is int for v in (*parsed.input_ids, parsed.sampling.max_new_tokens))


def test_engine_openapi_states_the_refusals_one_field_decides(engine_app):
    # A schema-valid empty text, empty stop string, top_k 0, unknown sampling name, token id past
    # the vocabulary or prompt past the context were all 400s.
    from services.engine.openapi import document_model_limits

    doc = _call(engine_app, "GET", "/openapi.json").json()
    document_model_limits(doc, vocab_size=100, context_length=64)
    body = doc["paths"]["/generate"]["put"]["requestBody"]["content"]["application/json"]["schema"]
    props = body["properties"]
    assert {"type": "string", "minLength": 1} in props["text"]["anyOf"]
    ids = next(s for s in props["input_ids"]["anyOf"] if s.get("type") == "array")
    assert ids["items"]["maximum"] == 99 and ids["maxItems"] == 63
    sampling = next(s for s in props["sampling_params"]["anyOf"] if s.get("type") == "object")
    assert sampling["additionalProperties"] is False
    assert sampling["properties"]["top_k"]["not"] == {"const": 0}
    assert {"minLength": 1, "type": "string"} in sampling["properties"]["stop"]["anyOf"]
    max_new = next(s for s in sampling["properties"]["max_new_tokens"]["anyOf"] if s.get("type") == "integer")
    assert max_new["maximum"] == 63  # a 1-token prompt + 63 = the context: allowed, as in SGLang 0.5.19


class _Pages:
    def get(self, docid):
        return None

    def get_by_url(self, url):
        return None


@pytest.fixture
def retrieval_app():
    from types import SimpleNamespace

    from services.retrieval.core import RetrievalMetrics, SearchCore
    from services.retrieval.service import build_http_app
    from services.retrieval.settings import RetrievalSettings

    settings = RetrievalSettings(max_k=7, max_query_chars=50)
    index = SimpleNamespace(dense=None, embedder=None, store=SimpleNamespace(count=lambda: 0), pages=_Pages())
    registry = new_registry()
    core = SearchCore(index, settings, RetrievalMetrics(registry))
    return build_http_app(core, settings, registry)


def test_retrieval_openapi_states_the_limits_of_its_settings(retrieval_app):
    # The document said k up to 1000 while max_k (100) refused k 999 with a 400.
    schemas = _call(retrieval_app, "GET", "/openapi.json").json()["components"]["schemas"]
    for name in ("SearchBody", "SearchV1Body"):
        assert schemas[name]["properties"]["k"]["maximum"] == 7
        assert schemas[name]["properties"]["query"]["maxLength"] == 50
        assert schemas[name]["properties"]["query"]["pattern"] == r"\S"  # "  " is refused: blank
    open_body = schemas["OpenBody"]
    assert [set(branch["required"]) for branch in open_body["anyOf"]] == [{"docid"}, {"url"}]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/search", {"query": "q", "snippet_words": False}),  # was a 200: false taken as 0
        ("/v1/search", {"query": "q", "k": "3"}),
        ("/open", {"docid": True}),
    ],
)
def test_retrieval_refuses_a_value_of_another_json_type(retrieval_app, path, body):
    assert _call(retrieval_app, "POST", path, json=body).status_code == 422


def test_retrieval_open_measures_the_docid_as_sent(retrieval_app):
    # The length limit applied after stripping, the documented maxLength to what was sent.
    assert _call(retrieval_app, "POST", "/open", json={"docid": " " * 512 + "x"}).status_code == 422
    assert _call(retrieval_app, "POST", "/open", json={"docid": " " + "x" * 511}).status_code == 404
    assert _call(retrieval_app, "POST", "/open", json={"docid": None, "url": " "}).status_code == 400


def _reload_app(root):
    from fastapi import FastAPI
    from pydantic import SecretStr

    from services.worker.reload import ReloadManager
    from services.worker.service import add_reload_routes

    app = FastAPI()
    app.state.admin_token = SecretStr("t")
    add_reload_routes(app, ReloadManager(None, root))  # refused before the engine is asked
    return app


@pytest.mark.parametrize(
    ("checkpoint", "status"),
    [("does_not_exist", 404), ("..", 403), ("/", 403), ("", 422), ("  ", 422), ("a\x00b", 422)],
)
def test_worker_reload_answers_a_schema_valid_path_it_cannot_load_with_403_or_404(
    tmp_path, checkpoint, status
):
    # A path that names no folder in the root was a 400 or a 422 (like a malformed request);
    # blank and NUL paths are now outside the schema, refused before the manager runs.
    app = _reload_app(tmp_path)
    response = _call(
        app, "POST", "/admin/reload", json={"checkpoint": checkpoint}, headers={"Authorization": "Bearer t"}
    )
    assert response.status_code == status, response.text
    doc = _call(app, "GET", "/openapi.json").json()
    assert str(status) in doc["paths"]["/admin/reload"]["post"]["responses"]


def _keys(node, found: set[str]) -> set[str]:
    if isinstance(node, dict):
        found.update(node)
        for value in node.values():
            _keys(value, found)
    elif isinstance(node, list):
        for value in node:
            _keys(value, found)
    return found


def test_retrieval_documents_the_integer_docids_it_takes(retrieval_app):
    # Found by the fuzzer under two workers: the bounds came after JSON_INTEGER, so the document
    # said `ge: 0` (not JSON Schema: ignored) and a schema-valid docid -790 got a 422.
    document = _call(retrieval_app, "GET", "/openapi.json").json()
    docid = document["components"]["schemas"]["OpenBody"]["properties"]["docid"]
    integer = next(branch for branch in docid["anyOf"] if branch.get("type") == "integer")
    # CI's fuzzer then sent 2**63 + 190 as "below exclusiveMaximum 2**63" (a bound past a double's
    # exact integers): the range is I-JSON's, whose every bound a double holds exactly.
    assert (integer["minimum"], integer["maximum"]) == (0, 2**53 - 1)
    assert float(integer["maximum"]) == integer["maximum"]
    assert not _keys(document, set()) & {"ge", "gt", "le", "lt"}
    assert _call(retrieval_app, "POST", "/open", json={"docid": -790}).status_code == 422
    assert _call(retrieval_app, "POST", "/open", json={"docid": 790}).status_code == 404
    assert _call(retrieval_app, "POST", "/open", json={"docid": 2**53 - 1}).status_code == 404
    for beyond in (2**53, 2**63 + 190):
        assert _call(retrieval_app, "POST", "/open", json={"docid": beyond}).status_code == 422
