"""The runtime STOP gate's format, shared by the worker (which asks it) and the trainer (gate rows).

Seed 001 trains a worker on "gate" rows for a runtime STOP gate: between turns, a decision whether the
worker should stop researching and answer. Off in every seed evaluation, and off by default here.

One gate decision is one short generation by the worker model on the episode so far plus one question:

    messages = [*episode_so_far, {"role": "user", "content": latest observation}]
    prompt   = render_chat(gate_messages(messages), add_generation_prompt=True)
    reply    = "STOP" | "CONTINUE"   (optionally after a <think> block)

A gate row (chat JSONL, trained by `bcstack train sft`) is exactly that conversation with the decision
as the last assistant message and ``"supervise": "last"``, so only the decision is trained on:

    {"source": "gate", "supervise": "last", "label": "stop" | "continue", "hard_negative": bool,
     "messages": [system, task, assistant, observation, ..., {"role": "user", "content": GATE_QUESTION},
                  {"role": "assistant", "content": "STOP" | "CONTINUE"}]}

When the gate says STOP, the worker appends `GATE_STOP_MESSAGE` to the observation, asking the model
to call finish now. The wording is ours (written for this stack); a deployment whose checkpoint was
trained on other gate rows sets its own prompt.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

GATE_QUESTION = (
    "[Gate] Is the evidence for the final answer already in hand? Reply STOP to answer now or CONTINUE "
    "to keep researching."
)
GATE_STOP_MESSAGE = (
    "The evidence you need is in hand: call finish now with the exact answer, citing [docid]s."
)
STOP, CONTINUE = "STOP", "CONTINUE"
_DECISION = re.compile(r"\b(STOP|CONTINUE)\b")
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


def gate_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The conversation the gate decides on: the episode so far, then the gate question."""
    return [dict(m) for m in messages] + [{"role": "user", "content": GATE_QUESTION}]


def parse_decision(reply: str) -> str | None:
    """STOP or CONTINUE from a gate reply (reasoning in <think> ignored); None when it says neither."""
    found = _DECISION.search(_THINK.sub("", reply))
    return found.group(1) if found else None
