"""Per-episode budget accounting for a worker (DESIGN.md §3; numbers from seed 001).

Seed 001 serves the worker with "episode budget 24,576 tokens, up to 40 turns, max 4,096
generated tokens per turn", SGLang context 40,960. The budget counts *every* token of the
trajectory: the rendered prompt (system + task), each generation and each observation.

The runner asks :meth:`WorkerBudget.before_turn` whether a turn may start and with how many
new tokens, then reports what happened with :meth:`add_generation` / :meth:`add_observation`.
The first limit that bites names the stop reason; reasons are checked in a fixed order
(``turns`` before ``budget`` before ``context``) so the same trajectory always gets the same one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

# Seed 001's worker limits and sampling: the one place these numbers are written. Settings,
# metric buckets and the tiny model kit refer to them.
MAX_TOKENS = 24_576  # episode budget: prompt + generations + observations
MAX_TURNS = 40  # assistant turns per episode
MAX_NEW_TOKENS_PER_TURN = 4_096  # generated tokens per turn at most
CONTEXT_LENGTH = 40_960  # the engine's context window (Qwen3-4B's)
TEMPERATURE = 1.0
TOP_P = 0.95


class StopReason(enum.StrEnum):
    FINISH = "finish"  # the model called finish with an answer
    BUDGET = "budget"  # the episode token budget is spent
    TURNS = "turns"  # the assistant-turn limit is reached
    CONTEXT = "context"  # the next prompt would not fit the server context
    ERROR = "error"  # the engine or a tool failed for good


@dataclass(frozen=True)
class BudgetLimits:
    max_tokens: int = MAX_TOKENS
    max_turns: int = MAX_TURNS
    max_new_tokens_per_turn: int = MAX_NEW_TOKENS_PER_TURN
    context_length: int = CONTEXT_LENGTH

    def __post_init__(self) -> None:
        for name in ("max_tokens", "max_turns", "max_new_tokens_per_turn", "context_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"budget limit {name} must be a positive integer, got {value!r}")

    def with_overrides(self, **overrides: int | None) -> BudgetLimits:
        """A copy with the given limits replaced; ``None`` keeps the current value."""
        unknown = set(overrides) - set(self.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown budget limit(s): {', '.join(sorted(unknown))}")
        values = {k: v for k, v in overrides.items() if v is not None}
        return BudgetLimits(**{**self.__dict__, **values})


@dataclass(frozen=True)
class TurnGrant:
    """Permission to run one assistant turn with at most ``max_new_tokens`` generated tokens."""

    max_new_tokens: int


@dataclass
class WorkerBudget:
    limits: BudgetLimits = field(default_factory=BudgetLimits)
    prompt_tokens: int = 0  # the initial rendered prompt (system + task)
    generated_tokens: int = 0
    observation_tokens: int = 0  # tool results and template glue between turns
    turns: int = 0
    per_turn: list[int] = field(default_factory=list)

    @property
    def tokens_used(self) -> int:
        return self.prompt_tokens + self.generated_tokens + self.observation_tokens

    @property
    def tokens_left(self) -> int:
        return max(0, self.limits.max_tokens - self.tokens_used)

    def start(self, prompt_tokens: int) -> StopReason | None:
        """Record the initial prompt; a prompt that alone exceeds a limit stops the episode."""
        if prompt_tokens < 0:
            raise ValueError("prompt_tokens must be >= 0")
        self.prompt_tokens = prompt_tokens
        if prompt_tokens >= self.limits.max_tokens:
            return StopReason.BUDGET
        if prompt_tokens >= self.limits.context_length:
            return StopReason.CONTEXT
        return None

    def before_turn(self) -> TurnGrant | StopReason:
        """May the next assistant turn start? ``max_new_tokens = min(per-turn cap, budget left)``,
        also kept inside the server context window."""
        if self.turns >= self.limits.max_turns:
            return StopReason.TURNS
        budget_left = self.tokens_left
        if budget_left <= 0:
            return StopReason.BUDGET
        context_left = self.limits.context_length - self.tokens_used
        if context_left <= 0:
            return StopReason.CONTEXT
        return TurnGrant(max_new_tokens=min(self.limits.max_new_tokens_per_turn, budget_left, context_left))

    def add_generation(self, n_tokens: int, granted: TurnGrant | None = None) -> None:
        """Count one finished assistant turn of ``n_tokens`` generated tokens.

        An engine that returns more tokens than the grant allowed is a bug upstream; it is refused
        here rather than silently overrunning the budget.
        """
        if n_tokens < 0:
            raise ValueError("n_tokens must be >= 0")
        if granted is not None and n_tokens > granted.max_new_tokens:
            raise ValueError(
                f"turn generated {n_tokens} tokens but only {granted.max_new_tokens} were granted"
            )
        self.turns += 1
        self.generated_tokens += n_tokens
        self.per_turn.append(n_tokens)

    def add_observation(self, n_tokens: int) -> StopReason | None:
        """Count the tokens appended after a turn (observation and template glue), if they fit.

        When they would take the trajectory past the budget or the context window they are not
        counted and the stop reason is returned: the runner ends the episode without appending
        them, so no trajectory ever holds more tokens than its budget.
        """
        if n_tokens < 0:
            raise ValueError("n_tokens must be >= 0")
        total = self.tokens_used + n_tokens
        if total > self.limits.max_tokens:
            return StopReason.BUDGET
        if total > self.limits.context_length:
            return StopReason.CONTEXT
        self.observation_tokens += n_tokens
        return None
