"""The CPU engine behaves as the pinned SGLang (0.5.19) where the stack depends on it, so that a
test against it fails where the real server would (docs/guide/hot-reload.md, "What the CPU engine mirrors"):
/model_info and the deprecated routes, the flush that needs an idle scheduler, the update's flush
assertion, the weight-version spans of a request that ran across a swap, the context boundary,
None at `logprob_start_len`, and the admin key. In process (tests/engine_inproc.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from engine_inproc import TOKEN, EngineHost

CONTEXT = 512
LONG = {"max_new_tokens": 300, "ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def kits(tmp_path_factory, tiny_kit):
    tmp = tmp_path_factory.mktemp("pinned")
    return {"a": tiny_kit(tmp / "a", seed=0), "b": tiny_kit(tmp / "b", seed=1)}


def _scenario(kits, body) -> Any:
    """Run `body(host, http)` against a fresh in-process engine serving kit a."""

    async def run() -> Any:
        host = await EngineHost(kits["a"], context_length=CONTEXT).start()
        try:
            async with host.client(timeout=60) as http:
                return await body(host, http)
        finally:
            await host.close()

    return asyncio.run(run())


async def _running(host: EngineHost, n: int = 1) -> None:
    """Wait until `n` requests are in the running batch with some output."""
    for _ in range(2000):
        s = host.core.scheduler
        if len(s.running) >= n and all(seq.output_ids for seq in s.running):
            return
        await asyncio.sleep(0.005)
    raise AssertionError("requests never started running")


def _generate(http: httpx.AsyncClient, ids: list[int], sampling: dict, **extra: Any) -> asyncio.Task:
    body = {"input_ids": ids, "sampling_params": sampling, **extra}
    return asyncio.create_task(http.post("/generate", json=body))


def test_model_info_and_the_deprecated_routes_answer_as_sglang(kits) -> None:
    async def body(host, http):
        info = (await http.get("/model_info")).json()
        alias = (await http.get("/get_model_info")).json()
        stubs = [await http.get(path) for path in ("/get_weight_version", "/weight_version")]
        return info, alias, stubs

    info, alias, stubs = _scenario(kits, body)
    assert info["weight_version"] == "default" and info["model_path"] == str(kits["a"])
    assert {"served_model_name", "tokenizer_path", "is_generation", "load_format"} <= set(info)
    assert alias == info
    for stub in stubs:
        assert stub.status_code == 404
        assert stub.json() == {
            "detail": "Endpoint '/get_weight_version' or '/weight_version' is deprecated. "
            "Please use '/model_info' instead."
        }


def test_flush_needs_an_idle_scheduler(kits) -> None:
    """0.5.19 flushes only when nothing runs and nothing waits, retracted requests included."""

    async def body(host, http):
        codes = {"idle": (await http.post("/flush_cache")).status_code}
        task = _generate(http, [5, 6, 7], LONG)
        await _running(host)
        await http.post("/pause_generation", json={"mode": "in_place"})
        refused = await http.post("/flush_cache")
        codes["in_place"] = (refused.status_code, refused.text)
        await http.post("/pause_generation", json={"mode": "retract"})
        codes["retract"] = (await http.post("/flush_cache")).status_code
        # Requests sent while paused wait outside the scheduler: they do not block a flush there.
        await http.post("/continue_generation", json={})
        codes["done"] = (await task).json()["meta_info"]["finish_reason"]
        await http.post("/pause_generation", json={"mode": "in_place"})
        held = _generate(http, [5, 6, 7], {"max_new_tokens": 4})
        await asyncio.sleep(0.05)
        codes["held"] = (await http.post("/flush_cache")).status_code
        await http.post("/continue_generation", json={})
        codes["held_done"] = len((await held).json()["output_ids"])
        return codes

    codes = _scenario(kits, body)
    assert codes["idle"] == 200
    assert codes["in_place"] == (400, "Flush cache failed.\n")
    assert codes["retract"] == 400
    assert codes["done"] == {"type": "length", "length": 300}
    assert codes["held"] == 200 and codes["held_done"] == 4


def test_an_update_whose_flush_is_refused_takes_the_engine_down(kits) -> None:
    """0.5.19: the weights load, then `assert flush_cache_success` fires in the scheduler and the
    server goes down, its label never moved."""

    async def body(host, http):
        task = _generate(http, [5, 6, 7], LONG)
        await _running(host)
        update = {"model_path": str(kits["b"]), "weight_version": "b1"}  # flush_cache: true, the default
        answer = await http.post("/update_weights_from_disk", json=update)
        generated = (await task).json()["meta_info"]["finish_reason"]
        after = [(await http.get(p)).status_code for p in ("/health", "/model_info")]
        return answer, generated, after, host.core.weight_version

    answer, generated, after, label = _scenario(kits, body)
    assert answer.status_code == 503 and "Cache flush failed after updating weights" in answer.text
    assert generated["type"] == "abort"
    assert after == [503, 200] and label == "default"


def test_a_request_running_across_a_swap_reports_both_versions(kits) -> None:
    """In place, flush_cache false: accepted with requests running; the answer's
    meta_info.weight_versions says which tokens each version made (0.5.19 weight_versions.py)."""

    async def body(host, http):
        task = _generate(http, [5, 6, 7], LONG)
        await _running(host)
        await http.post("/pause_generation", json={"mode": "in_place"})
        made = len(host.core.scheduler.running[0].output_ids)
        update = {"model_path": str(kits["b"]), "weight_version": "b1", "flush_cache": False}
        answer = await http.post("/update_weights_from_disk", json=update)
        await http.post("/continue_generation", json={})
        meta = (await task).json()["meta_info"]
        fresh = await http.post(
            "/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 3}}
        )
        info = (await http.get("/model_info")).json()
        return made, answer.json(), meta, fresh.json()["meta_info"], info

    made, answer, meta, fresh, info = _scenario(kits, body)
    assert answer["success"] is True and info["weight_version"] == "b1"
    assert meta["weight_version"] == "b1"
    assert meta["weight_versions"] == [
        {"version": "default", "start": 0, "end": made},
        {"version": "b1", "start": made, "end": 300},
    ]
    assert fresh["weight_versions"] == [{"version": "b1", "start": 0, "end": 3}]


def test_the_context_boundary_is_inclusive_and_the_scheduler_trims(kits) -> None:
    async def body(host, http):
        exact = await http.post("/generate", json={"input_ids": [5] * (CONTEXT - 10), "sampling_params": {
            "max_new_tokens": 10, "ignore_eos": True}})  # fmt: skip
        over = await http.post("/generate", json={"input_ids": [5] * (CONTEXT - 10), "sampling_params": {
            "max_new_tokens": 11}})  # fmt: skip
        return exact, over

    exact, over = _scenario(kits, body)
    assert exact.status_code == 200
    # max_req_len = context - 1, and max_new_tokens <= max_req_len - prompt - 1 (0.5.19 scheduler).
    assert exact.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert len(exact.json()["output_ids"]) == 8
    assert over.status_code == 400
    assert "You requested a total of 513 tokens" in over.json()["error"]["message"]


def test_no_logprob_for_the_token_at_logprob_start_len(kits) -> None:
    async def body(host, http):
        ids = [5, 6, 7, 8, 9]
        answer = await http.post("/generate", json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": 2})  # fmt: skip
        return answer.json()["meta_info"]["input_token_logprobs"]

    entries = _scenario(kits, body)
    assert [e[1] for e in entries] == [7, 8, 9]
    assert entries[0][0] is None and all(isinstance(e[0], float) for e in entries[1:])


def test_the_admin_key_guards_the_admin_routes_only(kits) -> None:
    async def body(host, http):
        async with httpx.AsyncClient(transport=host.transport, base_url="http://engine") as bare:
            admin = [
                (await bare.post(path, json={})).status_code
                for path in (
                    "/pause_generation",
                    "/flush_cache",
                    "/abort_request",
                    "/update_weights_from_disk",
                )
            ]
            wrong = {"Authorization": "Bearer not-the-key"}
            rejected = (await bare.post("/flush_cache", headers=wrong)).status_code
            normal = (await bare.get("/model_info")).status_code
            accepted = (
                await bare.post("/flush_cache", headers={"Authorization": f"Bearer {TOKEN}"})
            ).status_code
        return admin, rejected, normal, accepted

    admin, rejected, normal, accepted = _scenario(kits, body)
    assert admin == [401] * 4 and rejected == 403 and normal == 200 and accepted == 200


def test_a_seed_past_the_documented_range_is_a_400_and_the_largest_one_samples(kits) -> None:
    # fuzz_http found a 500: a sampling_seed past int64 (SGLang keeps seeds in an int64 tensor)
    # reached torch's generator. The documented range is I-JSON's; its ends sample, past them is a 400.
    async def body(host, http):
        document = (await http.get("/openapi.json")).json()
        answers = {}
        for seed in (2**53 - 1, -(2**53 - 1), 2**53, -172057395339549736960):
            sampling = {"max_new_tokens": 2, "sampling_seed": seed}
            answers[seed] = await http.post(
                "/generate", json={"input_ids": [5, 6, 7], "sampling_params": sampling}
            )
        return document, answers

    document, answers = _scenario(kits, body)
    body = document["paths"]["/generate"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    (sampling,) = [b for b in body["properties"]["sampling_params"]["anyOf"] if b.get("type") == "object"]
    seed = sampling["properties"]["sampling_seed"]
    (integer,) = [branch for branch in seed["anyOf"] if branch.get("type") == "integer"]
    assert (integer["minimum"], integer["maximum"]) == (-(2**53 - 1), 2**53 - 1)
    for ok in (2**53 - 1, -(2**53 - 1)):
        assert answers[ok].status_code == 200, answers[ok].text
        assert answers[ok].json()["meta_info"]["completion_tokens"] == 2
    for refused in (2**53, -172057395339549736960):
        assert answers[refused].status_code == 400, answers[refused].text
        assert "sampling_seed" in answers[refused].json()["error"]["message"]
