"""One coordinator episode: the coordinator LLM plans, `branch`es research to workers, `finish`es.

A plain module: the chat call and the branch dispatch are passed in, so the loop knows nothing of
HTTP, gRPC or the registry. The protocol is DESIGN.md §3's, parsed with the shared parser
(`core.protocol`): every assistant turn is parsed for `branch(description, prompt)` and
`finish(answer, explanation, confidence)` calls; several branches in one turn run concurrently;
their reports come back as the next user message, in the order the calls were written.

Limits (any of them ends the episode with that status): coordinator turns (`turns`), branches
over the episode (`branches`: a turn asking for branches when none are left), wall time
(`wall_time`). An upstream failure that outlived its retries ends it with `error`. Malformed
coordinator output is not fatal: it gets the protocol's one-line error observation, and the loop
goes on within the limits.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from core import protocol as p
from core.v1 import worker_pb2

COORDINATOR_SYSTEM_PROMPT = """\
You are the coordinator of a team of research workers answering a hard question that needs \
several facts found in a document collection. You cannot search yourself: you delegate research \
to workers, read their reports, and give the final answer.

Call a function by writing, after your reasoning:

<function=branch>
<parameter=description>a short label for the sub-task</parameter>
<parameter=prompt>complete, self-contained instructions for one worker: what to find and what \
to report back</parameter>
</function>

Each branch runs one worker with a search engine over the collection; several branch calls in \
one turn run at the same time. Each worker comes back with a report (its answer, an explanation \
citing [docid]s, its confidence), or a note that it ran out of budget or failed.

When you know the answer, or no more research can help, finish:

<function=finish>
<parameter=answer>the final answer, as short as possible</parameter>
<parameter=explanation>why, citing the workers' evidence</parameter>
<parameter=confidence>your confidence as a percentage, e.g. 80%</parameter>
</function>

You have at most {max_turns} turns and {max_branches} branches in all."""

QUESTION_TEMPLATE = "Question: {question}"

STATUSES = ("finish", "turns", "branches", "wall_time", "error")


class BranchResult(Protocol):
    """What a dispatch returns (services.coordinator.workers.BranchOutcome)."""

    response: worker_pb2.RunWorkerEpisodeResponse | None
    replica: str | None
    attempts: int
    error: str


class ChatReply(Protocol):
    """What a chat call returns (core.kit.upstream.ChatResult)."""

    content: str
    prompt_tokens: int
    completion_tokens: int
    attempts: int
    seconds: float


@dataclass(frozen=True)
class LoopLimits:
    max_turns: int
    max_branches: int
    max_branches_per_turn: int
    wall_time_seconds: float


@dataclass
class Branch:
    """One `branch` call and what became of it."""

    index: int  # 0-based over the episode, in dispatch order
    turn: int
    description: str
    prompt: str
    started_at: float = 0.0
    seconds: float = 0.0
    outcome: BranchResult | None = None

    @property
    def status(self) -> str:
        """The worker's stop reason (finish, budget, turns, context, error)."""
        if self.outcome is None or self.outcome.response is None:
            return "error"
        return _STOP_NAMES.get(self.outcome.response.report.stop_reason, "error")

    def report_text(self) -> str:
        """What the coordinator reads for this branch."""
        if self.outcome is not None and self.outcome.response is not None:
            return self.outcome.response.report.raw_text
        return p.render_worker_report(p.WorkerReportText(self.description, "error"))


@dataclass
class CoordinatorTurn:
    index: int
    seconds: float
    attempts: int
    prompt_tokens: int
    completion_tokens: int
    calls: list[str]  # function names as written
    errors: list[str]  # observation error lines this turn produced
    workers_seconds: float = 0.0  # waiting for this turn's branches
    total_seconds: float = 0.0  # the whole turn: chat, parsing, branches, observation

    @property
    def overhead_seconds(self) -> float:
        """The gateway's own time in this turn: everything but the LLM and worker waits."""
        return max(0.0, self.total_seconds - self.seconds - self.workers_seconds)


@dataclass
class CoordinatorEpisode:
    question: str
    messages: list[dict[str, str]] = field(default_factory=list)
    turns: list[CoordinatorTurn] = field(default_factory=list)
    branches: list[Branch] = field(default_factory=list)
    status: str = "error"
    error: str = ""
    answer: str = ""
    explanation: str = ""
    confidence: str = ""
    started_at: float = 0.0
    seconds: float = 0.0

    @property
    def prompt_tokens(self) -> int:
        return sum(t.prompt_tokens for t in self.turns)

    @property
    def completion_tokens(self) -> int:
        return sum(t.completion_tokens for t in self.turns)


_STOP_NAMES = {
    1: "finish",
    2: "budget",
    3: "turns",
    4: "context",
    5: "error",
}

EventSink = Callable[[str, dict[str, Any]], None]
ChatFn = Callable[[list[dict[str, str]]], Awaitable[ChatReply]]
DispatchFn = Callable[[Branch], Awaitable[BranchResult]]


class EpisodeFailed(Exception):
    """Raised by a chat function when the coordinator LLM cannot answer (retries exhausted)."""


def initial_messages(question: str, limits: LoopLimits) -> list[dict[str, str]]:
    system = COORDINATOR_SYSTEM_PROMPT.format(max_turns=limits.max_turns, max_branches=limits.max_branches)
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": QUESTION_TEMPLATE.format(question=question)},
    ]


def branch_limit_note(skipped: int, per_turn: int, per_episode: int, left: int) -> str:
    return (
        f"[Error] {skipped} branch call(s) were not run: at most {per_turn} per turn and "
        f"{per_episode} per episode ({left} left)."
    )


async def run_episode(
    question: str,
    *,
    chat: ChatFn,
    dispatch: DispatchFn,
    limits: LoopLimits,
    on_event: EventSink | None = None,
    clock: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], float] = time.time,
) -> CoordinatorEpisode:
    """Run one coordinator episode to its end; never raises for model, upstream or worker failures.

    ``chat`` raises (any exception) when the coordinator LLM cannot answer; the episode then ends
    with status ``error`` and the exception's message. Cancellation propagates.
    """
    emit = on_event or (lambda kind, data: None)
    episode = CoordinatorEpisode(question=question, messages=initial_messages(question, limits))
    episode.started_at = wall_clock()
    start = clock()
    deadline = start + limits.wall_time_seconds

    def remaining() -> float:
        return deadline - clock()

    try:
        episode.status = await _loop(episode, chat, dispatch, limits, emit, clock, remaining)
    finally:
        episode.seconds = clock() - start
    return episode


async def _loop(
    episode: CoordinatorEpisode,
    chat: ChatFn,
    dispatch: DispatchFn,
    limits: LoopLimits,
    emit: EventSink,
    clock: Callable[[], float],
    remaining: Callable[[], float],
) -> str:
    messages = episode.messages
    for turn_index in range(limits.max_turns):
        if remaining() <= 0:
            return "wall_time"
        t0 = clock()
        try:
            async with asyncio.timeout(remaining()):
                reply = await chat(list(messages))
        except TimeoutError:
            episode.error = f"wall time of {limits.wall_time_seconds:g} s ran out waiting for the coordinator"
            return "wall_time"
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the coordinator LLM is unreachable; its message is the reason
            episode.error = str(exc) or type(exc).__name__
            return "error"
        chat_seconds = clock() - t0  # the LLM wait: everything after it is the gateway's own work
        content = reply.content or ""
        messages.append({"role": "assistant", "content": content})
        calls = p.parse_calls(content)
        turn = CoordinatorTurn(
            index=turn_index,
            seconds=chat_seconds,
            attempts=reply.attempts,
            prompt_tokens=reply.prompt_tokens,
            completion_tokens=reply.completion_tokens,
            calls=[c.name for c in calls],
            errors=[],
        )
        episode.turns.append(turn)
        emit("coordinator_turn", {"turn": turn_index, "content": content, "calls": turn.calls})

        if not calls:
            turn.errors.append(p.NO_CALL_ERROR)
            messages.append({"role": "user", "content": p.NO_CALL_ERROR})
            turn.total_seconds = clock() - t0
            continue
        actions = [p.validate_call(c, p.COORDINATOR_TOOLS) for c in calls]
        finish = next((a for a in actions if isinstance(a, p.FinishAction)), None)
        if finish is not None:
            episode.answer, episode.explanation, episode.confidence = (
                finish.answer,
                finish.explanation,
                finish.confidence,
            )
            turn.total_seconds = clock() - t0
            return "finish"
        turn.errors += [a.message for a in actions if isinstance(a, p.CallError)]
        wanted = [a for a in actions if isinstance(a, p.BranchAction)]
        left = limits.max_branches - len(episode.branches)
        if wanted and left <= 0:
            episode.error = (
                f"the coordinator asked for more branches after all {limits.max_branches} were used"
            )
            return "branches"
        allowed = wanted[: min(left, limits.max_branches_per_turn)]
        if len(allowed) < len(wanted):
            turn.errors.append(
                branch_limit_note(
                    len(wanted) - len(allowed), limits.max_branches_per_turn, limits.max_branches, left
                )
            )
        branches = [
            Branch(
                index=len(episode.branches) + i, turn=turn_index, description=a.description, prompt=a.prompt
            )
            for i, a in enumerate(allowed)
        ]
        episode.branches += branches
        if branches:
            t_workers = clock()
            try:
                async with asyncio.timeout(remaining()):
                    await asyncio.gather(*(_run_branch(b, dispatch, emit, clock) for b in branches))
            except TimeoutError:
                episode.error = (
                    f"wall time of {limits.wall_time_seconds:g} s ran out while workers were running"
                )
                return "wall_time"
            finally:
                turn.workers_seconds = clock() - t_workers
        observation = "\n\n".join([*turn.errors, *(b.report_text() for b in branches)])
        messages.append({"role": "user", "content": observation})
        turn.total_seconds = clock() - t0
    return "turns"


async def _run_branch(
    branch: Branch, dispatch: DispatchFn, emit: EventSink, clock: Callable[[], float]
) -> None:
    branch.started_at = time.time()
    t0 = clock()
    emit("branch_started", {"branch": branch.index, "turn": branch.turn, "description": branch.description})
    try:
        branch.outcome = await dispatch(branch)
    finally:
        branch.seconds = clock() - t0
    out = branch.outcome
    emit(
        "branch_finished",
        {
            "branch": branch.index,
            "status": branch.status,
            "answer": out.response.report.answer if out and out.response else "",
            "replica": out.replica if out else None,
            "error": out.error if out else "",
            "seconds": round(branch.seconds, 3),
        },
    )
