"""The stand-in coordinator LLM (`bcstack serve coordinator-llm --policy scripted`), spoken to the
way an OpenAI client would: plain httpx with the exact Chat Completions wire shape (the official
`openai` client is not installed here).

Servers run in-process (uvicorn in a thread) on free loopback ports; one test starts the real
command line in a subprocess.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import find_free_port, wait_until
from prometheus_client.parser import text_string_to_metric_families

from core import protocol as p
from core.kit.http import uvicorn_server
from core.kit.settings import load_settings
from devkit.toyworld import grammar as g
from services.coordinator_llm.faults import FaultInjector
from services.coordinator_llm.service import build_app
from services.coordinator_llm.settings import CoordinatorLlmSettings

REPO = Path(__file__).resolve().parent.parent
MODEL = "scripted-coordinator"
QUESTION = "In which city was the inventor of the Varnel loom born?"
API_KEY = "sk-coord-7d41e0c9a2b35f68"
SYSTEM = "You coordinate research workers. Call branch(description, prompt) or finish(...)."


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("BCSTACK_"):
            monkeypatch.delenv(name)


@contextmanager
def serving(**overrides: Any) -> Iterator[str]:
    """A coordinator-llm server in a thread; yields its base URL."""
    port = find_free_port()
    settings = load_settings(CoordinatorLlmSettings, port=port, shutdown_grace_seconds=0.2, **overrides)
    server = uvicorn_server(build_app(settings), settings)
    thread = threading.Thread(target=asyncio.run, args=(server.serve(),), daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, timeout=10, interval=0.02, message="server started")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    with serving() as url:
        yield url


def first_turn(content: Any = QUESTION) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]


def chat(base: str, messages: list[dict[str, Any]], *, headers: dict | None = None, **extra: Any) -> Any:
    body = {"model": MODEL, "messages": messages, "temperature": 1.0, "top_p": 0.95, **extra}
    return httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=10)


def content_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def assert_completion_shape(body: dict[str, Any], finish_reason: str = "stop") -> None:
    assert set(body) >= {"id", "object", "created", "model", "choices", "usage"}
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert isinstance(body["created"], int) and abs(body["created"] - time.time()) < 60
    assert body["model"] == MODEL
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == finish_reason
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    usage = body["usage"]
    assert all(isinstance(usage[k], int) for k in ("prompt_tokens", "completion_tokens", "total_tokens"))
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0


def assert_openai_error(response: httpx.Response, status: int, **expected: Any) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    for key, value in expected.items():
        assert body["error"][key] == value, body
    return body["error"]


def stream_events(base: str, messages: list[dict[str, Any]], **extra: Any) -> list[str]:
    """The `data:` payloads of a streamed completion, in order."""
    body = {"model": MODEL, "messages": messages, "stream": True, **extra}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=10) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


def metric(base: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"no sample {name}{labels}")


# --- the scripted coordinator behind the API -----------------------------------------------------


def test_first_turn_for_a_toy_question_is_a_branch_call(base: str) -> None:
    assert g.parse_question(QUESTION) is not None
    response = chat(base, first_turn())
    assert_completion_shape(response.json())
    (call,) = p.parse_calls(content_of(response))
    action = p.validate_call(call, p.COORDINATOR_TOOLS)
    assert isinstance(action, p.BranchAction)
    assert QUESTION in action.prompt and action.description

    # Content given as text parts reads the same as a plain string.
    parts = [{"type": "text", "text": QUESTION}]
    assert content_of(chat(base, first_turn(parts))) == content_of(response)


def test_a_worker_report_turn_finishes_with_the_reports_answer(base: str) -> None:
    messages = first_turn()
    messages.append({"role": "assistant", "content": content_of(chat(base, messages))})
    (branch,) = p.parse_calls(messages[-1]["content"])
    report = p.WorkerReportText(
        branch.params["description"],
        "finish",
        "Oskarsholm",
        "The loom page names its inventor [doc-17].",
        "85%",
    )
    messages.append({"role": "user", "content": p.render_worker_report(report)})
    response = chat(base, messages)
    assert_completion_shape(response.json())
    (call,) = p.parse_calls(content_of(response))
    action = p.validate_call(call, p.COORDINATOR_TOOLS)
    assert isinstance(action, p.FinishAction)
    assert action.answer == "Oskarsholm" and action.confidence == "85%"
    assert "[doc-17]" in action.explanation


def test_fanout_three_gives_three_branch_calls() -> None:
    with serving(fanout=3) as url:
        calls = p.parse_calls(content_of(chat(url, first_turn())))
    assert [c.name for c in calls] == ["branch"] * 3
    assert all(QUESTION in c.params["prompt"] for c in calls)


def test_streamed_chunks_reassemble_to_the_same_content(base: str) -> None:
    whole = chat(base, first_turn()).json()
    events = stream_events(base, first_turn(), stream_options={"include_usage": True})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    *with_choices, usage_chunk = chunks
    assert with_choices[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["usage"] is None for c in with_choices)
    assert [c["choices"][0]["finish_reason"] for c in with_choices][-1] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in with_choices[:-1])
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in with_choices)
    assert text == whole["choices"][0]["message"]["content"]
    assert len(with_choices) > 3  # really streamed in pieces
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]

    # Without stream_options there is no usage chunk and no usage key.
    plain = [json.loads(e) for e in stream_events(base, first_turn())[:-1]]
    assert all("usage" not in c and len(c["choices"]) == 1 for c in plain)


def test_max_tokens_cuts_the_answer_with_finish_reason_length(base: str) -> None:
    full = content_of(chat(base, first_turn()))
    for field in ("max_tokens", "max_completion_tokens"):
        body = chat(base, first_turn(), **{field: 5}).json()
        assert_completion_shape(body, finish_reason="length")
        assert body["usage"]["completion_tokens"] == 5
        cut = body["choices"][0]["message"]["content"]
        assert full.startswith(cut) and len(cut) < len(full)
    events = [json.loads(e) for e in stream_events(base, first_turn(), max_tokens=5)[:-1]]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == cut

    # A stop string ends the answer before it, with finish_reason "stop".
    body = chat(base, first_turn(), stop=["<function=branch>"]).json()
    assert_completion_shape(body)
    assert body["choices"][0]["message"]["content"] == full[: full.index("<function=branch>")]


# --- errors, in OpenAI's shape -------------------------------------------------------------------


def test_n_2_is_refused_with_400_in_openai_error_shape(base: str) -> None:
    assert_openai_error(chat(base, first_turn(), n=2), 400, type="invalid_request_error", param="n")
    assert chat(base, first_turn(), n=1).status_code == 200


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        ({"model": MODEL}, 422, "messages"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 422, "messages[0].role"),
        ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 422, "messages[0].content"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 3},
            422,
            "temperature",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
            422,
            "max_tokens",
        ),
        ({"model": MODEL, "messages": []}, 400, "messages"),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            },
            400,
            "messages[0].content[0].type",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True},
            400,
            "logprobs",
        ),
        ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ],
)
def test_bad_requests_get_openai_errors(base: str, body: Any, status: int, param: str | None) -> None:
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(f"{base}/v1/chat/completions", timeout=5, **kwargs)
    error = assert_openai_error(response, status, type="invalid_request_error", param=param)
    if status == 404:
        assert error["code"] == "model_not_found" and MODEL in error["message"]


def test_unknown_v1_route_is_404_in_openai_shape(base: str) -> None:
    assert_openai_error(httpx.post(f"{base}/v1/embeddings", json={}, timeout=5), 404, param=None)


# --- models, health, metrics ---------------------------------------------------------------------


def test_models_health_and_metrics() -> None:
    with serving(model_name="MiniMax-M2.7") as url:
        models = httpx.get(f"{url}/v1/models", timeout=5).json()
        assert models["object"] == "list"
        (card,) = models["data"]
        assert card["id"] == "MiniMax-M2.7" and card["object"] == "model"
        assert isinstance(card["created"], int) and card["owned_by"]
        assert httpx.get(f"{url}/v1/models/MiniMax-M2.7", timeout=5).json() == card
        assert_openai_error(httpx.get(f"{url}/v1/models/other", timeout=5), 404, code="model_not_found")

        health = httpx.get(f"{url}/health", timeout=5)
        assert health.status_code == 200
        assert health.json() | {"version": None} == {
            "status": "ok",
            "service": "coordinator-llm",
            "version": None,
            "model": "MiniMax-M2.7",
            "policy": "scripted",
        }

        body = {"model": "MiniMax-M2.7", "messages": first_turn()}
        for _ in range(2):
            assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=5).status_code == 200
        assert httpx.post(f"{url}/v1/chat/completions", json={**body, "n": 3}, timeout=5).status_code == 400
        assert (
            httpx.post(f"{url}/v1/chat/completions", json=body | {"max_tokens": 2}, timeout=5).status_code
            == 200
        )
        assert metric(url, "bcstack_coordinator_llm_requests_total", outcome="ok") == 2
        assert metric(url, "bcstack_coordinator_llm_requests_total", outcome="invalid") == 1
        assert metric(url, "bcstack_coordinator_llm_requests_total", outcome="length") == 1
        assert metric(url, "bcstack_coordinator_llm_requests_total", outcome="fault_http500") == 0
        assert metric(url, "bcstack_coordinator_llm_request_duration_seconds_count") == 4
        assert metric(url, "bcstack_coordinator_llm_completion_tokens_total") > 0
        assert metric(url, "bcstack_http_requests_total", route="/v1/chat/completions", code="200") == 3


# --- API key -------------------------------------------------------------------------------------


def test_api_key_is_enforced_and_never_shown(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    wrong = "sk-wrong-0000"
    with serving(api_key=API_KEY, log_level="DEBUG") as url:
        missing = assert_openai_error(chat(url, first_turn()), 401, type="invalid_request_error")
        bad = assert_openai_error(
            chat(url, first_turn(), headers={"Authorization": f"Bearer {wrong}"}), 401, code="invalid_api_key"
        )
        basic = chat(url, first_turn(), headers={"Authorization": f"Basic {API_KEY}"})
        assert_openai_error(basic, 401)
        assert httpx.get(f"{url}/v1/models", timeout=5).status_code == 401

        good = {"Authorization": f"Bearer {API_KEY}"}
        assert p.parse_calls(content_of(chat(url, first_turn(), headers=good)))[0].name == "branch"
        assert httpx.get(f"{url}/v1/models", headers=good, timeout=5).status_code == 200
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200  # probes need no key
        assert metric(url, "bcstack_coordinator_llm_requests_total", outcome="unauthorized") == 3
    for error in (missing, bad):
        assert API_KEY not in json.dumps(error) and wrong not in json.dumps(error)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "wrong API key" in logged and "no API key" in logged  # the refusals were logged...
    assert "chat completion chatcmpl-" in logged  # ...and so was the accepted request
    assert API_KEY not in logged and wrong not in logged  # ...but never a key


# --- fault injection -----------------------------------------------------------------------------


def test_injected_http500() -> None:
    with serving(fail_rate=1.0, fail_mode="http500") as url:
        assert_openai_error(chat(url, first_turn()), 500, type="server_error")
        assert metric(url, "bcstack_coordinator_llm_requests_total", outcome="fault_http500") == 1


def test_injected_http429_has_retry_after() -> None:
    with serving(fail_rate=1.0, fail_mode="http429", retry_after_seconds=3) as url:
        response = chat(url, first_turn())
        assert_openai_error(response, 429, code="rate_limit_exceeded")
        assert response.headers["retry-after"] == "3"
        # A bad request is still refused as such: faults only hit requests that would be answered.
        assert chat(url, first_turn(), n=2).status_code == 400


def test_injected_garbage_is_a_200_with_no_function_call() -> None:
    with serving(fail_rate=1.0, fail_mode="garbage") as url:
        response = chat(url, first_turn())
        assert_completion_shape(response.json())
        content = content_of(response)
        assert p.parse_calls(content) == [] and "<function=" in content
        events = stream_events(url, first_turn())
        text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
        assert text == content


def test_injected_hang_outlasts_a_client_timeout() -> None:
    hang = 1.0
    with serving(fail_rate=1.0, fail_mode="hang", hang_seconds=hang) as url:
        body = {"model": MODEL, "messages": first_turn()}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/chat/completions", json=body, timeout=0.3)
        started = time.monotonic()
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=10)
        assert time.monotonic() - started >= hang * 0.9
        assert p.parse_calls(content_of(response))[0].name == "branch"  # slow, not broken


def test_fail_rate_half_with_a_seed_gives_a_reproducible_pattern() -> None:
    def pattern(seed: int) -> list[int]:
        with serving(fail_rate=0.5, fail_mode="http500", fault_seed=seed) as url:
            return [chat(url, first_turn()).status_code for _ in range(16)]

    first, again, other = pattern(7), pattern(7), pattern(8)
    assert first == again
    assert set(first) == {200, 500}
    assert first != other
    # The pattern is the injector's: one seeded draw per chat completion.
    injector = FaultInjector(0.5, "http500", 7)
    assert first == [500 if injector.draw() else 200 for _ in range(16)]


def test_admin_faults_turn_injection_on_and_off_at_runtime() -> None:
    token = "faults-token"
    auth = {"Authorization": f"Bearer {token}"}
    with serving(admin_token=token) as url:
        assert chat(url, first_turn()).status_code == 200
        assert httpx.get(f"{url}/admin/faults", headers=auth, timeout=5).json() == {
            "fail_rate": 0.0, "fail_mode": "http500", "fault_seed": 0
        }  # fmt: skip
        on = httpx.put(f"{url}/admin/faults", json={"fail_rate": 1.0}, headers=auth, timeout=5)
        assert on.status_code == 200 and on.json()["fail_rate"] == 1.0
        assert_openai_error(chat(url, first_turn()), 500, type="server_error")
        mode = httpx.put(f"{url}/admin/faults", json={"fail_mode": "http429"}, headers=auth, timeout=5)
        assert mode.json() == {"fail_rate": 1.0, "fail_mode": "http429", "fault_seed": 0}
        assert chat(url, first_turn()).status_code == 429
        for bad in ({"fail_rate": 2}, {"fail_mode": "explode"}, {"rate": 1.0}):
            refused = httpx.put(f"{url}/admin/faults", json=bad, headers=auth, timeout=5)
            assert refused.status_code == 422, (bad, refused.text)
        assert httpx.put(f"{url}/admin/faults", json={"fail_rate": 0}, timeout=5).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert (
            httpx.put(f"{url}/admin/faults", json={"fail_rate": 0}, headers=wrong, timeout=5).status_code
            == 403
        )
        assert chat(url, first_turn()).status_code == 429  # the refused changes changed nothing
        off = httpx.put(f"{url}/admin/faults", json={"fail_rate": 0}, headers=auth, timeout=5)
        assert off.status_code == 200 and chat(url, first_turn()).status_code == 200
    with serving() as url:  # no admin token configured: the routes are disabled, never open
        assert httpx.put(f"{url}/admin/faults", json={"fail_rate": 1}, timeout=5).status_code == 403


# --- the command line ----------------------------------------------------------------------------


def test_cli_help_bad_policy_and_serving(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "services.coordinator_llm"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("BCSTACK_")}
    helped = subprocess.run([*cmd, "--help"], capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert helped.returncode == 0
    for name in ("--policy", "--fanout", "--config", "BCSTACK_COORDINATOR_LLM_API_KEY", "FAIL_MODE"):
        assert name in helped.stdout
    bad = subprocess.run(
        [*cmd, "--policy", "oracle"], capture_output=True, text=True, cwd=REPO, env=env, timeout=60
    )
    assert bad.returncode == 2
    assert bad.stderr.startswith("error:") and "--policy" in bad.stderr and "scripted" in bad.stderr

    port = find_free_port()
    log_path = tmp_path / "server.log"
    env |= {"BCSTACK_COORDINATOR_LLM_API_KEY": API_KEY, "BCSTACK_COORDINATOR_LLM_LOG_LEVEL": "DEBUG"}
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [*cmd, "--policy", "scripted", "--port", str(port), "--fanout", "2"],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=env,
        )
    url = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            assert proc.poll() is None, log_path.read_text()
            return httpx.get(f"{url}/health", timeout=1).status_code == 200

        wait_until(ready, timeout=30, interval=0.1, message="coordinator-llm ready")
        assert chat(url, first_turn()).status_code == 401
        response = chat(url, first_turn(), headers={"Authorization": f"Bearer {API_KEY}"})
        assert [c.name for c in p.parse_calls(content_of(response))] == ["branch", "branch"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    logged = log_path.read_text()
    assert "scripted policy served as model 'scripted-coordinator'" in logged
    assert API_KEY not in logged
