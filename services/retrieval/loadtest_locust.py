"""The load generator of `bcstack loadtest retrieval`: the child process that drives Locust.

`services.retrieval.loadtest.run_loadtest` starts it as a fresh interpreter whose first act is
``gevent.monkey.patch_all()``; only then is this module imported and :func:`main` called with
the spec file (the run's config as JSON) and the file the per-request records go to. Never
import it into a process that is not patched: the Locust and gevent imports below would patch it.

Users are gevent greenlets of a headless Locust ``Environment`` with a ``LocalRunner``. HTTP
users are ``FastHttpUser`` (geventhttpclient) posting ``{"query", "k"}`` to ``/search``; gRPC
users call ``bcstack.v1.RetrievalService/Search`` through the checked-in stub on one shared
channel and fire Locust's ``request`` event themselves, so both transports land in the same
records. The open-loop schedule, the phases and the end-of-run drain are described in
:mod:`services.retrieval.loadtest`; the statistics are computed there, not here.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from services.retrieval.loadtest import LATE_START_MS, STARTUP_ALLOWANCE_S, LoadTestConfig, percentile


def _error_kind(exc: BaseException) -> str:
    """A short, stable name for a failure, used to group errors."""
    code = getattr(exc, "code", None)
    if callable(code):  # grpc.RpcError: code() is a grpc.StatusCode
        try:
            return f"grpc_{code().name.lower()}"
        except Exception:
            return "grpc_error"
    text = str(exc)
    if text.startswith("HTTP ") and text[5:8].isdigit():
        return f"http_{text[5:8]}"
    if text.startswith("bad response"):
        return "bad_response"
    if isinstance(exc, ConnectionRefusedError):
        return "connection_refused"
    if isinstance(exc, ConnectionResetError | BrokenPipeError):
        return "connection_reset"
    if isinstance(exc, TimeoutError) or "timeout" in type(exc).__name__.lower():
        return "timeout"
    if isinstance(exc, OSError):
        return "connection"
    return type(exc).__name__


def _error_message(exc: BaseException) -> str:
    details = getattr(exc, "details", None)
    if callable(details):  # grpc.RpcError
        try:
            return f"{_error_kind(exc)}: {details()}"[:300]
        except Exception:
            pass
    return f"{type(exc).__name__}: {exc}"[:300]


class _RunState:
    """Shared by all users of the child (greenlets in one thread: no locks needed)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        import gevent.event

        self.cfg = cfg
        self.go = gevent.event.Event()
        self.t0 = 0.0
        self.measure_from = cfg["warmup_s"]
        self.end = cfg["warmup_s"] + cfg["duration_s"]
        self.queries = cfg["queries"]
        self.next_query = 0
        self.next_slot = 0
        self.started = 0
        self.pending = 0  # claimed requests not yet answered (some may wait for their slot)
        self.sending = 0  # requests on the wire
        self.exhausted = False  # max_requests reached
        self.late_starts = 0
        self.lag_ms: list[float] = []
        self.t: list[float] = []  # slot: decides the phase (warmup or measured)
        self.sent: list[float] = []  # actual send time (later than the slot for a late start)
        self.done: list[float] = []  # completion time
        self.ms: list[float] = []
        self.warmup: list[bool] = []
        self.kind: list[str | None] = []
        self.messages: Counter[str] = Counter()
        self.client_exceptions: Counter[str] = Counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def query(self) -> str:
        q = self.queries[self.next_query % len(self.queries)]
        self.next_query += 1
        return q

    def begin(self) -> float | None:
        """Claim the next request; return its send offset (s), or None once the run is over.

        Closed loop: now. Open loop: the next slot of the schedule, which may be in the future
        (the caller sleeps until then) or in the past (sent late). Nothing starts once the window
        has ended, so slots still unsent then are dropped (counted by :meth:`unsent_slots`).
        """
        limit = self.cfg["max_requests"]
        now = self.now()
        if now >= self.end or self.exhausted or (limit is not None and self.started >= limit):
            return None
        qps = self.cfg["qps"]
        if qps is None:
            at = now
        else:
            at = self.next_slot / qps
            if at >= self.end:
                return None
            self.next_slot += 1
        self.started += 1
        self.pending += 1
        if limit is not None and self.started >= limit:
            self.exhausted = True
        return at

    def unsent_slots(self, window_end: float) -> int:
        """Open loop: slots of the measured window that no user took before it ended."""
        qps = self.cfg["qps"]
        if qps is None:
            return 0
        scheduled = math.ceil(window_end * qps - 1e-9) - math.ceil(self.measure_from * qps - 1e-9)
        taken = max(0, self.next_slot - math.ceil(self.measure_from * qps - 1e-9))
        return max(0, scheduled - taken)

    def record(self, slot: float, ms: float, exc: BaseException | None) -> None:
        """One answered (or failed) request: its claimed slot, latency, outcome; now = completion."""
        done = self.now()
        self.t.append(slot)
        self.sent.append(round(done - ms / 1000.0, 6))
        self.done.append(round(done, 6))
        self.ms.append(ms)
        warm = slot < self.measure_from
        self.warmup.append(warm)
        if exc is None:
            self.kind.append(None)
        else:
            self.kind.append(_error_kind(exc))
            if not warm:
                self.messages[_error_message(exc)] += 1


@contextmanager
def _claimed_request(state: _RunState) -> Iterator[float | None]:
    """Claim the next request, wait for its slot; yields its send offset (s), or None when over.

    ``state.pending`` covers the whole claim, so the end-of-run drain also waits for users that
    claimed a slot just before the deadline and are still sleeping towards it.
    """
    import gevent

    at = state.begin()
    if at is None:
        yield None
        return
    try:
        delay = at - state.now()
        if delay > 0:
            gevent.sleep(delay)
        if state.cfg["qps"] is not None and at >= state.measure_from:
            lag_ms = max(0.0, (state.now() - at) * 1000.0)
            state.lag_ms.append(round(lag_ms, 3))
            if lag_ms > LATE_START_MS:
                state.late_starts += 1
        state.sending += 1
        try:
            yield at
        finally:
            state.sending -= 1
    finally:
        state.pending -= 1


def _idle_until_stopped(state: _RunState) -> None:
    import gevent

    gevent.sleep(state.cfg["timeout_s"] + 5.0)


def _http_user(state: _RunState) -> type:
    import json as _json

    from locust import FastHttpUser, constant, task

    cfg = state.cfg
    host, path = cfg["host"], cfg["path"]

    class SearchHttpUser(FastHttpUser):
        wait_time = constant(0)
        network_timeout = cfg["timeout_s"]
        connection_timeout = cfg["timeout_s"]
        max_retries = 0

        @task
        def search(self) -> None:
            state.go.wait()
            with _claimed_request(state) as at:
                if at is None:
                    _idle_until_stopped(state)
                    return
                body = {"query": state.query(), "k": cfg["k"]}
                with self.client.post(
                    path, json=body, name="/search", catch_response=True, context={"sent_at": at}
                ) as resp:
                    # Nothing in here may raise: an exception leaving this block would skip
                    # Locust's request event and leave a request the server saw uncounted.
                    error = getattr(resp, "error", None)
                    try:
                        if resp.status_code and resp.status_code != 200:
                            # Before `error`: geventhttpclient sets one for non-2xx answers too.
                            text = (resp.text or "").strip().replace("\n", " ")
                            resp.failure(f"HTTP {resp.status_code}: {text[:200]}")
                        elif error is not None or not resp.status_code:
                            resp.failure(error or ConnectionError("no response"))
                        elif isinstance(_json.loads(resp.content).get("results"), list):
                            resp.success()
                        else:
                            resp.failure('bad response: no "results" list in the JSON body')
                    except Exception as exc:
                        resp.failure(f"bad response: {type(exc).__name__}: {exc}")

    SearchHttpUser.host = host
    return SearchHttpUser


def _grpc_user(state: _RunState) -> type:
    import grpc
    from locust import User, constant, task

    from core.v1 import retrieval_pb2, retrieval_pb2_grpc

    cfg = state.cfg
    mode = {
        "hybrid": retrieval_pb2.SEARCH_MODE_HYBRID,
        "lexical": retrieval_pb2.SEARCH_MODE_LEXICAL,
        "dense": retrieval_pb2.SEARCH_MODE_DENSE,
    }[cfg["mode"]]
    # One channel for all users: gRPC multiplexes calls over one HTTP/2 connection, and channels
    # to the same target would share it through the global subchannel pool anyway.
    channel = grpc.insecure_channel(cfg["host"])
    stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)

    class SearchGrpcUser(User):
        wait_time = constant(0)

        @task
        def search(self) -> None:
            state.go.wait()
            with _claimed_request(state) as at:
                if at is None:
                    _idle_until_stopped(state)
                    return
                request = retrieval_pb2.SearchRequest(query=state.query(), k=cfg["k"], mode=mode)
                start_wall, start = time.time(), time.perf_counter()
                exc: BaseException | None = None
                length = 0
                try:
                    length = stub.Search(request, timeout=cfg["timeout_s"]).ByteSize()
                except Exception as e:  # grpc.RpcError mostly; anything else must be counted too
                    exc = e
                self.environment.events.request.fire(
                    request_type="grpc",
                    name="Search",
                    response_time=(time.perf_counter() - start) * 1000.0,
                    response_length=length,
                    exception=exc,
                    context={"sent_at": at},
                    start_time=start_wall,
                    url=cfg["host"],
                )

    return SearchGrpcUser


class _FirstFewPerMessage:
    """Logging filter: each distinct message at most 3 times (Locust logs every task exception)."""

    def __init__(self) -> None:
        self.seen: Counter[str] = Counter()

    def filter(self, record: Any) -> bool:
        key = str(record.msg)[:200]
        self.seen[key] += 1
        return self.seen[key] <= 3


def main(spec_path: str, result_path: str) -> None:  # pragma: no cover - runs in the child
    import logging

    import gevent

    # gevent's patch ran first (see loadtest._CHILD_BOOTSTRAP); importing locust repeats it harmlessly.
    import locust
    from locust.env import Environment

    logging.basicConfig(level=logging.WARNING, format="[loadtest] locust %(levelname)s: %(message)s")
    logging.getLogger().handlers[0].addFilter(_FirstFewPerMessage())
    cfg = json.loads(Path(spec_path).read_text(encoding="utf-8"))["config"]
    config = LoadTestConfig(**{k: v for k, v in cfg.items() if k not in ("mode_name", "user_count")})
    cfg["host"], cfg["path"] = config.target()
    versions = {"locust": locust.__version__, "gevent": gevent.__version__}
    if cfg["grpc"]:
        import grpc
        from grpc.experimental import gevent as grpc_gevent

        grpc_gevent.init_gevent()  # after the stdlib patch, before any channel exists
        versions["grpcio"] = grpc.__version__

    state = _RunState(cfg)
    user_class = _grpc_user(state) if cfg["grpc"] else _http_user(state)
    env = Environment(user_classes=[user_class], catch_exceptions=True)

    def on_request(response_time: float, exception: BaseException | None, context: dict, **_: Any) -> None:
        state.record(context.get("sent_at", state.now()), float(response_time), exception)

    def on_user_error(exception: BaseException, **_: Any) -> None:
        state.client_exceptions[_error_message(exception)] += 1

    env.events.request.add_listener(on_request)
    env.events.user_error.add_listener(on_user_error)
    spawned = gevent.event.Event()
    env.events.spawning_complete.add_listener(lambda **_: spawned.set())

    users = config.user_count
    runner = env.create_local_runner()
    # Users wait on `go` until all exist, so spawning them all at once creates no burst; Locust's
    # warning about spawn rates above 100/s is about bursts and is muted for this call.
    runners_log = logging.getLogger("locust.runners")
    level = runners_log.level
    runners_log.setLevel(logging.ERROR)
    runner.start(users, spawn_rate=users)
    runners_log.setLevel(level)
    if not spawned.wait(timeout=STARTUP_ALLOWANCE_S / 2):
        runner.quit()
        sys.stderr.write(f"[loadtest] could not spawn {users} users\n")
        os._exit(3)

    cpu0, wall0 = time.process_time(), time.perf_counter()
    state.t0 = time.perf_counter()
    state.go.set()
    progress = gevent.spawn(_progress_loop, state) if cfg["progress"] else None
    while state.now() < state.end and not (state.exhausted and state.pending == 0):
        gevent.sleep(min(0.05, max(0.0, state.end - state.now())))
    stopped_at = min(state.now(), state.end)
    # Let what was sent finish (each request has its own timeout), then stop hard.
    grace_until = state.now() + cfg["timeout_s"] + 1.0
    while state.pending > 0 and state.now() < grace_until:
        gevent.sleep(0.01)
    aborted = state.pending
    if progress is not None:
        progress.kill()
    runner.quit()
    cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0

    total = env.stats.total
    result = {
        "versions": versions,
        "users": users,
        "window_s": max(1e-6, stopped_at - state.measure_from),
        "records": {
            "t": state.t,
            "sent": state.sent,
            "done": state.done,
            "ms": state.ms,
            "warmup": state.warmup,
            "kind": state.kind,
        },
        "errors_by_message": dict(state.messages),
        "client_exceptions": dict(state.client_exceptions),
        "late_starts": state.late_starts,
        "schedule_lag_ms": state.lag_ms,
        "aborted": aborted,
        "unsent_slots": state.unsent_slots(stopped_at),
        "cpu_percent": 100.0 * cpu_s / wall_s if wall_s > 0 else 0.0,
        "locust": {
            "requests": total.num_requests,
            "failures": total.num_failures,
            "median_ms": total.median_response_time if total.num_requests else None,
            "p99_ms": total.get_response_time_percentile(0.99) if total.num_requests else None,
        },
    }
    Path(result_path).write_text(json.dumps(result), encoding="utf-8")
    sys.stderr.flush()
    # Skip interpreter teardown: gRPC's gevent integration can block on shutdown with live channels.
    os._exit(0)


def _progress_loop(state: _RunState) -> None:  # pragma: no cover - runs in the child
    import gevent

    seen = 0
    total = state.cfg["warmup_s"] + state.cfg["duration_s"]
    while True:
        gevent.sleep(1.0)
        now = state.now()
        new_ms = sorted(ms for ms, k in zip(state.ms[seen:], state.kind[seen:], strict=True) if k is None)
        done = len(state.ms)
        errors = sum(k is not None for k in state.kind)
        p50 = percentile(new_ms, 50)
        phase = "warmup " if now < state.measure_from else ""
        sys.stderr.write(
            f"[loadtest] {phase}{min(now, total):5.1f}/{total:g} s  {done - seen:6d} req/s  "
            f"p50 {'-' if p50 is None else f'{p50:.1f}'} ms  errors {errors}  in flight {state.sending}\n"
        )
        sys.stderr.flush()
        seen = done
