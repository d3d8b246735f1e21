"""`bcstack eval run`'s runner against a gateway and a judge answering in-process (httpx.MockTransport)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from bcstack.evaluation.loaders import EvalQuestion
from bcstack.evaluation.report import build_report, render_markdown
from bcstack.evaluation.runner import EvalRunner
from core.grading import exact_match, response_confidence

QUESTIONS = [
    EvalQuestion(query_id="1", query="Which town?", answer="Port Ellery", tier="easy"),
    EvalQuestion(query_id="2", query="Which year?", answer="1791", tier="medium"),
    EvalQuestion(query_id="3", query="Which boat?", answer="Kestrel", tier="hard"),
]
# What each question's coordinator episode ends with; question 2 runs out of budget before finish.
EPISODES = {
    "1": {"status": "finish", "answer": "Port Ellery", "explanation": "[d1]", "confidence": "85%"},
    "2": {"status": "budget", "answer": "", "explanation": "", "confidence": ""},
    "3": {"status": "finish", "answer": "Osprey", "explanation": "[d7]", "confidence": "40%"},
}


def stack_transport(graded: list[str]) -> httpx.MockTransport:
    """The gateway's episode endpoints and an LLM-style judge that, as the answer template tells it,
    reads 100 for a response stating no confidence."""
    records: dict[str, dict] = {}

    def handle(request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.path == "/v1/episodes":
            body = json.loads(request.content)
            records[body["episode_id"]] = {
                "episode_id": body["episode_id"],
                "workers": [],
                **EPISODES[body["question_id"]],
            }
            return httpx.Response(200, json={"episode_id": body["episode_id"]})
        if request.method == "GET" and request.url.path.startswith("/v1/episodes/"):
            return httpx.Response(200, json=records[request.url.path.rsplit("/", 1)[1]])
        if request.method == "POST" and request.url.path == "/v1/grade":
            body = json.loads(request.content)
            graded.append(body["response"])
            stated = response_confidence(body["response"])
            return httpx.Response(
                200,
                json={
                    "correct": exact_match(body["response"], body["correct_answer"]),
                    "confidence": 100.0 if stated is None else stated,
                    "grader_version": "test-llm",
                },
            )
        return httpx.Response(404)

    return httpx.MockTransport(handle)


@pytest.fixture
def eval_dir(tmp_path, monkeypatch):
    graded: list[str] = []
    transport = stack_transport(graded)
    client = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: client(transport=transport, **kw))
    out = tmp_path / "eval"
    runner = EvalRunner(out, "http://gateway", "http://judge", concurrency=1)
    run_id, tasks = runner.prepare(QUESTIONS, rounds=1)
    asyncio.run(runner.run(run_id, tasks))
    return out, graded


def test_an_episode_without_a_stated_confidence_is_judged_with_null_confidence(eval_dir):
    out, graded = eval_dir
    rows = {r["query_id"]: r for r in map(json.loads, (out / "judgements.jsonl").read_text().splitlines())}
    assert {q: (r["correct"], r["confidence"]) for q, r in rows.items()} == {
        "1": (True, 85.0),
        "2": (False, None),  # the judge said 100; nothing was stated
        "3": (False, 40.0),
    }
    # Neither the judge nor the run file is shown a confidence the episode never gave.
    assert len(graded) == 3  # one worker: the questions in order
    assert [response_confidence(text) for text in graded] == [85.0, None, 40.0]
    run = json.loads((out / "runs" / "0" / "2.json").read_text())
    assert response_confidence(run["result"][-1]["output"]) is None
    finished = json.loads((out / "runs" / "0" / "1.json").read_text())
    assert response_confidence(finished["result"][-1]["output"]) == 85.0


def test_the_report_calibrates_over_the_stated_confidences_only(eval_dir):
    out, _ = eval_dir
    report = build_report(out)
    assert (report.correct, report.total) == (1, 3)
    assert (report.calibration_n, report.calibration_unstated) == (2, 1)
    # (0.40, wrong) and (0.85, right) in one bin: mean confidence 0.625, accuracy 0.5.
    assert report.calibration_error == pytest.approx(0.125)
    assert (
        "Calibration error (HLE-style RMS, β=100): 12.50% (calibration over 2 judgements with a stated "
        "confidence; 1 without one)"
    ) in render_markdown(report)


def test_a_seeded_run_gives_each_question_and_round_its_own_seed_the_same_in_every_run(tmp_path, monkeypatch):
    """--seed: the episode body carries worker_sampling.seed derived from (seed, question, round), so
    two runs (two models) draw the same seeds pair by pair; a resume under another seed is refused."""
    from bcstack.evaluation.runner import EvalRunError
    from core.engine_client import derive_seed

    bodies: list[dict] = []
    inner = stack_transport([])

    def handle(request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.path == "/v1/episodes":
            bodies.append(json.loads(request.content))
        return inner.handle_request(request)

    client = httpx.AsyncClient
    monkeypatch.setattr(
        httpx, "AsyncClient", lambda **kw: client(transport=httpx.MockTransport(handle), **kw)
    )

    def seeds(out, seed):
        bodies.clear()
        runner = EvalRunner(out, "http://gateway", "http://judge", concurrency=1, seed=seed)
        run_id, tasks = runner.prepare(QUESTIONS, rounds=2)
        asyncio.run(runner.run(run_id, tasks))
        return {
            (b["question_id"], b["episode_id"][-1]): (b.get("worker_sampling") or {}).get("seed")
            for b in bodies
        }

    first = seeds(tmp_path / "sft", 7)
    assert first == {(q.query_id, str(r)): derive_seed(7, q.query_id, r) for q in QUESTIONS for r in (0, 1)}
    assert len(set(first.values())) == 6
    assert seeds(tmp_path / "rl", 7) == first  # another run id, the same seeds pair by pair
    assert set(seeds(tmp_path / "other", 8).values()).isdisjoint(first.values())
    assert set(seeds(tmp_path / "fresh", None).values()) == {None}  # no worker_sampling at all
    with pytest.raises(EvalRunError, match="seed 7, not 8"):
        EvalRunner(tmp_path / "sft", "http://gateway", "http://judge", seed=8).prepare(QUESTIONS, rounds=2)
