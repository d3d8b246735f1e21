"""Branch dispatch: one coordinator `branch()` call runs one worker episode on one of the worker
service replicas over gRPC, failing over to another replica when one is down or full.

    pool = WorkerPool(settings.workers, attempts=settings.worker_attempts,
                      timeout_seconds=settings.worker_timeout_seconds)
    outcome = await pool.run(worker_pb2.RunWorkerEpisodeRequest(branch=..., question_id=...))
    if outcome.response is None: ...  # outcome.error says why, in one line
    await pool.close()

Routing: the replica with the fewest branches in flight from this pool (ties round-robin). A
replica failure (UNAVAILABLE, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, UNKNOWN, INTERNAL, ABORTED,
a server-side CANCELLED) moves the branch to a replica it has not tried; once all were tried, the
least recently failed one is retried after a short backoff, up to `attempts` in total. A replica
that answers RESOURCE_EXHAUSTED is full, not broken: while every replica is full the branch waits
for one to admit it (polling at the backoff, at most once a second) for up to `full_wait_seconds`,
and those refusals do not use up its attempts, so a burst of branches larger than the fleet admits
(an RL loop keeping G·(L+1) groups in flight) queues here instead of failing. In the same way,
while every replica is down (UNAVAILABLE: crashed or restarting) the branch waits for one to come
back for up to `unavailable_wait_seconds` without using up its attempts, so a worker restart
delays branches instead of failing them. Every attempt
carries the same episode_id, so the worker records of one branch share one id. A request error
(INVALID_ARGUMENT, FAILED_PRECONDITION, ...) fails the branch at once: another replica would refuse
it too. A replica that answered UNAVAILABLE is "down" for `cooldown_seconds` and is only chosen
while no other replica is up.

The timeout applies to each attempt. A timed-out attempt may still be running on its replica when
the retry starts (a deadline does not stop a worker that ignores cancellation); it has the same
episode_id, which is how the duplicate can be recognised downstream.

One pool serves one event loop: channels are created lazily on the first run() in that loop.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from core.kit.grpc_server import DEFAULT_MAX_MESSAGE_BYTES, aio_channel
from core.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

# Failures of the replica, not of the request: another replica (or this one, later) may succeed.
RETRYABLE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
    }
)
BACKOFF_FIRST_SECONDS = 0.05
BACKOFF_MAX_SECONDS = 1.0
MAX_ERROR_DETAIL_CHARS = 300


@dataclass
class BranchOutcome:
    """What became of one branch: the worker's response, or why there is none."""

    response: worker_pb2.RunWorkerEpisodeResponse | None  # None when every attempt failed
    replica: str | None  # address that produced the response
    attempts: int  # replicas tried (a replica retried counts again)
    error: str  # "" on success; else one line: why the branch failed


@dataclass(eq=False)
class _Replica:
    address: str
    in_flight: int = 0
    ok: int = 0
    failed: int = 0
    down_until: float = 0.0  # time.monotonic() before which the replica counts as down
    last_failed_at: float = float("-inf")  # time.monotonic() of its latest failed attempt
    stub: worker_pb2_grpc.WorkerServiceStub | None = None
    channel: grpc.aio.Channel | None = None

    def is_down(self, now: float) -> bool:
        return now < self.down_until


def _one_line(text: str) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    if len(text) > MAX_ERROR_DETAIL_CHARS:
        text = text[: MAX_ERROR_DETAIL_CHARS - 3] + "..."
    return text


def _describe(address: str, error: grpc.aio.AioRpcError) -> str:
    detail = _one_line(error.details() or "")
    return f"{address} {error.code().name}" + (f": {detail}" if detail else "")


class WorkerPool:
    """Runs worker episodes across worker service replicas with least-in-flight routing and failover."""

    def __init__(
        self,
        addresses: list[str],
        *,
        attempts: int = 3,
        timeout_seconds: float = 3600.0,
        on_attempt: Callable[[str, str], None] | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        cooldown_seconds: float = 5.0,
        full_wait_seconds: float = 0.0,
        unavailable_wait_seconds: float = 0.0,
    ) -> None:
        """`on_attempt(address, outcome)` is called after every attempt with "ok" or the gRPC status
        name in lower case ("unavailable", "resource_exhausted", ...), e.g. to count it in metrics.
        `full_wait_seconds`: how long a branch waits for a full fleet (0: a refusal is an attempt);
        `unavailable_wait_seconds`: how long it waits while every replica is down (0: each is an attempt)."""
        if not addresses:
            raise ValueError("workers: give at least one worker gRPC address")
        repeated = sorted({a for a in addresses if addresses.count(a) > 1})
        if repeated:
            raise ValueError(f"workers: each address once; repeated: {', '.join(repeated)}")
        if attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {attempts}")
        if timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be > 0, got {timeout_seconds}")
        if cooldown_seconds < 0:
            raise ValueError(f"cooldown_seconds must be >= 0, got {cooldown_seconds}")
        if full_wait_seconds < 0:
            raise ValueError(f"full_wait_seconds must be >= 0, got {full_wait_seconds}")
        if unavailable_wait_seconds < 0:
            raise ValueError(f"unavailable_wait_seconds must be >= 0, got {unavailable_wait_seconds}")
        self._replicas = [_Replica(address) for address in addresses]
        self.attempts = attempts
        self.timeout_seconds = timeout_seconds
        self.cooldown_seconds = cooldown_seconds
        self.full_wait_seconds = full_wait_seconds
        self.unavailable_wait_seconds = unavailable_wait_seconds
        self._on_attempt = on_attempt
        self._max_message_bytes = max_message_bytes
        self._next = 0  # round-robin start among replicas tied on in-flight count
        self._closed = False

    def _stub(self, replica: _Replica) -> worker_pb2_grpc.WorkerServiceStub:
        if replica.stub is None:
            # gRPC waits up to its reconnect backoff (120 s by default) before redialling a peer that
            # refused; cap it near the cooldown so a restarted replica is usable once it ends.
            reconnect_ms = max(1000, int(self.cooldown_seconds * 1000))
            replica.channel = aio_channel(
                replica.address,
                max_message_bytes=self._max_message_bytes,
                options=[
                    ("grpc.initial_reconnect_backoff_ms", min(250, reconnect_ms)),
                    ("grpc.min_reconnect_backoff_ms", min(250, reconnect_ms)),
                    ("grpc.max_reconnect_backoff_ms", reconnect_ms),
                    # An address that resolves to several pods (a headless Service) spreads its
                    # calls over all of them instead of gRPC's default pick-first.
                    ("grpc.lb_policy_name", "round_robin"),
                ],
            )
            replica.stub = worker_pb2_grpc.WorkerServiceStub(replica.channel)
        return replica.stub

    def _pick(self, tried: set[str]) -> tuple[_Replica, bool]:
        """The replica for the next attempt, and whether it was tried already in this branch."""
        now = time.monotonic()
        up = [r for r in self._replicas if not r.is_down(now)]
        candidates = up or self._replicas
        fresh = [r for r in candidates if r.address not in tried]
        if not fresh:
            return min(candidates, key=lambda r: r.last_failed_at), True
        count = len(self._replicas)
        rotated = [self._replicas[(self._next + i) % count] for i in range(count)]
        chosen = min((r for r in rotated if r in fresh), key=lambda r: r.in_flight)
        self._next = (self._replicas.index(chosen) + 1) % count
        return chosen, False

    def _report(self, address: str, outcome: str) -> None:
        if self._on_attempt is None:
            return
        try:
            self._on_attempt(address, outcome)
        except Exception:
            log.exception("on_attempt callback failed for %s (%s)", address, outcome)

    async def run(self, request: worker_pb2.RunWorkerEpisodeRequest) -> BranchOutcome:
        """Run one worker episode. Never raises for a worker or replica failure: the outcome says
        why. Sets `request.episode_id` (uuid4 hex) when empty. Cancelling the caller cancels the RPC."""
        if self._closed:
            raise RuntimeError("the worker pool is closed")
        if not request.episode_id:
            request.episode_id = uuid.uuid4().hex
        tried: set[str] = set()
        backoffs = 0
        last_error = ""
        failures = 0  # attempts used up: refusals while waiting for a full fleet are not counted
        calls = 0
        full_since: float | None = None
        down_since: float | None = None  # when the fleet was first seen all down, for this branch
        while failures < self.attempts:
            replica, again = self._pick(tried)
            if again:
                await asyncio.sleep(min(BACKOFF_MAX_SECONDS, BACKOFF_FIRST_SECONDS * 2**backoffs))
                backoffs += 1
                if self._closed:
                    return BranchOutcome(None, None, calls, f"worker pool closed; last: {last_error}")
            tried.add(replica.address)
            stub = self._stub(replica)
            replica.in_flight += 1
            calls += 1
            try:
                response = await stub.RunEpisode(request, timeout=self.timeout_seconds)
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                replica.failed += 1
                replica.last_failed_at = time.monotonic()
                if code == grpc.StatusCode.UNAVAILABLE:
                    replica.down_until = replica.last_failed_at + self.cooldown_seconds
                self._report(replica.address, code.name.lower())
                last_error = _describe(replica.address, exc)
                if self._closed:
                    return BranchOutcome(None, None, calls, f"worker pool closed; last: {last_error}")
                if code not in RETRYABLE_CODES:
                    return BranchOutcome(None, None, calls, f"{last_error} (a request error: not retried)")
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED and self.full_wait_seconds > 0:
                    full_since = replica.last_failed_at if full_since is None else full_since
                    if replica.last_failed_at - full_since < self.full_wait_seconds:
                        continue  # full: wait for room (the backoff above paces the polls)
                if code == grpc.StatusCode.UNAVAILABLE and self.unavailable_wait_seconds > 0:
                    now = replica.last_failed_at
                    if all(r.is_down(now) for r in self._replicas):
                        down_since = now if down_since is None else down_since
                        if now - down_since < self.unavailable_wait_seconds:
                            continue  # every replica is down: wait for one to come back
                failures += 1
                log.info(
                    "branch %s attempt %d/%d failed: %s",
                    request.episode_id,
                    failures,
                    self.attempts,
                    last_error,
                )
                continue
            except asyncio.CancelledError:
                # grpc.aio raises CancelledError for calls its channel cancelled; after close() that
                # is the pool's doing, not the caller's, so it becomes an outcome instead.
                task = asyncio.current_task()
                if self._closed and task is not None and not task.cancelling():
                    self._report(replica.address, "cancelled")
                    return BranchOutcome(
                        None, None, calls, f"worker pool closed while {replica.address} ran it"
                    )
                raise
            finally:
                replica.in_flight -= 1
            replica.ok += 1
            replica.down_until = 0.0
            self._report(replica.address, "ok")
            return BranchOutcome(response, replica.address, calls, "")
        waited = (
            "" if full_since is None else f" (waited {time.monotonic() - full_since:.0f} s for a full fleet)"
        ) + (
            ""
            if down_since is None
            else f" (waited {time.monotonic() - down_since:.0f} s for a worker to come back)"
        )
        return BranchOutcome(
            None, None, calls, f"all {self.attempts} attempts failed{waited}; last: {last_error}"
        )

    def view(self) -> list[dict]:
        """Per replica: address, branches in flight, attempts that succeeded / failed, whether down."""
        now = time.monotonic()
        return [
            {
                "address": r.address,
                "in_flight": r.in_flight,
                "ok": r.ok,
                "failed": r.failed,
                "down": r.is_down(now),
            }
            for r in self._replicas
        ]

    async def close(self) -> None:
        """Close every channel; branches still running end with a failed outcome."""
        self._closed = True
        channels = [r.channel for r in self._replicas if r.channel is not None]
        for replica in self._replicas:
            replica.channel = replica.stub = None
        await asyncio.gather(*(channel.close() for channel in channels), return_exceptions=True)
