"""A service that crashes and comes back is waited for, at every hop of an evaluation (the
regressions `tests/test_eval_stack.py` found by SIGKILLing each service of a running stack):
the runner waits for the gateway and the judge, the gateway's worker pool for a worker, the
worker's clients for the engine and retrieval. A failure that outlasts the wait is named in the
run file, and an unreachable judge stops the run instead of recording a verdict it never gave."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest
from conftest import find_free_port
from test_coordinator_workers import ScriptedWorker, WorkerServer, branch_request

from bcstack.evaluation.loaders import EvalQuestion
from bcstack.evaluation.runner import EvalRunError, EvalRunner
from core import engine_client as ec
from core.grading import exact_match
from core.v1 import retrieval_pb2
from services.coordinator.workers import WorkerPool
from services.worker.retrieval_client import RetrievalClient, RetrievalFailed

REAL_CLIENT = httpx.AsyncClient
QUESTION = EvalQuestion(query_id="q1", query="Which town?", answer="Port Ellery", tier="easy")
FINISHED = {"status": "finish", "answer": "Port Ellery", "explanation": "[d1]", "confidence": "85%"}


class FlakyStack:
    """A gateway and a judge in-process; `down[name]` calls to a service fail as a refused
    connection before it answers again; `drop_get` GETs of a record drop the connection."""

    def __init__(self, down: dict[str, int] | None = None, drop_get: int = 0, workers: list | None = None):
        self.down = dict(down or {})
        self.drop_get = drop_get
        self.workers = workers or []
        self.records: dict[str, dict] = {}
        self.episodes_run = 0
        self.grades = 0

    def _refused(self, name: str, request: httpx.Request) -> None:
        if self.down.get(name, 0) > 0:
            self.down[name] -= 1
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.host == "gateway":
            self._refused("gateway", request)
            if request.method == "POST":
                body = json.loads(request.content)
                if body["episode_id"] not in self.records:
                    self.episodes_run += 1
                    self.records[body["episode_id"]] = {
                        "episode_id": body["episode_id"],
                        "workers": self.workers,
                        **FINISHED,
                    }
                return httpx.Response(200, json={"episode_id": body["episode_id"]})
            if self.drop_get > 0:
                self.drop_get -= 1
                raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
            return httpx.Response(200, json=self.records[request.url.path.rsplit("/", 1)[1]])
        self._refused("judge", request)
        body = json.loads(request.content)
        self.grades += 1
        correct = exact_match(body["response"], body["correct_answer"])
        return httpx.Response(200, json={"correct": correct, "confidence": 85, "grader_version": "t"})


@pytest.fixture
def fast_sleep(monkeypatch):
    """Backoff sleeps of the runner and the gateway client shortened 100-fold (clock unchanged)."""
    real = asyncio.sleep
    monkeypatch.setattr(asyncio, "sleep", lambda s, *a, **k: real(min(s, 1) / 100, *a, **k))


def evaluate(tmp_path, monkeypatch, flaky: FlakyStack, service_wait: float = 60.0) -> list[dict]:
    transport = httpx.MockTransport(flaky.handle)
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: REAL_CLIENT(transport=transport, **kw))
    runner = EvalRunner(tmp_path / "eval", "http://gateway", "http://judge", service_wait=service_wait)
    run_id, tasks = runner.prepare([QUESTION], rounds=1)
    asyncio.run(runner.run(run_id, tasks))
    lines = (tmp_path / "eval" / "judgements.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_a_gateway_down_for_a_dozen_tries_is_waited_for_and_runs_the_episode_once(
    tmp_path, monkeypatch, fast_sleep
):
    # Before: six refused connections ended the run with "the gateway is unreachable".
    flaky = FlakyStack(down={"gateway": 12})
    rows = evaluate(tmp_path, monkeypatch, flaky)
    assert [(r["query_id"], r["correct"], r["status"], r["error"]) for r in rows] == [
        ("q1", True, "finish", "")
    ]
    assert flaky.episodes_run == 1


def test_a_gateway_lost_before_the_record_was_read_is_asked_again_not_rerun(
    tmp_path, monkeypatch, fast_sleep
):
    # Before: the dropped GET escaped the runner as a traceback.
    flaky = FlakyStack(drop_get=2)
    rows = evaluate(tmp_path, monkeypatch, flaky)
    assert len(rows) == 1 and rows[0]["correct"] is True
    assert flaky.episodes_run == 1  # the retried POST answered from the records


def test_a_judge_that_comes_back_grades_the_answer_instead_of_an_ungraded_verdict(
    tmp_path, monkeypatch, fast_sleep
):
    # Before: five refused connections recorded the question as ungraded (an incorrect answer).
    flaky = FlakyStack(down={"judge": 10})
    rows = evaluate(tmp_path, monkeypatch, flaky)
    assert [(r["correct"], r["grading_error"]) for r in rows] == [(True, None)]


def test_a_judge_away_past_the_wait_stops_the_run_and_records_nothing_for_it(tmp_path, monkeypatch):
    flaky = FlakyStack(down={"judge": 10_000})
    with pytest.raises(EvalRunError, match="the judge http://judge was unreachable for"):
        evaluate(tmp_path, monkeypatch, flaky, service_wait=0.5)
    assert not (tmp_path / "eval" / "judgements.jsonl").exists()
    # The same command later: the recorded episode is graded, not run again.
    flaky.down = {}
    rows = evaluate(tmp_path, monkeypatch, flaky)
    assert len(rows) == 1 and rows[0]["correct"] is True and flaky.episodes_run == 1


def test_a_failed_branch_is_named_in_the_run_file_and_the_judgement(tmp_path, monkeypatch):
    failed = {
        "branch": 0,
        "turn": 0,
        "status": "error",
        "error": "all 3 attempts failed; last: 127.0.0.1:50052 UNAVAILABLE: Connection refused",
    }
    rows = evaluate(tmp_path, monkeypatch, FlakyStack(workers=[failed]))
    assert rows[0]["error"].startswith("branch 0: worker service: all 3 attempts failed")
    run = json.loads((tmp_path / "eval" / "runs" / "0" / "q1.json").read_text())
    assert run["error"] == rows[0]["error"] and run["status"] == "finish"


def test_a_branch_waits_for_a_restarted_worker_instead_of_failing():
    async def scenario(wait: float) -> tuple:
        server = WorkerServer(ScriptedWorker("back"))  # not started yet: every replica is down
        pool = WorkerPool([server.address], attempts=3, cooldown_seconds=0.2, unavailable_wait_seconds=wait)
        branch = asyncio.create_task(pool.run(branch_request("e1.w0")))
        await asyncio.sleep(1.5)  # the old pool had used its 3 attempts within ~0.2 s
        await server.start()
        outcome = await asyncio.wait_for(branch, 20)
        await pool.close()
        await server.stop()
        return outcome, server.worker.episode_ids

    outcome, ids = asyncio.run(scenario(30.0))
    assert outcome.error == "" and outcome.response.report.answer == "back" and ids == ["e1.w0"]
    failed, ids = asyncio.run(scenario(0.0))  # 0: each refusal is an attempt, as before
    assert failed.response is None and "UNAVAILABLE" in failed.error and ids == []


def test_an_engine_that_restarts_mid_episode_is_waited_for():
    calls = {"n": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        if calls["n"] <= 4:  # killed: connections refused
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        if calls["n"] <= 6:  # restarted, still loading its model
            return httpx.Response(503, json={"error": {"message": "The engine is still loading its model."}})
        return httpx.Response(200, json={"text": "x", "output_ids": [7], "meta_info": GENERATED})

    async def generate(wait: float):
        client = ec.EngineClient(
            "http://engine",
            retries=2,
            backoff_s=0.01,
            unreachable_wait_s=wait,
            transport=httpx.MockTransport(handler),
        )
        try:
            return await client.generate([1], max_new_tokens=1, temperature=0, top_p=1)
        finally:
            await client.close()

    with pytest.raises(ec.EngineUnreachable):
        asyncio.run(generate(0.0))  # retries only, as before
    calls["n"] = 0
    assert asyncio.run(generate(30.0)).output_ids == [7]

    def busy(request: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        return httpx.Response(500, json={"error": {"message": "CUDA error: an illegal memory access"}})

    async def overloaded():
        client = ec.EngineClient(
            "http://engine",
            retries=2,
            backoff_s=0.01,
            unreachable_wait_s=30,
            transport=httpx.MockTransport(busy),
        )
        try:
            await client.generate([1], max_new_tokens=1, temperature=0, top_p=1)
        finally:
            await client.close()

    calls["n"] = 0
    with pytest.raises(ec.EngineUnavailable):  # an engine that answers 500 gets its retries only
        asyncio.run(overloaded())
    assert calls["n"] == 2


GENERATED = {
    "id": "r1",
    "finish_reason": {"type": "stop", "matched": 7},
    "prompt_tokens": 1,
    "completion_tokens": 1,
    "output_token_logprobs": [[0.0, 7, None]],
}


class _FlakyRetrievalStub:
    def __init__(self, down: int) -> None:
        self.down = down

    async def Search(self, request, timeout=None):  # noqa: N802 - gRPC method name
        if self.down > 0:
            self.down -= 1
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                details="Connection refused",
            )
        return retrieval_pb2.SearchResponse(hits=[retrieval_pb2.SearchHit(docid="d1", url="u", text="t")])


def test_a_retrieval_service_that_restarts_is_waited_for():
    async def search(wait: float, down: int):
        client = RetrievalClient(
            f"127.0.0.1:{find_free_port()}", attempts=2, backoff_s=0.01, unavailable_wait_s=wait
        )
        client._stub = _FlakyRetrievalStub(down)
        return await client.search("q", 1)

    with pytest.raises(RetrievalFailed, match="UNAVAILABLE"):
        asyncio.run(search(0.0, down=8))
    assert [p.docid for p in asyncio.run(search(30.0, down=8))] == ["d1"]
