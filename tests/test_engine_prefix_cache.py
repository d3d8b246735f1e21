"""The CPU engine's prefix cache (`services/engine/prefix_cache.py`): the index on its own, then
engines with the cache on (the default budget), off (`--prefix-cache-tokens 0`) and small, fed
worker-like multi-turn episodes (each request = the previous request + its output + more tokens).

The cache must be invisible in the outputs: the same tokens (greedy and seeded sampling) and the
same log-probs (to float round-off) as with it off, whatever the batch; visible only in
`meta_info.cached_tokens`, the metrics and the time saved.
"""

from __future__ import annotations

import random
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from conftest import wait_until
from test_engine import (
    AUTH,
    CONTEXT,
    _continue,
    _generate,
    _metric,
    _pause,
    _sharpen_and_save,
    _start_engine,
    _Stream,
)

from devkit.modelkit.model import build_tiny_qwen3
from services.engine import prefix_cache as pc
from services.engine.prefix_cache import PrefixCache

SEEDED = {"temperature": 1.0, "top_p": 0.95, "sampling_seed": 1234}  # the worker's sampling
GREEDY = {"temperature": 0.0}


# --- the index -----------------------------------------------------------------------------------


def test_match_finds_the_longest_held_prefix_across_entries_and_inside_a_partial_block():
    cache: PrefixCache[str] = PrefixCache(10_000, block=4)
    cache.insert(list(range(100, 120)), "a")  # 20 tokens
    cache.insert([*range(100, 110), *range(500, 513)], "b")  # shares 10 with a, 23 tokens
    assert cache.match([*range(100, 118), 7, 7]) == (18, "a")  # 4 blocks + 2 tokens of the 5th
    assert cache.match([*range(100, 110), 500, 501, 9]) == (12, "b")
    assert cache.match([*range(100, 110), 9, 9]) in {(10, "a"), (10, "b")}
    assert cache.match(list(range(100, 120)), limit=13) == (13, "a")  # never past `limit`
    assert cache.match([100, 101, 102, 9, 9, 9]) == (0, None)  # under one block: nothing shared
    assert cache.match([1, *range(100, 120)]) == (0, None)  # a prefix, not a substring


def test_an_episode_keeps_one_entry_its_latest_turn():
    cache: PrefixCache[str] = PrefixCache(10_000, block=4)
    turn = list(range(200, 230))
    cache.insert(turn, "turn 1")
    turn += list(range(300, 340))
    cache.insert(turn, "turn 2")  # holds turn 1's tokens: turn 1's entry goes
    assert len(cache) == 1 and cache.tokens == 70
    assert cache.match(list(range(200, 230))) == (30, "turn 2")
    assert not cache.insert(turn[:50], "a prefix of turn 2")  # already held
    assert len(cache) == 1


def test_least_recently_used_entries_go_first_under_the_token_budget():
    cache: PrefixCache[str] = PrefixCache(100, block=4)
    a, b, c = ([k * 1000 + i for i in range(40)] for k in (1, 2, 3))
    cache.insert(a, "a")
    cache.insert(b, "b")
    assert cache.match(a)[1] == "a"  # a is now the most recently used
    cache.insert(c, "c")  # 120 tokens > 100: b goes
    assert cache.match(b) == (0, None) and cache.match(a)[1] == "a" and cache.match(c)[1] == "c"
    assert cache.tokens == 80
    assert not cache.insert(list(range(101)), "over the whole budget") and cache.tokens == 80
    cache.clear()
    assert cache.tokens == 0 and cache.match(a) == (0, None)
    off: PrefixCache[str] = PrefixCache(0, block=4)
    assert not off.insert(a, "a") and off.match(a) == (0, None)


def test_a_hash_collision_never_gives_a_wrong_match(monkeypatch):
    monkeypatch.setattr(pc, "chain_hashes", lambda ids, blocks, block: [0] * blocks)  # all collide
    cache: PrefixCache[str] = PrefixCache(10_000, block=4)
    cache.insert(list(range(40)), "a")
    cache.insert(list(range(100, 140)), "b")
    assert cache.match([*range(100, 110), 0, 0]) == (10, "b")
    assert cache.match([0, 1, 2, 3, 4, 5, 6, 9, 9]) == (7, "a")
    assert cache.match([7] * 12) == (0, None)
    cache.insert([*range(100, 140), 5, 5], "b longer")  # drops b (a true prefix), not a
    assert len(cache) == 2 and cache.match(list(range(40)))[1] == "a"


# --- engines -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kits(tmp_path_factory, tiny_kit) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("kits")
    a, b = root / "a", root / "b"
    tiny_kit(a, seed=0)
    _sharpen_and_save(AutoModelForCausalLM.from_pretrained(a), a)
    shutil.copytree(a, b)
    _sharpen_and_save(build_tiny_qwen3(AutoTokenizer.from_pretrained(a), seed=1), b)
    return {"a": a, "b": b}


def _engine(kits, tmp_path_factory, name: str, extra: list[str]):
    log = tmp_path_factory.mktemp(f"engine-{name}") / "engine.log"
    args = ["--model", str(kits["a"]), "--context-length", str(CONTEXT), "--max-running-requests", "8"]
    return _start_engine([*args, *extra], log)


@pytest.fixture(scope="module")
def on(kits, tmp_path_factory):
    proc, base = _engine(kits, tmp_path_factory, "on", [])  # the default budget
    yield base
    proc.stop()


@pytest.fixture(scope="module")
def off(kits, tmp_path_factory):
    proc, base = _engine(kits, tmp_path_factory, "off", ["--prefix-cache-tokens", "0"])
    yield base
    proc.stop()


@pytest.fixture(scope="module")
def small(kits, tmp_path_factory):
    proc, base = _engine(kits, tmp_path_factory, "small", ["--prefix-cache-tokens", "256"])
    yield base
    proc.stop()


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


def _turn(base: str, ids: list[int], n: int, sampling: dict[str, Any], **body: Any) -> dict[str, Any]:
    params = {"max_new_tokens": n, "ignore_eos": True, **sampling}
    return _generate(base, {"input_ids": ids, "sampling_params": params, "return_logprob": True, **body})


def _episode(base: str, seed: int, sampling: dict[str, Any], turns: int = 3) -> list[tuple[list[int], dict]]:
    """(input_ids, response) per turn: each turn sends the whole trajectory, as the worker does."""
    ids, out = _tokens(seed, 120), []
    for t in range(turns):
        response = _turn(base, ids, 12, sampling)
        out.append((ids, response))
        ids = ids + response["output_ids"] + _tokens(seed * 100 + t, 40)  # the observation
    return out


def _logprobs(response: dict[str, Any], key: str = "output_token_logprobs") -> torch.Tensor:
    return torch.tensor([e[0] for e in response["meta_info"][key] if e[0] is not None])


def _same_outputs(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["output_ids"] == b["output_ids"]
    assert torch.allclose(_logprobs(a), _logprobs(b), atol=1e-4)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_multi_turn_episodes_hit_the_cache_and_match_the_engine_without_it(on, off, sampling):
    seed = 11 if sampling is GREEDY else 12
    cached, plain = _episode(on, seed, sampling), _episode(off, seed, sampling)
    for (ids, a), (same_ids, b) in zip(cached, plain, strict=True):
        assert ids == same_ids
        _same_outputs(a, b)
        assert b["meta_info"]["cached_tokens"] == 0
    assert cached[0][1]["meta_info"]["cached_tokens"] == 0
    for (before, response), (_, now) in zip(cached, cached[1:], strict=False):
        # Everything sent before comes from the cache but the last output token, whose KV the
        # previous request never computed (it was sampled, not fed).
        expected = len(before) + len(response["output_ids"]) - 1
        assert now["meta_info"]["cached_tokens"] == expected
        assert now["meta_info"]["prompt_tokens"] > expected


def test_an_exact_repeat_recomputes_its_last_token(on, off):
    ids = _tokens(21, 90)
    first, again = _turn(on, ids, 10, GREEDY), _turn(on, ids, 10, GREEDY)
    assert first["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] == len(ids) - 1
    _same_outputs(again, first)
    _same_outputs(again, _turn(off, ids, 10, GREEDY))


def test_input_logprobs_are_computed_not_taken_from_the_cache(on, off):
    ids = _tokens(31, 100)
    _turn(on, ids, 8, GREEDY)
    longer = ids + _tokens(32, 30)
    start = 60
    a = _turn(on, longer, 4, GREEDY, logprob_start_len=start)
    b = _turn(off, longer, 4, GREEDY, logprob_start_len=start)
    assert a["meta_info"]["cached_tokens"] == start  # the scored positions run through the model
    assert [e[1] for e in a["meta_info"]["input_token_logprobs"]] == longer[start:]
    key = "input_token_logprobs"
    assert torch.allclose(_logprobs(a, key), _logprobs(b, key), atol=1e-4)
    _same_outputs(a, b)


def test_cached_sequences_of_different_lengths_batch_like_alone(on, off):
    firsts = [(_tokens(40 + i, 30 + 25 * i), i) for i in range(6)]
    seconds = []
    for ids, i in firsts:
        out = _turn(on, ids, 6 + i, SEEDED)
        seconds.append(ids + out["output_ids"] + _tokens(50 + i, 10 + 7 * i))
    alone = [_turn(off, ids, 20, SEEDED) for ids in seconds]
    count_before = _metric(on, "bcstack_engine_decode_batch_size_count")
    with ThreadPoolExecutor(len(seconds)) as pool:
        together = list(pool.map(lambda ids: _turn(on, ids, 20, SEEDED), seconds))
    for a, b in zip(together, alone, strict=True):
        assert a["meta_info"]["cached_tokens"] > 0
        _same_outputs(a, b)
    assert _metric(on, "bcstack_engine_decode_batch_size_count") - count_before < 6 * 19 / 2  # batched


def test_metrics_count_hits_misses_and_cached_and_computed_prompt_tokens(on):
    names = (
        "bcstack_engine_prefix_cache_hits_total",
        "bcstack_engine_prefix_cache_misses_total",
        "bcstack_engine_cached_prompt_tokens_total",
        "bcstack_engine_computed_prompt_tokens_total",
    )
    before = [_metric(on, n) for n in names]
    episode = _episode(on, 61, SEEDED, turns=2)
    after = [_metric(on, n) for n in names]
    cached = episode[1][1]["meta_info"]["cached_tokens"]
    prompts = sum(len(ids) for ids, _ in episode)
    assert [b - a for a, b in zip(before, after, strict=True)] == [1, 1, cached, prompts - cached]
    assert _metric(on, "bcstack_engine_prefix_cache_tokens") >= len(episode[1][0])


def test_a_small_budget_evicts_the_least_recently_used(small):
    nexts = []
    for ids in (_tokens(71, 150), _tokens(72, 150)):  # each keeps 159 tokens (150 + 10 - 1) of KV
        out = _turn(small, ids, 10, GREEDY)
        assert out["meta_info"]["cached_tokens"] == 0
        nexts.append(ids + out["output_ids"] + [5] * 20)
    assert _metric(small, "bcstack_engine_prefix_cache_tokens") <= 256  # the two overflow 256
    assert _turn(small, nexts[1], 4, GREEDY)["meta_info"]["cached_tokens"] == 159
    assert _turn(small, nexts[0], 4, GREEDY)["meta_info"]["cached_tokens"] == 0  # evicted
    too_long = _tokens(73, 300)
    _turn(small, too_long, 2, GREEDY)
    assert _turn(small, too_long, 2, GREEDY)["meta_info"]["cached_tokens"] == 0  # over the budget


def test_flush_cache_empties_the_cache(on):
    ids = _tokens(81, 80)
    _turn(on, ids, 4, GREEDY)
    assert _metric(on, "bcstack_engine_prefix_cache_tokens") > 0
    assert httpx.post(on + "/flush_cache", headers=AUTH, timeout=10).status_code == 200
    assert _metric(on, "bcstack_engine_prefix_cache_tokens") == 0
    assert _turn(on, ids, 4, GREEDY)["meta_info"]["cached_tokens"] == 0


def test_a_retracted_sequence_resumes_from_its_kept_kv_exactly(on, off):
    ids = _tokens(101, 60)
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 300, "ignore_eos": True, **SEEDED}}
    stream = _Stream(on, body)
    wait_until(lambda: len(stream.chunks) >= 3, timeout=30, message="stream started")
    _pause(on, "retract")  # its KV goes to the cache; continuing takes it back
    assert httpx.get(on + "/health", timeout=10).json()["queued"] == 1
    _continue(on)
    final = stream.final()
    assert final["output_ids"] == _generate(off, body)["output_ids"]


def _update(base: str, path: Path, version: str) -> None:
    # flush_cache false: SGLang refuses the update's own flush while a request runs (the reload's choice).
    body = {"model_path": str(path), "weight_version": version, "flush_cache": False}
    response = httpx.post(base + "/update_weights_from_disk", json=body, headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text


def test_weight_updates_flush_the_cache_and_old_kv_is_never_reused(on, off, kits):
    warm = _tokens(91, 100)
    _turn(on, warm, 6, GREEDY)
    # A request running across the swap keeps its KV (in-place update) but must not feed the cache.
    # ignore_eos: where the swap lands depends on timing, and the new weights may pick EOS after it.
    running = _tokens(92, 100)
    params = {"max_new_tokens": 200, "ignore_eos": True, **GREEDY}
    stream = _Stream(on, {"input_ids": running, "sampling_params": params})
    wait_until(lambda: len(stream.chunks) >= 3, timeout=30, message="stream started")
    _pause(on, "in_place")
    try:
        for base in (on, off):
            _update(base, kits["b"], "b")
        _continue(on)
        final = stream.final()
        assert final["meta_info"]["finish_reason"]["type"] == "length"
        follow = running + final["output_ids"] + [5] * 10
        for ids in (warm + [5] * 10, follow):
            a, b = _turn(on, ids, 8, GREEDY), _turn(off, ids, 8, GREEDY)
            assert a["meta_info"]["cached_tokens"] == 0 and a["meta_info"]["weight_version"] == "b"
            _same_outputs(a, b)
        # The new weights' KV is cached as usual.
        nxt = follow + a["output_ids"] + [6] * 5
        assert _turn(on, nxt, 4, GREEDY)["meta_info"]["cached_tokens"] == len(follow) + 7
    finally:
        for base in (on, off):
            _update(base, kits["a"], "a")
