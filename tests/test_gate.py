"""The runtime STOP gate: its format (core/gate.py), gate rows from expert episodes
(trainer/gate_rows.py), and the model-backed gate in the worker's episode loop (services/worker/gate.py).
"""

from __future__ import annotations

import asyncio
import json

import pytest
from test_worker_runner import Out, PolicyEngine, ToyRetrievalClient, _messages_from, _task
from toy_env import ToyRetrieval, run_worker_episode
from transformers import AutoTokenizer

from core import protocol as p
from core.chat_template import render_chat
from core.engine_client import EngineUnavailable
from core.gate import CONTINUE, GATE_QUESTION, GATE_STOP_MESSAGE, STOP, parse_decision
from devkit.toyworld.policies import WORKER_TASK_TEMPLATE, expert_worker_policy
from services.worker.gate import ModelStopGate
from services.worker.runner import EpisodeRunner
from trainer.gate_rows import decision_points, messages_from_tokens
from trainer.sft_data import load_chat_jsonl


@pytest.fixture(scope="module")
def tokenizer(toy_kit):
    return AutoTokenizer.from_pretrained(toy_kit["dir"] / "tiny")


def _expert_episode(world, question):
    env = ToyRetrieval(world.corpus)
    return run_worker_episode(
        expert_worker_policy, WORKER_TASK_TEMPLATE.format(question=question["query"]), env
    )


def test_decisions_read_stop_continue_and_nothing_else():
    assert parse_decision("STOP") == STOP
    assert parse_decision("<think>\nnot STOP yet\n</think>\n\nCONTINUE") == CONTINUE
    assert parse_decision("stopping soon") is None and parse_decision("") is None


def test_gate_rows_say_stop_before_the_finish_and_continue_before_other_turns(toy_kit):
    world = toy_kit["world"]
    tiers = {"bc_test_easy": 1, "bc_test_meduim": 2, "bc_test_hard": 3}
    for q in world.test[::4]:
        ep = _expert_episode(world, q)
        rows = list(decision_points(ep.messages, q["answer"]))
        observations = sum(1 for m in ep.messages[2:] if m["role"] == "user")
        assert len(rows) == observations  # one decision per observation an assistant turn follows
        assert [r["label"] for r in rows][-1] == "stop"
        assert all(r["label"] == "continue" for r in rows[:-1])
        # The expert opens one page per hop before it finishes: at least that many decisions.
        assert len(rows) >= tiers[q["data_source"]] + 1
        for r in rows:
            assert r["supervise"] == "last" and r["messages"][-2] == {
                "role": "user",
                "content": GATE_QUESTION,
            }
            assert r["messages"][-1]["content"] == (STOP if r["label"] == "stop" else CONTINUE)
            # A hard negative: CONTINUE while the answer's text is already on screen.
            assert r["hard_negative"] == (
                r["label"] == "continue" and q["answer"].lower() in r["messages"][-3]["content"].lower()
            )


def test_gate_rows_train_only_the_decision(toy_kit, tokenizer, tmp_path):
    q = toy_kit["world"].test[0]
    rows = list(decision_points(_expert_episode(toy_kit["world"], q).messages, q["answer"]))
    path = tmp_path / "gate.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples, refused = load_chat_jsonl(path, tokenizer)
    assert refused == [] and len(samples) == len(rows)
    for sample, row in zip(samples, rows, strict=True):
        supervised = [t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m]
        assert tokenizer.decode(supervised, skip_special_tokens=False) == row["messages"][-1]["content"] + (
            "<|im_end|>"
        )
        assert sample.source == "gate"


def test_messages_come_back_from_a_trajectorys_tokens(toy_kit, tokenizer):
    q = toy_kit["world"].test[0]
    messages = _expert_episode(toy_kit["world"], q).messages
    ids = tokenizer.encode(render_chat(messages), add_special_tokens=False)
    back = messages_from_tokens(ids, lambda t: tokenizer.decode(t, skip_special_tokens=False))
    assert back == messages


def _gate_oracle(messages):
    """The worker model as a gate would see it: STOP once a page is open, CONTINUE before."""
    if messages[-1]["content"] == GATE_QUESTION:
        return STOP if "[Opened Page Content]" in messages[-2]["content"] else CONTINUE
    return expert_worker_policy(messages)


def test_the_model_gate_asks_the_engine_and_its_stop_reaches_the_model(toy_kit, tokenizer):
    world = toy_kit["world"]
    engine = PolicyEngine(tokenizer, _gate_oracle)
    decisions: list[tuple[str, int]] = []
    gate = ModelStopGate(engine, tokenizer, on_decision=lambda d, n: decisions.append((d, n)))
    runner = EpisodeRunner(engine, ToyRetrievalClient(world.corpus), tokenizer, stop_gate=gate)
    q = next(q for q in world.test if q["data_source"] == "bc_test_meduim")
    result = asyncio.run(runner.run(_task(q["query"])))
    assert result.status == "finish" and p.lenient_match(q["answer"], result.answer)
    # Medium: search, open, search|open, open, finish; the gate says STOP after each opened page.
    assert [d for d, _ in decisions][0] == "continue" and "stop" in [d for d, _ in decisions]
    assert all(n > 0 for _, n in decisions)
    stopped = [m for m in result.messages if m["role"] == "user" and GATE_STOP_MESSAGE in m["content"]]
    assert stopped and all("[Opened Page Content]" in m["content"] for m in stopped)
    # The gate's own generations are separate requests: the trajectory holds none of their prompts.
    gate_prompts = [
        ids for ids in engine.prompts if _messages_from(tokenizer.decode(ids))[-1]["content"] == GATE_QUESTION
    ]
    assert len(gate_prompts) == len(decisions)
    assert GATE_QUESTION not in tokenizer.decode(result.trajectory.token_ids)


def test_an_engine_error_at_the_gate_continues_the_episode(toy_kit, tokenizer):
    world = toy_kit["world"]
    policy_engine = PolicyEngine(tokenizer, expert_worker_policy)

    class GateDown:
        async def generate(self, input_ids, **kw):
            raise EngineUnavailable(None, "connection refused")

    decisions = []
    gate = ModelStopGate(GateDown(), tokenizer, on_decision=lambda d, n: decisions.append(d))
    runner = EpisodeRunner(policy_engine, ToyRetrievalClient(world.corpus), tokenizer, stop_gate=gate)
    q = world.test[0]
    result = asyncio.run(runner.run(_task(q["query"])))
    assert result.status == "finish" and p.lenient_match(q["answer"], result.answer)
    assert decisions and set(decisions) == {"error"}


def test_an_unclear_gate_reply_is_counted_and_read_as_continue(tokenizer):
    class Mumbles:
        async def generate(self, input_ids, *, max_new_tokens, **kw):
            ids = tokenizer.encode("perhaps", add_special_tokens=False)[:max_new_tokens]
            return Out(ids, [0.0] * len(ids), "length")

    decisions = []
    gate = ModelStopGate(Mumbles(), tokenizer, max_new_tokens=4, on_decision=lambda d, n: decisions.append(d))
    messages = [{"role": "user", "content": "task"}, {"role": "assistant", "content": "x"}]
    assert asyncio.run(gate(messages, None)) is None
    assert decisions == ["unclear"]
