"""The CPU engine (`services/engine`) against SGLang's contract, and the worker's engine client.

Two real engine processes serve the module: the tiny Qwen3 model and the scripted expert policy,
each `bcstack serve engine` forked from a process that has imported it (`_start_engine`).
The model kit is "sharpened" (projection and embedding weights scaled up) so that greedy decoding
of the random model wanders through many tokens instead of repeating one, which makes
token-exact comparisons meaningful.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from conftest import find_free_port, wait_until
from stack_util import BcstackProcess

from core import engine_client as ec
from core.chat_template import render_chat
from devkit.modelkit.model import build_tiny_qwen3
from services.engine.scripted import parse_chatml

ADMIN = "test-admin-token"
CONTEXT = 2048
AUTH = {"Authorization": f"Bearer {ADMIN}"}

torch.set_num_threads(1)  # the reference forward passes are tiny; threads only add contention


# --- fixtures ------------------------------------------------------------------------------------


def _sharpen_and_save(model: Any, out: Path) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("proj.weight"):
                param.mul_(10)
        model.model.embed_tokens.weight.mul_(10)
    model.save_pretrained(out)


@pytest.fixture(scope="module")
def kits(tmp_path_factory, tiny_kit) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("kits")
    a, b = root / "a", root / "b"
    tiny_kit(a, seed=0)
    _sharpen_and_save(AutoModelForCausalLM.from_pretrained(a), a)
    shutil.copytree(a, b)
    _sharpen_and_save(build_tiny_qwen3(AutoTokenizer.from_pretrained(a), seed=1), b)
    return {"a": a, "b": b, "missing": root / "no-such-checkpoint"}


@pytest.fixture(scope="module")
def tokenizer(kits):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(kits["a"])


@pytest.fixture(scope="module")
def reference(kits):
    """The served models, loaded directly with transformers."""
    from transformers import AutoModelForCausalLM

    return {name: AutoModelForCausalLM.from_pretrained(kits[name]).eval() for name in ("a", "b")}


def _start_engine(args: list[str], log_path: Path) -> tuple[BcstackProcess, str]:
    """`bcstack serve engine ARGS` forked from a process that has imported it (stack_util, `forked`):
    its own process, without the ~8 s of CPU a new one spends importing torch and transformers.
    Stop it with its `stop()`."""
    port = find_free_port()
    args = ["serve", "engine", *args, "--port", str(port)]
    proc = BcstackProcess(args, log_path, {"BCSTACK_ADMIN_TOKEN": ADMIN}, forked=True)
    base = f"http://127.0.0.1:{port}"
    proc.wait_healthy(base + "/health", timeout=90)
    return proc, base


@pytest.fixture(scope="module")
def engine(kits, tmp_path_factory):
    log = tmp_path_factory.mktemp("engine-log") / "engine.log"
    proc, base = _start_engine(
        ["--model", str(kits["a"]), "--context-length", str(CONTEXT), "--max-running-requests", "8"], log
    )
    yield base
    proc.stop()


@pytest.fixture(scope="module")
def expert_engine(kits, tmp_path_factory):
    from devkit.toyworld.generator import generate_world, write_world

    world = generate_world(n_docs=450, seed=0, questions_per_tier=5, train_medium=5, train_hard=5)
    world_dir = tmp_path_factory.mktemp("world") / "w"
    write_world(world, world_dir)
    log = tmp_path_factory.mktemp("expert-log") / "engine.log"
    proc, base = _start_engine(
        ["--policy", "expert", "--tokenizer", str(kits["a"]), "--world", str(world_dir)], log
    )
    yield {"url": base, "world": world}
    proc.stop()


def _generate(base: str, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    response = httpx.post(base + "/generate", json=body, timeout=60)
    assert response.status_code == status, response.text
    return response.json()


def _greedy(base: str, ids: list[int], n: int, **extra: Any) -> dict[str, Any]:
    sampling = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **extra}
    return _generate(base, {"input_ids": ids, "sampling_params": sampling, "return_logprob": True})


def _reference_greedy(model: Any, ids: list[int], n: int) -> list[int]:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), generation_config=config)
    return out[0, len(ids) :].tolist()


def _reference_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1, from one forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:]).view(-1, 1)).view(-1)


PROMPTS = [
    [10, 20, 30],
    [400, 401, 402, 403, 404, 405, 406, 407],
    [7] * 25,
    [1000, 55, 2000, 66, 3000],
    [12, 3456, 789],
    [2222] * 3,
    [90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 100, 101],
    [3333, 44],
]


# --- /generate -----------------------------------------------------------------------------------


def test_generate_from_input_ids_and_from_text(engine, tokenizer):
    out = _generate(engine, {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 6}})
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == len(out["output_ids"]) <= 6
    assert meta["cached_tokens"] == 0 and meta["weight_version"] == "default" and meta["e2e_latency"] > 0
    assert out["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    assert "output_token_logprobs" not in meta  # only with return_logprob

    text = "The toy world has many cities"
    out = _generate(
        engine, {"text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "rid": "r1"}
    )
    assert out["meta_info"]["id"] == "r1"
    assert out["meta_info"]["prompt_tokens"] == len(tokenizer.encode(text, add_special_tokens=False))


def test_one_logprob_per_generated_token(engine):
    out = _generate(
        engine,
        {
            "input_ids": PROMPTS[1],
            "sampling_params": {"max_new_tokens": 16, "temperature": 1.0},
            "return_logprob": True,
        },
    )
    meta = out["meta_info"]
    logprobs = meta["output_token_logprobs"]
    assert len(logprobs) == meta["completion_tokens"] == len(out["output_ids"])
    assert [entry[1] for entry in logprobs] == out["output_ids"]
    assert all(entry[0] <= 0 and entry[2] is None for entry in logprobs)
    assert meta["input_token_logprobs"] == []  # logprob_start_len -1: output tokens only


def test_seeded_sampling_is_reproducible_and_seeds_differ(engine):
    def sample(seed: int) -> list[int]:
        sampling = {"max_new_tokens": 24, "temperature": 1.0, "top_p": 0.95, "sampling_seed": seed}
        return _generate(engine, {"input_ids": PROMPTS[2], "sampling_params": sampling})["output_ids"]

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first


def test_greedy_equals_transformers_generate(engine, reference):
    for ids in PROMPTS[:3]:
        out = _greedy(engine, ids, 16)
        assert out["output_ids"] == _reference_greedy(reference["a"], ids, 16)
        # Greedy log-probs are the raw model's (SGLang's sampler: log_softmax of unscaled logits).
        expected = _reference_logprobs(reference["a"], ids + out["output_ids"])[len(ids) - 1 :]
        got = torch.tensor([entry[0] for entry in out["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(got, expected, atol=1e-4)


def test_sampled_logprobs_are_temperature_scaled(engine, reference):
    ids = PROMPTS[3]
    sampling = {"max_new_tokens": 1, "temperature": 0.5, "top_k": 5, "sampling_seed": 7}
    out = _generate(engine, {"input_ids": ids, "sampling_params": sampling, "return_logprob": True})
    token = out["output_ids"][0]
    with torch.no_grad():
        logits = reference["a"](torch.tensor([ids])).logits[0, -1].float()
    # SGLang reports log softmax(logits / T) at the drawn token, before top-k/top-p filtering.
    expected = torch.log_softmax(logits / 0.5, dim=-1)[token]
    assert abs(out["meta_info"]["output_token_logprobs"][0][0] - float(expected)) < 1e-4
    assert token in torch.topk(logits, 5).indices.tolist()


def test_max_new_tokens_is_respected_and_reported_as_length(engine):
    out = _greedy(engine, PROMPTS[4], 5)
    assert len(out["output_ids"]) == 5
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


def test_stop_token_ids_and_stop_strings_stop_generation(engine, tokenizer):
    free = _greedy(engine, PROMPTS[5], 12)["output_ids"]
    stop = free[4]
    first = free.index(stop)
    out = _greedy(engine, PROMPTS[5], 12, stop_token_ids=[stop], ignore_eos=False)
    assert out["output_ids"] == free[: first + 1]  # the stop token is kept in output_ids ...
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == tokenizer.decode(free[:first])  # ... and trimmed from the text

    text = tokenizer.decode(free)
    needle = text[len(text) // 2 : len(text) // 2 + 3]
    out = _greedy(engine, PROMPTS[5], 12, stop=[needle])
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": needle}
    assert needle not in out["text"] and text.startswith(out["text"])


def test_scoring_with_zero_new_tokens_equals_a_forward_pass(engine, reference):
    ids = [5, 900, 17, 2048, 33, 4000, 12, 12, 8, 1500, 77, 3999, 250, 251, 252]
    out = _generate(
        engine,
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        },
    )
    entries = out["meta_info"]["input_token_logprobs"]
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert [e[1] for e in entries] == ids
    assert entries[0][0] is None  # SGLang: the first input token has no log-prob
    got = torch.tensor([e[0] for e in entries[1:]])
    assert torch.allclose(got, _reference_logprobs(reference["a"], ids), atol=1e-4)

    # A later start scores the tail; its first entry is None too (SGLang's list starts with None).
    out = _generate(
        engine,
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 10,
        },
    )
    entries = out["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == ids[10:] and entries[0][0] is None
    assert torch.allclose(torch.tensor([e[0] for e in entries[1:]]), got[10:], atol=1e-4)


def test_eight_concurrent_requests_batch_and_match_one_at_a_time(engine):
    from concurrent.futures import ThreadPoolExecutor

    alone = [_greedy(engine, ids, 24) for ids in PROMPTS]
    sum_before = _metric(engine, "bcstack_engine_decode_batch_size_sum")
    count_before = _metric(engine, "bcstack_engine_decode_batch_size_count")
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda ids: _greedy(engine, ids, 24), PROMPTS))
    for a, b in zip(alone, together, strict=True):
        assert b["output_ids"] == a["output_ids"]
        la = torch.tensor([e[0] for e in a["meta_info"]["output_token_logprobs"]])
        lb = torch.tensor([e[0] for e in b["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(la, lb, atol=1e-4)
    # 8 x 23 sequence-steps of decoding (the first token comes from the prefill) ran in far fewer
    # forward passes than one request at a time would take: they were batched.
    assert _metric(engine, "bcstack_engine_decode_batch_size_sum") - sum_before == 8 * 23
    assert _metric(engine, "bcstack_engine_decode_batch_size_count") - count_before < 8 * 23 / 2


def test_bad_requests_are_400_with_sglang_wording_and_the_engine_keeps_serving(engine):
    long_prompt = [11] * (CONTEXT + 5)
    out = _generate(engine, {"input_ids": long_prompt, "sampling_params": {"max_new_tokens": 1}}, status=400)
    assert out["error"]["message"] == (
        f"The input ({CONTEXT + 5} tokens) is longer than the model's context length ({CONTEXT} tokens)."
    )
    out = _generate(
        engine, {"input_ids": [11] * 100, "sampling_params": {"max_new_tokens": CONTEXT}}, status=400
    )
    assert out["error"]["message"].startswith(
        "Requested token count exceeds the model's maximum context length"
    )
    for body, words in [
        ({"input_ids": [[1, 2], [3]]}, "Batch requests"),
        ({"sampling_params": {"max_new_tokens": 1}}, "Either text, input_ids"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p must be in (0, 1]"),
        ({"input_ids": [1], "sampling_params": {"bogus": 1}}, "Unknown sampling parameter"),
        ({"input_ids": [1], "sampling_params": {"repetition_penalty": 1.3}}, "not supported"),
        ({"input_ids": [999_999]}, "vocab size"),
    ]:
        assert words in _generate(engine, body, status=400)["error"]["message"]
    assert len(_greedy(engine, PROMPTS[0], 3)["output_ids"]) == 3


def test_streaming_sends_cumulative_chunks_then_done(engine):
    body = {
        "input_ids": PROMPTS[0],
        "sampling_params": {"max_new_tokens": 5, "temperature": 0},
        "stream": True,
    }
    with httpx.stream("POST", engine + "/generate", json=body, timeout=30) as response:
        events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 5]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


# --- control -------------------------------------------------------------------------------------


def _metric(base: str, name: str, labels: str = "") -> float:
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + ("{" if labels else " ")) and labels in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric {name}{{{labels}}}")


def test_model_info_health_generate_and_metrics(engine, kits):
    info = httpx.get(engine + "/model_info", timeout=10).json()
    assert info["model_path"] == str(kits["a"]) and info["tokenizer_path"] == str(kits["a"])
    assert info["is_generation"] is True and info["weight_version"] == "default"
    assert httpx.get(engine + "/health_generate", timeout=30).status_code == 200
    text = httpx.get(engine + "/metrics", timeout=10).text
    for name in (
        "bcstack_engine_requests_total",
        "bcstack_engine_prompt_tokens_total",
        "bcstack_engine_generation_tokens_total",
        "bcstack_engine_running_requests",
        "bcstack_engine_queued_requests",
        "bcstack_engine_time_to_first_token_seconds_bucket",
        "bcstack_engine_e2e_request_latency_seconds_bucket",
    ):
        assert name in text
    names = {
        line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")
    }
    assert not any(":" in n for n in names)
    assert _metric(engine, "bcstack_engine_requests_total", 'finish_reason="length"') > 0


def test_admin_routes_need_the_admin_token(engine):
    admin = (
        "/pause_generation",
        "/continue_generation",
        "/update_weights_from_disk",
        "/flush_cache",
        "/abort_request",
    )
    for route in admin:
        assert httpx.post(engine + route, json={}, timeout=10).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert httpx.post(engine + route, json={}, headers=wrong, timeout=10).status_code == 403
    assert httpx.post(engine + "/flush_cache", headers=AUTH, timeout=10).status_code == 200


class _Stream:
    """A streamed generation read in a thread, chunk arrival times recorded."""

    def __init__(self, base: str, body: dict[str, Any]) -> None:
        self.chunks: list[dict[str, Any]] = []
        self.times: list[float] = []
        self.thread = threading.Thread(target=self._run, args=(base, {**body, "stream": True}), daemon=True)
        self.thread.start()

    def _run(self, base: str, body: dict[str, Any]) -> None:
        with httpx.stream("POST", base + "/generate", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    self.chunks.append(json.loads(line[6:]))
                    self.times.append(time.monotonic())

    def final(self) -> dict[str, Any]:
        self.thread.join(timeout=120)
        return self.chunks[-1]


def _pause(base: str, mode: str) -> None:
    response = httpx.post(base + "/pause_generation", json={"mode": mode}, headers=AUTH, timeout=30)
    assert response.json() == {"message": "Generation paused successfully.", "status": "ok"}


def _continue(base: str) -> None:
    response = httpx.post(base + "/continue_generation", headers=AUTH, timeout=30)
    assert response.json() == {"message": "Generation continued successfully.", "status": "ok"}


def test_pause_in_place_holds_decoding_until_continue(engine):
    body = {"input_ids": PROMPTS[6], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    stream = _Stream(engine, body)
    wait_until(lambda: len(stream.chunks) >= 3, timeout=30, message="stream started")
    _pause(engine, "in_place")
    paused_at = len(stream.chunks)
    time.sleep(0.6)
    assert len(stream.chunks) <= paused_at + 1  # at most the step already in flight
    assert httpx.get(engine + "/health", timeout=10).json()["paused"] == "in_place"
    assert httpx.get(engine + "/health_generate", timeout=30).status_code == 503
    _continue(engine)
    final = stream.final()
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 400}
    assert len(final["output_ids"]) == 400


def test_pause_retract_recomputes_and_continues_exactly(engine):
    expected = _greedy(engine, PROMPTS[7], 300)["output_ids"]
    stream = _Stream(
        engine, {"input_ids": PROMPTS[7], "sampling_params": {"max_new_tokens": 300, "temperature": 0}}
    )
    wait_until(lambda: len(stream.chunks) >= 3, timeout=30, message="stream started")
    _pause(engine, "retract")
    assert httpx.get(engine + "/health", timeout=10).json()["queued"] == 1
    _continue(engine)
    assert stream.final()["output_ids"] == expected


def test_pause_abort_ends_running_requests(engine):
    body = {"input_ids": PROMPTS[6], "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
    stream = _Stream(engine, body)
    wait_until(lambda: len(stream.chunks) >= 2, timeout=30, message="stream started")
    _pause(engine, "abort")
    final = stream.final()
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    _continue(engine)
    assert len(_greedy(engine, PROMPTS[0], 2)["output_ids"]) == 2


def test_update_weights_from_disk_swaps_models_and_refuses_bad_paths(engine, kits, reference):
    ids = PROMPTS[1]
    before = _greedy(engine, ids, 12)["output_ids"]

    def update(path: Path, version: str) -> httpx.Response:
        body = {"model_path": str(path), "weight_version": version}
        return httpx.post(engine + "/update_weights_from_disk", json=body, headers=AUTH, timeout=60)

    bad = update(kits["missing"], "broken")
    assert bad.status_code == 400
    assert bad.json()["success"] is False and "Failed to get weights iterator" in bad.json()["message"]
    assert httpx.get(engine + "/model_info", timeout=10).json()["weight_version"] == "default"
    assert _greedy(engine, ids, 12)["output_ids"] == before

    good = update(kits["b"], "v2")
    assert good.status_code == 200
    assert good.json() == {
        "success": True,
        "message": "Succeeded to update model weights. Weight version updated to v2.",
        "num_paused_requests": 0,
    }
    out = _greedy(engine, ids, 12)
    assert out["meta_info"]["weight_version"] == "v2"
    assert out["output_ids"] == _reference_greedy(reference["b"], ids, 12) != before
    assert httpx.get(engine + "/model_info", timeout=10).json()["model_path"] == str(kits["b"])

    assert update(kits["a"], "v3").status_code == 200  # back to model a for the tests after this one
    assert _greedy(engine, ids, 12)["output_ids"] == before


# --- the scripted expert engine ------------------------------------------------------------------


def test_parse_chatml_reads_back_the_rendering():
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "<think>\nx\n</think>\n\nok"},
        {"role": "user", "content": "obs"},
    ]
    assert parse_chatml(render_chat(messages, add_generation_prompt=True)) == messages
    assert parse_chatml(render_chat(messages)) == messages


def test_expert_engine_answers_a_task_with_a_search_call(expert_engine, tokenizer):
    from devkit.toyworld.policies import WORKER_TASK_TEMPLATE

    question = expert_engine["world"].test[0]["query"]
    messages = [{"role": "user", "content": WORKER_TASK_TEMPLATE.format(question=question)}]
    ids = tokenizer.encode(render_chat(messages, add_generation_prompt=True), add_special_tokens=False)
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 512, "temperature": 1.0},
        "return_logprob": True,
    }
    out = _generate(expert_engine["url"], body)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert "<function=search>" in out["text"] and "<parameter=query>" in out["text"]
    assert out["output_ids"][-1] == eos
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    assert [e[0] for e in out["meta_info"]["output_token_logprobs"]] == [0.0] * len(out["output_ids"])
    assert tokenizer.decode(out["output_ids"][:-1], skip_special_tokens=False).startswith("<think>")

    cut = _generate(expert_engine["url"], {**body, "sampling_params": {"max_new_tokens": 5}})
    assert cut["output_ids"] == out["output_ids"][:5]
    assert cut["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


# --- the worker's engine client ------------------------------------------------------------------


def test_engine_client_methods_against_the_engine(engine, kits, reference):
    async def run() -> None:
        async with ec.EngineClient(engine, admin_token=ADMIN, retries=2) as client:
            assert await client.health() and await client.health_generate()
            info = await client.model_info()
            assert info["model_path"] == str(kits["a"]) and info["is_generation"] is True

            result = await client.generate(PROMPTS[0], max_new_tokens=8, temperature=0.0, top_p=1.0)
            assert len(result.output_ids) == len(result.logprobs) == result.completion_tokens == 8
            assert result.finish_reason == "length" and result.prompt_tokens == 3 and result.latency_s > 0
            seeded = [
                await client.generate(
                    PROMPTS[1], max_new_tokens=8, temperature=1.0, top_p=0.9, top_k=50, seed=5
                )
                for _ in range(2)
            ]
            assert seeded[0].output_ids == seeded[1].output_ids
            stopped = await client.generate(
                PROMPTS[0],
                max_new_tokens=8,
                temperature=0.0,
                top_p=1.0,
                stop_token_ids=[result.output_ids[2]],
            )
            assert stopped.finish_reason == "stop" and stopped.matched == result.output_ids[2]

            scores = await client.score(PROMPTS[1])
            assert scores[0] is None
            expected = _reference_logprobs(reference["a"], PROMPTS[1])
            assert torch.allclose(torch.tensor(scores[1:]), expected, atol=1e-4)

            await client.flush_cache()
            await client.pause_generation("in_place")
            await client.continue_generation()
            ok, message = await client.update_weights_from_disk(str(kits["missing"]), "x")
            assert not ok and "Failed" in message
            ok, message = await client.update_weights_from_disk(str(kits["a"]), "v4")
            assert ok and "v4" in message
            assert await client.weight_version() == "v4"

            with pytest.raises(ec.EngineError) as refused:
                await client.generate([1] * (CONTEXT + 1), max_new_tokens=1, temperature=0, top_p=1)
            assert refused.value.status == 400 and "context length" in refused.value.message
            assert not isinstance(refused.value, ec.EngineUnavailable)

        async with ec.EngineClient(engine) as no_admin:
            with pytest.raises(ec.EngineError) as forbidden:
                await no_admin.pause_generation("in_place")
            assert forbidden.value.status == 401

    asyncio.run(run())


class _RefusedOnce(httpx.AsyncBaseTransport):
    """Sends the first request to a port nothing listens on (a real ECONNREFUSED), then passes through."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.dead_port = find_free_port()
        self.calls = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        if self.calls == 1:
            request.url = request.url.copy_with(port=self.dead_port)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def test_engine_client_retries_a_refused_connection_then_succeeds(engine):
    transport = _RefusedOnce()

    async def run() -> ec.GenerateResult:
        async with ec.EngineClient(engine, retries=3, backoff_s=0.01, transport=transport) as client:
            return await client.generate(PROMPTS[0], max_new_tokens=2, temperature=0, top_p=1)

    assert len(asyncio.run(run()).output_ids) == 2
    assert transport.calls == 2


def test_engine_client_does_not_retry_4xx_and_gives_up_on_dead_engines():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(400, json={"error": {"message": "bad input"}})

    async def run_4xx() -> None:
        client = ec.EngineClient(
            "http://engine", retries=5, backoff_s=0.01, transport=httpx.MockTransport(handler)
        )
        with pytest.raises(ec.EngineError, match="bad input"):
            await client.generate([1], max_new_tokens=1, temperature=0, top_p=1)
        await client.close()

    asyncio.run(run_4xx())
    assert len(calls) == 1

    async def run_dead() -> None:
        client = ec.EngineClient(f"http://127.0.0.1:{find_free_port()}", retries=2, backoff_s=0.01)
        with pytest.raises(ec.EngineUnavailable):
            await client.generate([1], max_new_tokens=1, temperature=0, top_p=1)
        assert not await client.health()
        await client.close()

    asyncio.run(run_dead())


# --- the contract with SGLang (names: tests/test_sglang_contract.py) ----------------------------


@pytest.fixture(scope="module")
def pinned():
    """The pinned SGLang version's facts, read from its wheel (devkit.sglang)."""
    from devkit.sglang import facts, source

    return facts.read(source.load(source.pinned_version()))


def test_client_sends_and_reads_only_pinned_names(pinned):
    """Every body the client sends uses SGLang's names; answers built from them alone are enough."""
    sent: list[tuple[str, dict[str, Any]]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        sent.append((request.url.path, body))
        if request.url.path == "/generate":
            n = body["sampling_params"]["max_new_tokens"]
            meta = {
                "id": "x",
                "finish_reason": {"type": "length", "length": n},
                "prompt_tokens": len(body["input_ids"]),
                "completion_tokens": n,
                "weight_version": "w",
                "cached_tokens": 0,
                "e2e_latency": 0.5,
                "input_token_logprobs": [[None, body["input_ids"][0], None]]
                + [[-1.0, t, None] for t in body["input_ids"][1:]],
                "output_token_logprobs": [[-0.5, 7, None]] * n,
            }
            assert set(meta) <= set(pinned.of("meta_info"))
            return httpx.Response(200, json={"text": "", "output_ids": [7] * n, "meta_info": meta})
        if request.url.path == "/update_weights_from_disk":
            return httpx.Response(200, json={"success": True, "message": "ok", "num_paused_requests": 0})
        return httpx.Response(200, json={"message": "ok", "status": "ok"})

    async def run() -> None:
        client = ec.EngineClient("http://engine", transport=httpx.MockTransport(handler))
        result = await client.generate(
            [1, 2, 3], max_new_tokens=2, temperature=1.0, top_p=0.9, top_k=20, stop_token_ids=[9], seed=1
        )
        assert result.logprobs == [-0.5, -0.5] and result.weight_version == "w" and result.latency_s == 0.5
        assert await client.score([1, 2, 3]) == [None, -1.0, -1.0]
        assert await client.update_weights_from_disk("/ckpt", "v9", load_format="auto") == (True, "ok")
        await client.pause_generation("retract")
        await client.continue_generation()
        await client.close()

    asyncio.run(run())
    routes = {name.split(" ", 1)[1] for name in pinned.of("route")}
    for path, body in sent:
        assert path in routes
        if path == "/generate":
            assert set(body) <= set(pinned.of("GenerateReqInput"))
            assert set(body["sampling_params"]) <= set(pinned.of("SamplingParams"))
        elif path == "/update_weights_from_disk":
            assert set(body) <= set(pinned.of("UpdateWeightFromDiskReqInput"))
            assert body["flush_cache"] is True  # SGLang's default, unless a caller says otherwise
        elif path == "/pause_generation":
            assert set(body) <= set(pinned.of("PauseGenerationReqInput"))
    assert {"sampling_seed", "top_k", "stop_token_ids"} <= set(sent[0][1]["sampling_params"])
