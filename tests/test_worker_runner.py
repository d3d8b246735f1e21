"""The episode runner in-process: trajectories, limits at the boundary, and failures.

The engine here is a stand-in with the engine client's interface (the real CPU engine and the
scripted engine behind SGLang's HTTP API are exercised in test_worker_service.py); retrieval is
the toy BM25 double from toy_env.py behind the retrieval client's interface.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from toy_env import ToyRetrieval

from core import protocol as p
from core.budget import BudgetLimits
from core.chat_template import render_chat
from core.engine_client import EngineError, EngineUnavailable
from devkit.toyworld.generator import generate_world
from devkit.toyworld.policies import WORKER_TASK_TEMPLATE, expert_worker_policy
from services.worker.prompts import WORKER_SYSTEM_PROMPT
from services.worker.retrieval_client import RetrievalFailed
from services.worker.runner import EpisodeRunner, ProtocolSettings, Sampling


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, tiny_kit):
    from transformers import AutoTokenizer

    out = tiny_kit(tmp_path_factory.mktemp("tiny") / "model")
    return AutoTokenizer.from_pretrained(str(out))


@pytest.fixture(scope="module")
def world():
    return generate_world(2000, 0)


@dataclass
class Out:
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str = ""
    matched: object = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    weight_version: str = "v0"
    latency_s: float = 0.0
    version_spans: tuple = ()


@dataclass
class PolicyEngine:
    """Decodes the prompt, asks a policy for the reply, returns its tokens (like --policy expert)."""

    tokenizer: object
    policy: object
    calls: list[int] = field(default_factory=list)  # max_new_tokens asked per call
    prompts: list[list[int]] = field(default_factory=list)
    seeds: list[int | None] = field(default_factory=list)  # sampling_seed sent per call

    async def generate(self, input_ids, *, max_new_tokens, seed=None, **_):
        self.calls.append(max_new_tokens)
        self.prompts.append(list(input_ids))
        self.seeds.append(seed)
        messages = _messages_from(self.tokenizer.decode(input_ids, skip_special_tokens=False))
        reply = self.policy(messages)
        eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        ids = self.tokenizer.encode(reply, add_special_tokens=False) + [eos]
        if len(ids) > max_new_tokens:
            ids = ids[:max_new_tokens]
            return Out(ids, [-0.5] * len(ids), "length")
        return Out(ids, [-0.5] * len(ids), "stop")


def _messages_from(text: str) -> list[dict]:
    messages = []
    for block in text.split("<|im_start|>")[1:]:
        role, _, rest = block.partition("\n")
        messages.append({"role": role, "content": rest.split("<|im_end|>")[0]})
    return [m for m in messages if m["content"] or m["role"] != "assistant"]


class FillerEngine:
    """Generates exactly max_new_tokens tokens of prose with no call (an untrained model)."""

    def __init__(self, tokenizer, per_turn: int | None = None) -> None:
        self.tok_id = tokenizer.encode(" the", add_special_tokens=False)[0]
        self.per_turn = per_turn
        self.calls: list[int] = []

    async def generate(self, input_ids, *, max_new_tokens, **_):
        self.calls.append(max_new_tokens)
        n = min(max_new_tokens, self.per_turn or max_new_tokens)
        return Out([self.tok_id] * n, [-1.0] * n, "length" if n == max_new_tokens else "stop")


class ToyRetrievalClient:
    def __init__(self, corpus, fail: bool = False) -> None:
        self.env = ToyRetrieval(corpus)
        self.fail = fail

    async def search(self, query, k, *, snippet_words=None):
        if self.fail:
            raise RetrievalFailed("retrieval 127.0.0.1:1: UNAVAILABLE: connection refused")
        return self.env.search(query, k)

    async def open(self, docid, url):
        return self.env.open(docid, url)


def _task(question: str) -> list[dict]:
    return [
        {"role": "system", "content": WORKER_SYSTEM_PROMPT},
        {"role": "user", "content": WORKER_TASK_TEMPLATE.format(question=question)},
    ]


def _run(runner, messages, **kw):
    return asyncio.run(runner.run(messages, **kw))


def test_an_episode_seed_gives_each_turn_its_own_seed_and_the_same_ones_on_every_run(tokenizer, world):
    """One episode seed fans out into a seed per turn: no turn replays another's uniforms, and a second
    run with the same seed (another model, for a paired comparison) draws the same ones turn by turn."""
    question = next(q for q in world.test if q["data_source"] == "bc_test_easy")["query"]

    def seeds_of(sampling):
        engine = PolicyEngine(tokenizer, expert_worker_policy)
        result = _run(EpisodeRunner(engine, ToyRetrievalClient(world.corpus), tokenizer), _task(question),
                      sampling=sampling)  # fmt: skip
        assert result.status == "finish"
        return engine.seeds

    first = seeds_of(Sampling(seed=7))
    assert len(first) >= 2 and len(set(first)) == len(first)
    assert all(isinstance(s, int) and 0 <= s <= 2**53 - 1 for s in first)
    assert seeds_of(Sampling(seed=7)) == first
    assert set(seeds_of(Sampling(seed=8))).isdisjoint(first)
    assert seeds_of(Sampling()) == [None] * len(first)  # unseeded: the engine draws fresh entropy


def test_expert_episodes_answer_and_trajectories_are_exact(tokenizer, world):
    engine = PolicyEngine(tokenizer, expert_worker_policy)
    runner = EpisodeRunner(engine, ToyRetrievalClient(world.corpus), tokenizer)
    easy = [q for q in world.test if q["data_source"] == "bc_test_easy"][:10]
    for q in easy:
        engine.prompts.clear()
        result = _run(runner, _task(q["query"]))
        assert result.status == "finish" and result.answer == q["answer"]
        t = result.trajectory
        # The mask covers exactly the generated tokens, and there is one log-prob per generated token.
        generated = [i for r in t.turns for i in range(r.gen_start, r.gen_end)]
        assert [i for i, m in enumerate(t.loss_mask) if m == 1] == generated
        assert len(t.rollout_logprobs) == len(generated) == result.completion_tokens
        # Each turn's prompt extends the previous turn's tokens (append-only, token level).
        for before, after in zip(engine.prompts, engine.prompts[1:], strict=False):
            assert after[: len(before)] == before
        # The trajectory is the chat template's rendering of the conversation, token for token.
        rendered = render_chat(result.messages)
        ids = tokenizer.encode(rendered, add_special_tokens=False)
        assert t.token_ids == ids[: len(t.token_ids)]
        assert t.token_ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert {c.name for c in t.tool_calls} <= {"search", "open_page", "finish"}
        assert (
            result.tokens_used
            == len(t.token_ids)
            == (result.prompt_tokens + result.completion_tokens + result.observation_tokens)
        )


def test_untrained_model_runs_out_of_budget_never_past_it(tokenizer, world):
    engine = FillerEngine(tokenizer)
    runner = EpisodeRunner(engine, ToyRetrievalClient(world.corpus[:50]), tokenizer)
    result = _run(runner, _task(world.test[0]["query"]))
    assert result.status == "budget"
    assert result.tokens_used <= 24_576
    assert all(n <= 4_096 for n in engine.calls)
    # max_new_tokens = min(4096, budget left) on every call.
    assert engine.calls[-1] < 4_096 or result.tokens_used == 24_576


def test_the_41st_turn_never_starts(tokenizer, world):
    engine = FillerEngine(tokenizer, per_turn=3)
    runner = EpisodeRunner(engine, ToyRetrievalClient(world.corpus[:50]), tokenizer)
    result = _run(runner, _task("anything"), limits=BudgetLimits(max_tokens=100_000, context_length=100_000))
    assert result.status == "turns" and result.turns == 40 and len(engine.calls) == 40
    # A turn without a call gets the no-call line alone (no nudge) and the episode goes on.
    assert result.messages[3]["content"] == p.NO_CALL_ERROR


def test_a_cut_turn_gets_its_end_token_with_mask_zero(tokenizer, world):
    engine = FillerEngine(tokenizer)
    runner = EpisodeRunner(engine, ToyRetrievalClient(world.corpus[:50]), tokenizer)
    result = _run(runner, _task("x"), limits=BudgetLimits(max_new_tokens_per_turn=16, max_turns=2))
    t = result.trajectory
    first = t.turns[0]
    assert first.finish_reason == "length" and first.generated_tokens == 16
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert t.token_ids[first.gen_end] == eos and t.loss_mask[first.gen_end] == 0
    assert t.turns[1].prompt_start == first.gen_end


def test_context_limit(tokenizer, world):
    engine = FillerEngine(tokenizer, per_turn=200)
    runner = EpisodeRunner(engine, ToyRetrievalClient(world.corpus[:50]), tokenizer)
    result = _run(runner, _task("x"), limits=BudgetLimits(max_tokens=50_000, context_length=1_000))
    assert result.status in ("context", "budget") and result.tokens_used <= 1_000
    assert result.status == "context"


class BrokenEngine:
    def __init__(self, exc) -> None:
        self.exc = exc

    async def generate(self, *a, **k):
        raise self.exc


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (EngineUnavailable(None, "connection refused"), "error"),
        (EngineError(400, "Input length (50000 tokens) exceeds the maximum context length"), "context"),
        (EngineError(500, "internal error"), "error"),
    ],
)
def test_engine_failures_are_recorded_stops(tokenizer, world, exc, status):
    runner = EpisodeRunner(BrokenEngine(exc), ToyRetrievalClient(world.corpus[:50]), tokenizer)
    result = _run(runner, _task("x"))
    assert result.status == status and result.trajectory.error and result.turns == 0


def test_retrieval_down_is_an_error_stop(tokenizer, world):
    engine = PolicyEngine(tokenizer, expert_worker_policy)
    runner = EpisodeRunner(engine, ToyRetrievalClient(world.corpus, fail=True), tokenizer)
    result = _run(runner, _task(world.test[0]["query"]))
    assert result.status == "error" and "UNAVAILABLE" in result.trajectory.error
    assert result.trajectory.tool_calls[-1].outcome == "error"


def test_empty_finish_is_bounced_and_nudge_is_a_setting(tokenizer, world):
    search = "<function=search>\n<parameter=query>Rukleind</parameter>\n</function>"
    replies = iter(
        [
            search,
            "<function=finish>\n<parameter=answer></parameter>\n</function>",
            "<function=finish>\n<parameter=answer>42</parameter>\n</function>",
        ]
    )
    engine = PolicyEngine(tokenizer, lambda _m: next(replies))
    runner = EpisodeRunner(engine, ToyRetrievalClient(world.corpus[:50]), tokenizer)
    result = _run(runner, _task("x"))
    assert result.status == "finish" and result.answer == "42"
    assert result.messages[3]["content"].endswith(p.REFLECTION_NUDGE.strip())
    assert result.messages[5]["content"] == p.EMPTY_FINISH_RESUBMIT

    engine = PolicyEngine(tokenizer, lambda _m: search)
    no_nudge = ProtocolSettings(reflection_nudge=False)
    quiet = EpisodeRunner(engine, ToyRetrievalClient(world.corpus[:50]), tokenizer, protocol=no_nudge)
    result = _run(quiet, _task("x"), limits=BudgetLimits(max_turns=2))
    assert result.messages[3]["content"].startswith('[Search Results for "Rukleind"]')
    assert p.REFLECTION_NUDGE.strip() not in result.messages[3]["content"]


def test_stop_gate_can_ask_for_an_answer(tokenizer, world):
    seen = []

    def gate(messages, budget):
        seen.append(budget.turns)
        return "STOP: answer now." if budget.turns >= 2 else None

    engine = FillerEngine(tokenizer, per_turn=4)
    runner = EpisodeRunner(engine, ToyRetrievalClient(world.corpus[:50]), tokenizer, stop_gate=gate)
    result = _run(runner, _task("x"), limits=BudgetLimits(max_turns=3))
    assert seen == [1, 2, 3]
    assert result.messages[-1]["content"].endswith("STOP: answer now.")
