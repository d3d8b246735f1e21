"""What writes the coordinator's next turn: one small interface, one class per policy.

A policy maps the conversation so far (OpenAI chat messages flattened to `{"role", "content"}`
strings) to the next assistant message, written in the coordinator protocol (DESIGN.md §3:
`branch(description, prompt)` / `finish(answer, explanation, confidence)` function-call text).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from devkit.toyworld.policies import scripted_coordinator_policy
from services.coordinator_llm.settings import CoordinatorLlmSettings

Message = dict[str, str]


class CoordinatorPolicy(Protocol):
    name: str

    def next_turn(self, messages: Sequence[Message]) -> str: ...


@dataclass(frozen=True)
class ScriptedCoordinator:
    """The toy world's scripted coordinator: branch to `fanout` workers, then finish by vote."""

    fanout: int = 1
    max_rounds: int = 2
    name: str = "scripted"

    def next_turn(self, messages: Sequence[Message]) -> str:
        return scripted_coordinator_policy(messages, fanout=self.fanout, max_rounds=self.max_rounds)


def build_policy(settings: CoordinatorLlmSettings) -> CoordinatorPolicy:
    if settings.policy == "scripted":
        return ScriptedCoordinator(fanout=settings.fanout, max_rounds=settings.max_rounds)
    # Unreachable through settings validation; kept so a new Policy literal cannot pass silently.
    raise ValueError(f"unknown coordinator policy {settings.policy!r}; known: scripted")
