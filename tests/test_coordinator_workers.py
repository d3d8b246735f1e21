"""The coordinator's worker pool against real gRPC worker servers with scripted behaviour:
least-in-flight spreading, failover, retry rules, stable episode ids, cooldown, cancellation
and timeouts."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import grpc
import pytest
from conftest import LOOPBACK, find_free_port

from core.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.coordinator.workers import BranchOutcome, WorkerPool

TEST_TIMEOUT_SECONDS = 20.0


class ScriptedWorker(worker_pb2_grpc.WorkerServiceServicer):
    """Answers with its own name in report.answer after `delay` s, or aborts with `abort`."""

    def __init__(
        self,
        name: str,
        *,
        delay: float = 0.0,
        abort: grpc.StatusCode | None = None,
        capacity: int | None = None,
    ) -> None:
        self.name = name
        self.delay = delay
        self.abort = abort
        self.capacity = capacity  # episodes admitted at once; more get RESOURCE_EXHAUSTED
        self.admitted = 0
        self.max_admitted = 0
        self.refused = 0
        self.episode_ids: list[str] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.cancelled = 0

    @property
    def calls(self) -> int:
        return len(self.episode_ids)

    async def RunEpisode(self, request, context):  # noqa: N802 (gRPC method name)
        self.episode_ids.append(request.episode_id)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.abort is not None:
                await context.abort(self.abort, f"{self.name} refuses: {self.abort.name.lower()}")
            if self.capacity is not None:
                if self.admitted >= self.capacity:
                    self.refused += 1
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.name} is full")
                self.admitted += 1
                self.max_admitted = max(self.max_admitted, self.admitted)
            try:
                await asyncio.sleep(self.delay)
            finally:
                if self.capacity is not None:
                    self.admitted -= 1
            return worker_pb2.RunWorkerEpisodeResponse(
                episode_id=request.episode_id,
                report=common_pb2.WorkerReport(answer=self.name, episode_id=request.episode_id),
            )
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1


class WorkerServer:
    """One in-process worker replica on a fixed loopback port (so it can be stopped and restarted)."""

    def __init__(self, worker: ScriptedWorker, port: int | None = None) -> None:
        self.worker = worker
        self.port = port or find_free_port()
        self.server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    async def start(self) -> None:
        self.server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(self.worker, self.server)
        self.server.add_insecure_port(self.address)
        await self.server.start()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=None)
            self.server = None


@contextlib.asynccontextmanager
async def serving(*workers: ScriptedWorker) -> AsyncIterator[list[WorkerServer]]:
    servers = [WorkerServer(worker) for worker in workers]
    try:
        for server in servers:
            await server.start()
        yield servers
    finally:
        for server in servers:
            await server.stop()


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, TEST_TIMEOUT_SECONDS))


def branch_request(episode_id: str = "") -> worker_pb2.RunWorkerEpisodeRequest:
    return worker_pb2.RunWorkerEpisodeRequest(
        episode_id=episode_id,
        question_id="q1",
        branch=worker_pb2.BranchTask(description="find the laureate", prompt="Search for ..."),
    )


def dead_address() -> str:
    return f"{LOOPBACK}:{find_free_port()}"


def assert_succeeded(outcome: BranchOutcome) -> None:
    assert outcome.error == "" and outcome.response is not None and outcome.replica is not None, outcome


def test_thirty_concurrent_branches_spread_evenly_over_three_replicas():
    # Each call holds its replica 1 s, so all 30 overlap on the servers even when the suite's load
    # delays the last ones' arrival (at 0.3 s the suite once saw 8 in flight per server, not 10).
    workers = [ScriptedWorker(name, delay=1.0) for name in ("a", "b", "c")]
    servers = [WorkerServer(worker) for worker in workers]
    names = {server.address: server.worker.name for server in servers}
    pool = WorkerPool([s.address for s in servers])  # outside any event loop: channels come later

    async def scenario() -> None:
        for server in servers:
            await server.start()
        try:
            outcomes = await asyncio.gather(*(pool.run(branch_request()) for _ in range(30)))
            for outcome in outcomes:
                assert_succeeded(outcome)
                assert outcome.attempts == 1
                assert outcome.response.report.answer == names[outcome.replica]
            assert len({o.response.episode_id for o in outcomes}) == 30
            view = pool.view()
            assert [v["ok"] for v in view] == [10, 10, 10]
            assert all(v["in_flight"] == 0 and v["failed"] == 0 and not v["down"] for v in view)

            # One at a time, ties on in-flight go round-robin.
            sequential = [(await pool.run(branch_request())).replica for _ in range(6)]
            assert sequential == [s.address for s in servers] * 2
            await pool.close()
        finally:
            for server in servers:
                await server.stop()

    run(scenario())
    assert [w.calls for w in workers] == [12, 12, 12]
    assert [w.max_in_flight for w in workers] == [10, 10, 10]


def test_branches_fail_over_when_a_replica_stops_mid_run():
    workers = [ScriptedWorker(name, delay=0.6) for name in ("a", "b", "c")]
    attempts: list[tuple[str, str]] = []

    async def scenario() -> None:
        async with serving(*workers) as servers:
            pool = WorkerPool([s.address for s in servers], on_attempt=lambda a, o: attempts.append((a, o)))
            branches = [asyncio.create_task(pool.run(branch_request())) for _ in range(30)]
            while workers[0].calls < 10:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            assert workers[0].in_flight == 10  # a third of the way through their episodes
            await servers[0].stop()
            outcomes = await asyncio.gather(*branches)
            for outcome in outcomes:
                assert_succeeded(outcome)
                assert outcome.replica != servers[0].address
            moved = [o for o in outcomes if o.attempts > 1]
            assert len(moved) == 10
            # A moved branch keeps its episode id on the replica that finished it.
            assert {o.response.episode_id for o in moved} == set(workers[0].episode_ids)
            assert {o for a, o in attempts if a == servers[0].address} <= {"unavailable", "cancelled"}
            assert pool.view()[0]["failed"] >= 10 and pool.view()[0]["ok"] == 0
            await pool.close()

    run(scenario())
    assert workers[1].calls + workers[2].calls == 30


def test_a_replica_answering_resource_exhausted_is_skipped():
    full = ScriptedWorker("full", abort=grpc.StatusCode.RESOURCE_EXHAUSTED)
    workers = [full, ScriptedWorker("b", delay=0.05), ScriptedWorker("c", delay=0.05)]
    attempts: list[tuple[str, str]] = []

    async def scenario() -> None:
        async with serving(*workers) as servers:
            pool = WorkerPool([s.address for s in servers], on_attempt=lambda a, o: attempts.append((a, o)))
            outcomes = await asyncio.gather(*(pool.run(branch_request()) for _ in range(12)))
            for outcome in outcomes:
                assert_succeeded(outcome)
                assert outcome.response.report.answer in {"b", "c"}
            assert sorted(o.attempts for o in outcomes) == [1] * 8 + [2] * 4
            assert attempts.count((servers[0].address, "resource_exhausted")) == 4
            full_view = pool.view()[0]
            assert full_view["failed"] == 4 and not full_view["down"]  # full is not down
            await pool.close()

    run(scenario())
    assert full.calls == 4


def test_branches_beyond_the_fleets_capacity_wait_for_room_instead_of_failing():
    """Twelve branches against two replicas admitting two each: with a full-fleet wait all twelve
    run (never more than two at once on a replica), and the refusals did not use up the attempts;
    without one, the branches that found the fleet full three times fail, naming the status."""
    workers = [ScriptedWorker(name, delay=0.2, capacity=2) for name in ("a", "b")]

    async def scenario() -> None:
        async with serving(*workers) as servers:
            addresses = [s.address for s in servers]
            pool = WorkerPool(addresses, attempts=3, full_wait_seconds=15.0)
            outcomes = await asyncio.gather(*(pool.run(branch_request()) for _ in range(12)))
            for outcome in outcomes:
                assert_succeeded(outcome)
            assert max(o.attempts for o in outcomes) > 3  # waited through more refusals than attempts
            assert [w.max_admitted for w in workers] == [2, 2]
            assert sum(w.refused for w in workers) > 0
            await pool.close()

            strict = WorkerPool(addresses, attempts=3)  # full_wait_seconds=0: a refusal is an attempt
            outcomes = await asyncio.gather(*(strict.run(branch_request()) for _ in range(12)))
            failed = [o for o in outcomes if o.response is None]
            assert failed and len(failed) <= 8
            assert all(o.error.startswith("all 3 attempts failed; last:") for o in failed), [
                o.error for o in failed
            ]
            assert all("RESOURCE_EXHAUSTED" in o.error for o in failed), [o.error for o in failed]
            await strict.close()

            bounded = WorkerPool(addresses, attempts=1, full_wait_seconds=0.3)
            outcomes = await asyncio.gather(*(bounded.run(branch_request()) for _ in range(12)))
            waited = [o for o in outcomes if o.response is None]
            assert waited and all("for a full fleet" in o.error for o in waited)
            await bounded.close()

    run(scenario())


def test_full_wait_seconds_is_checked():
    with pytest.raises(ValueError, match="full_wait_seconds must be >= 0"):
        WorkerPool(["127.0.0.1:1"], full_wait_seconds=-1)


def test_all_replicas_down_is_a_failed_outcome_naming_the_last_status():
    async def scenario() -> None:
        addresses = [dead_address(), dead_address()]
        pool = WorkerPool(addresses, attempts=3, cooldown_seconds=30.0)
        outcome = await pool.run(branch_request())
        assert outcome.response is None and outcome.replica is None
        assert outcome.attempts == 3
        assert outcome.error.startswith("all 3 attempts failed; last: 127.0.0.1:")
        assert "UNAVAILABLE" in outcome.error and "\n" not in outcome.error
        view = pool.view()
        assert sum(v["failed"] for v in view) == 3 and all(v["down"] for v in view)

        # Down everywhere: a new branch still tries (a down replica beats no replica).
        assert (await pool.run(branch_request())).attempts == 3
        await pool.close()

    run(scenario())


def test_invalid_argument_is_not_retried():
    invalid = ScriptedWorker("strict", abort=grpc.StatusCode.INVALID_ARGUMENT)
    healthy = ScriptedWorker("ok")

    async def scenario() -> None:
        async with serving(invalid, healthy) as servers:
            pool = WorkerPool([s.address for s in servers], attempts=3)
            outcome = await pool.run(branch_request())  # first pick: the first replica
            assert outcome.response is None and outcome.attempts == 1
            assert f"{servers[0].address} INVALID_ARGUMENT" in outcome.error
            assert "not retried" in outcome.error
            await pool.close()

    run(scenario())
    assert healthy.calls == 0


def test_episode_id_is_set_once_and_kept_across_retries():
    workers = [
        ScriptedWorker("unavailable", abort=grpc.StatusCode.UNAVAILABLE),
        ScriptedWorker("internal", abort=grpc.StatusCode.INTERNAL),
        ScriptedWorker("ok"),
    ]

    async def scenario() -> None:
        async with serving(*workers) as servers:
            pool = WorkerPool([s.address for s in servers], attempts=3)
            request = branch_request()
            outcome = await pool.run(request)
            assert_succeeded(outcome)
            assert outcome.attempts == 3 and outcome.replica == servers[2].address
            assert len(request.episode_id) == 32
            assert [w.episode_ids for w in workers] == [[request.episode_id]] * 3
            assert outcome.response.episode_id == request.episode_id

            # A caller's own id is kept as given.
            given = await pool.run(branch_request("caller-chosen-id"))
            assert given.response.episode_id == "caller-chosen-id"
            await pool.close()

    run(scenario())


def test_a_down_replica_is_avoided_during_its_cooldown_and_used_again_after():
    comeback = ScriptedWorker("comeback")
    steady = ScriptedWorker("steady")
    attempts: list[tuple[str, str]] = []

    async def scenario() -> None:
        down_server = WorkerServer(comeback)  # not started yet: its port refuses connections
        async with serving(steady) as (steady_server,):
            pool = WorkerPool(
                [down_server.address, steady_server.address],
                cooldown_seconds=1.0,
                on_attempt=lambda a, o: attempts.append((a, o)),
            )
            first = await pool.run(branch_request())
            assert_succeeded(first)
            assert first.attempts == 2 and first.replica == steady_server.address
            assert attempts == [(down_server.address, "unavailable"), (steady_server.address, "ok")]
            assert pool.view()[0]["down"] is True

            await down_server.start()
            outcomes = await asyncio.gather(*(pool.run(branch_request()) for _ in range(10)))
            assert all(o.replica == steady_server.address and o.attempts == 1 for o in outcomes)
            assert comeback.calls == 0

            await asyncio.sleep(1.1)
            assert pool.view()[0]["down"] is False
            # The channel may need a reconnect after the refusal; within a few tries it is back.
            for _ in range(40):
                if (await pool.run(branch_request())).replica == down_server.address:
                    break
                await asyncio.sleep(0.1)
            assert comeback.calls >= 1
            await pool.close()
            await down_server.stop()

    run(scenario())


def test_cancelling_the_caller_cancels_the_worker_rpc():
    slow = ScriptedWorker("slow", delay=60.0)

    async def scenario() -> None:
        async with serving(slow) as servers:
            pool = WorkerPool([servers[0].address])
            branch = asyncio.create_task(pool.run(branch_request()))
            while slow.calls == 0:
                await asyncio.sleep(0.01)
            assert pool.view()[0]["in_flight"] == 1
            branch.cancel()
            with pytest.raises(asyncio.CancelledError):
                await branch
            for _ in range(200):
                if slow.cancelled:
                    break
                await asyncio.sleep(0.01)
            assert slow.cancelled == 1 and slow.in_flight == 0
            assert pool.view()[0]["in_flight"] == 0
            await pool.close()

    run(scenario())


def test_a_timeout_is_a_failed_deadline_exceeded_attempt():
    slow = ScriptedWorker("slow", delay=5.0)
    fast = ScriptedWorker("fast")
    attempts: list[tuple[str, str]] = []

    async def scenario() -> None:
        async with serving(slow, fast) as (slow_server, fast_server):
            pool = WorkerPool(
                [slow_server.address, fast_server.address],
                timeout_seconds=0.3,
                on_attempt=lambda a, o: attempts.append((a, o)),
            )
            outcome = await pool.run(branch_request())
            assert_succeeded(outcome)
            assert outcome.attempts == 2 and outcome.replica == fast_server.address
            assert attempts == [(slow_server.address, "deadline_exceeded"), (fast_server.address, "ok")]
            assert pool.view()[0] == {
                "address": slow_server.address,
                "in_flight": 0,
                "ok": 0,
                "failed": 1,
                "down": False,
            }
            await pool.close()

            only_slow = WorkerPool([slow_server.address], attempts=1, timeout_seconds=0.2)
            failed = await only_slow.run(branch_request())
            assert failed.response is None and failed.attempts == 1
            assert failed.error.startswith(
                f"all 1 attempts failed; last: {slow_server.address} DEADLINE_EXCEEDED"
            )
            await only_slow.close()

    run(scenario())


def test_closing_the_pool_ends_running_branches_with_an_outcome():
    slow = ScriptedWorker("slow", delay=60.0)

    async def scenario() -> None:
        async with serving(slow) as servers:
            pool = WorkerPool([servers[0].address])
            branch = asyncio.create_task(pool.run(branch_request()))
            while slow.calls == 0:
                await asyncio.sleep(0.01)
            await pool.close()
            outcome = await branch
            assert outcome.response is None and "closed" in outcome.error
            with pytest.raises(RuntimeError, match="closed"):
                await pool.run(branch_request())

    run(scenario())


def test_bad_pool_configuration_is_refused():
    with pytest.raises(ValueError, match="at least one"):
        WorkerPool([])
    with pytest.raises(ValueError, match="repeated: 127.0.0.1:1"):
        WorkerPool(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:1"])
    with pytest.raises(ValueError, match="attempts"):
        WorkerPool(["127.0.0.1:1"], attempts=0)
