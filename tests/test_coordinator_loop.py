"""The coordinator episode loop as a plain module: scripted chat turns, scripted worker outcomes."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from core import protocol as p
from core.v1 import common_pb2, worker_pb2
from services.coordinator.loop import Branch, LoopLimits, run_episode

LIMITS = LoopLimits(max_turns=5, max_branches=4, max_branches_per_turn=3, wall_time_seconds=10.0)


@dataclass
class Reply:
    content: str
    prompt_tokens: int = 10
    completion_tokens: int = 5
    attempts: int = 1
    seconds: float = 0.0


@dataclass
class Outcome:
    response: worker_pb2.RunWorkerEpisodeResponse | None
    replica: str | None = "w0"
    attempts: int = 1
    error: str = ""


def branch_call(desc: str, prompt: str = "find it") -> str:
    return p.render_call(p.FunctionCall("branch", {"description": desc, "prompt": prompt}))


def finish_call(answer: str, confidence: str = "90%") -> str:
    return p.render_call(
        p.FunctionCall("finish", {"answer": answer, "explanation": "because", "confidence": confidence})
    )


def scripted_chat(turns: list[str | Exception], seen: list[list[dict]] | None = None):
    queue = list(turns)

    async def chat(messages):
        if seen is not None:
            seen.append(messages)
        item = queue.pop(0)
        if isinstance(item, Exception):
            raise item
        return Reply(item)

    return chat


def finished(description: str, answer: str) -> Outcome:
    report = p.render_worker_report(p.WorkerReportText(description, "finish", answer, "[d1] says so", "80%"))
    return Outcome(
        worker_pb2.RunWorkerEpisodeResponse(
            episode_id=f"w-{description}",
            report=common_pb2.WorkerReport(
                answer=answer, stop_reason=common_pb2.STOP_REASON_FINISH, raw_text=report
            ),
        )
    )


def answering_dispatch(answer: str = "Tartu", delay: float = 0.0, log: list | None = None):
    async def dispatch(branch: Branch):
        if log is not None:
            log.append(("start", branch.index))
        await asyncio.sleep(delay)
        if log is not None:
            log.append(("end", branch.index))
        return finished(branch.description, answer)

    return dispatch


def run(coro):
    return asyncio.run(coro)


def test_branch_then_finish_records_the_answer_and_the_report_reaches_the_coordinator():
    seen: list[list[dict]] = []
    events: list[tuple[str, dict]] = []
    episode = run(
        run_episode(
            "Where was the laureate born?",
            chat=scripted_chat([branch_call("birthplace"), finish_call("Tartu")], seen),
            dispatch=answering_dispatch(),
            limits=LIMITS,
            on_event=lambda kind, data: events.append((kind, data)),
        )
    )
    assert (episode.status, episode.answer, episode.confidence) == ("finish", "Tartu", "90%")
    assert episode.messages[1]["content"] == "Question: Where was the laureate born?"
    # the second chat call saw the worker report as the last user message
    last = seen[1][-1]
    assert last["role"] == "user" and p.parse_worker_reports(last["content"])[0].answer == "Tartu"
    assert [b.status for b in episode.branches] == ["finish"]
    assert (episode.prompt_tokens, episode.completion_tokens) == (20, 10)
    kinds = [k for k, _ in events]
    assert kinds == ["coordinator_turn", "branch_started", "branch_finished", "coordinator_turn"]


def test_branches_of_one_turn_run_concurrently_and_reports_keep_call_order():
    log: list = []

    async def dispatch(branch: Branch):
        log.append(("start", branch.index))
        await asyncio.sleep(0.05 * (3 - branch.index))  # the last call finishes first
        log.append(("end", branch.index))
        return finished(branch.description, f"answer-{branch.index}")

    turn = "\n".join(branch_call(f"task{i}") for i in range(3))
    episode = run(
        run_episode("q", chat=scripted_chat([turn, finish_call("x")]), dispatch=dispatch, limits=LIMITS)
    )
    assert [e for e in log[:3]] == [("start", 0), ("start", 1), ("start", 2)]  # all started before any ended
    reports = p.parse_worker_reports(episode.messages[3]["content"])
    assert [r.answer for r in reports] == ["answer-0", "answer-1", "answer-2"]


def test_malformed_output_gets_an_error_observation_and_the_loop_goes_on():
    bad_param = p.render_call(p.FunctionCall("branch", {"description": "no prompt"}))
    unknown = p.render_call(p.FunctionCall("search", {"query": "x"}))
    episode = run(
        run_episode(
            "q",
            chat=scripted_chat(["I will think.", bad_param, unknown, finish_call("y")]),
            dispatch=answering_dispatch(),
            limits=LIMITS,
        )
    )
    assert episode.status == "finish"
    observations = [m["content"] for m in episode.messages if m["role"] == "user"][1:]
    assert observations[0] == p.NO_CALL_ERROR
    assert observations[1] == p.missing_parameter_error("branch", "prompt")
    assert observations[2] == p.unsupported_function_error("search")
    assert episode.branches == []


def test_turn_limit_ends_the_episode_with_status_turns():
    limits = LoopLimits(max_turns=2, max_branches=10, max_branches_per_turn=3, wall_time_seconds=10)
    episode = run(
        run_episode(
            "q",
            chat=scripted_chat([branch_call("a"), branch_call("b")]),
            dispatch=answering_dispatch(),
            limits=limits,
        )
    )
    assert (episode.status, len(episode.turns), len(episode.branches)) == ("turns", 2, 2)


def test_branch_limits_per_turn_and_per_episode():
    four = "\n".join(branch_call(f"t{i}") for i in range(4))
    episode = run(
        run_episode("q", chat=scripted_chat([four, four, four]), dispatch=answering_dispatch(), limits=LIMITS)
    )
    # turn 0: 3 of 4 run (per-turn cap); turn 1: the 1 left of 4 per episode; turn 2: none left
    assert [b.turn for b in episode.branches] == [0, 0, 0, 1]
    assert episode.status == "branches"
    assert "1 branch call(s) were not run" in episode.messages[3]["content"]
    assert "3 branch call(s) were not run" in episode.messages[5]["content"]


def test_wall_time_ends_a_hanging_worker_turn():
    limits = LoopLimits(max_turns=5, max_branches=4, max_branches_per_turn=3, wall_time_seconds=0.2)
    episode = run(
        run_episode(
            "q",
            chat=scripted_chat([branch_call("slow")]),
            dispatch=answering_dispatch(delay=5),
            limits=limits,
        )
    )
    assert episode.status == "wall_time" and "while workers were running" in episode.error
    assert episode.seconds < 2


def test_upstream_failure_ends_with_error_and_its_reason():
    episode = run(
        run_episode(
            "q",
            chat=scripted_chat(
                [branch_call("a"), RuntimeError("coordinator endpoint 'a': HTTP 503 after 5 attempts")]
            ),
            dispatch=answering_dispatch(),
            limits=LIMITS,
        )
    )
    assert episode.status == "error" and "HTTP 503" in episode.error
    assert len(episode.branches) == 1  # the work done before the failure is kept


def test_a_failed_branch_comes_back_as_an_error_report():
    async def dispatch(branch: Branch):
        return Outcome(None, None, 3, "all 3 attempts failed; last: w1 UNAVAILABLE")

    episode = run(
        run_episode(
            "q", chat=scripted_chat([branch_call("a"), finish_call("?")]), dispatch=dispatch, limits=LIMITS
        )
    )
    report = p.parse_worker_reports(episode.messages[3]["content"])[0]
    assert (report.status, report.description) == ("error", "a")
    assert episode.branches[0].status == "error"


def test_finish_in_the_same_turn_as_branches_ends_without_running_them():
    both = branch_call("a") + "\n" + finish_call("now")
    calls: list = []
    episode = run(
        run_episode("q", chat=scripted_chat([both]), dispatch=answering_dispatch(log=calls), limits=LIMITS)
    )
    assert (episode.status, episode.answer, calls) == ("finish", "now", [])


def test_cancellation_propagates():
    async def main():
        task = asyncio.create_task(
            run_episode(
                "q",
                chat=scripted_chat([branch_call("a")]),
                dispatch=answering_dispatch(delay=5),
                limits=LIMITS,
            )
        )
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
