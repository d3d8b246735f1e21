"""The coordinator gateway (`bcstack serve coordinator`): episodes over HTTP (+SSE) and gRPC.

Thin transport around `GatewayCore`, which runs one episode: it leases the active endpoint from
the registry (a swap never touches an episode in flight), runs `loop.run_episode` with that
endpoint's chat client and the worker pool as the branch dispatcher, writes the record durably
(`core.record_store.RecordStore`: SQLite, fsync on commit) and only then answers.

HTTP: `POST /v1/episodes` (`?stream=true`: server-sent events), `GET /v1/episodes/{id}` (the
stored record), `GET /v1/episodes` (summaries), `GET|PUT /admin/coordinator` (bearer token),
`/health`, `/metrics`. gRPC: `bcstack.v1.CoordinatorService/RunEpisode`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc
from fastapi import Depends, FastAPI, Query
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, ConfigDict, Field

from core.kit.auth import require_admin
from core.kit.grpc_server import GrpcServer
from core.kit.http import create_app
from core.kit.metrics import new_registry
from core.kit.upstream import EndpointSpec
from core.record_store import RecordStore, RecordStoreError
from core.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, worker_pb2
from services.coordinator.loop import Branch, CoordinatorEpisode, LoopLimits, run_episode
from services.coordinator.metrics import CoordinatorMetrics
from services.coordinator.registry import Endpoint, EndpointRegistry, RegistryError
from services.coordinator.settings import CoordinatorSettings
from services.coordinator.workers import WorkerPool

SERVICE = "coordinator"
RECORD_SCHEMA = "bcstack.coordinator.episode/1"
log = logging.getLogger("bcstack.coordinator")

_STOP_NAMES = {
    common_pb2.STOP_REASON_FINISH: "finish",
    common_pb2.STOP_REASON_BUDGET: "budget",
    common_pb2.STOP_REASON_TURNS: "turns",
    common_pb2.STOP_REASON_CONTEXT: "context",
    common_pb2.STOP_REASON_ERROR: "error",
}


# --- request shapes ----------------------------------------------------------------------------


class LoopOverrides(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_turns: int | None = Field(None, ge=1, le=1000)
    max_branches: int | None = Field(None, ge=1, le=10_000)
    wall_time_seconds: float | None = Field(None, gt=0, le=7 * 24 * 3600)


class WorkerBudget(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_tokens: int | None = Field(None, gt=0)
    max_turns: int | None = Field(None, gt=0)
    max_new_tokens: int | None = Field(None, gt=0)
    context_length: int | None = Field(None, gt=0)


class EpisodeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    question: str = Field(min_length=1)
    question_id: str | None = Field(None, max_length=256)
    gold_answer: str | None = Field(None, max_length=20_000)
    group_id: str | None = Field(None, max_length=256)
    episode_id: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
    overrides: LoopOverrides | None = None
    worker_budget: WorkerBudget | None = None


class EndpointChange(BaseModel):
    """PUT /admin/coordinator: add or change an endpoint, activate one, or both."""

    model_config = ConfigDict(extra="forbid")

    endpoint: EndpointSpec | None = None
    activate: str | None = None


class InvalidEpisode(ValueError):
    """The request cannot run (empty or oversized question, ...): 422 / INVALID_ARGUMENT."""


class GatewayFull(RuntimeError):
    """The gateway runs its maximum of concurrent episodes: 429 / RESOURCE_EXHAUSTED."""


class EpisodeRunning(RuntimeError):
    """The episode id is being run right now by another request: 409 / ABORTED."""


# --- records -----------------------------------------------------------------------------------


def trajectory_record(response: worker_pb2.RunWorkerEpisodeResponse) -> dict[str, Any]:
    t = response.trajectory
    return {
        "token_ids": list(t.token_ids),
        "loss_mask": list(t.loss_mask),
        "rollout_logprobs": list(t.rollout_logprobs),
        "turns": [
            {
                "prompt_start": r.prompt_start,
                "gen_start": r.gen_start,
                "gen_end": r.gen_end,
                "generated_tokens": r.generated_tokens,
                "weight_version": r.weight_version,
                "finish_reason": r.finish_reason,
            }
            for r in t.turns
        ],
        "tool_calls": [
            {
                "turn": c.turn,
                "name": c.name,
                "params": dict(c.params),
                "outcome": c.outcome,
                "error": c.error,
                "docids": list(c.docids),
            }
            for c in t.tool_calls
        ],
        "stop_reason": _STOP_NAMES.get(t.stop_reason, "error"),
        "tokens_used": t.tokens_used,
        "turns_used": t.turns_used,
        "error": t.error,
    }


def usage_record(u: common_pb2.Usage) -> dict[str, int]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "observation_tokens": u.observation_tokens,
        "total_tokens": u.total_tokens,
        "turns": u.turns,
        "tool_calls": u.tool_calls,
    }


def branch_record(branch: Branch, worker_episode_id: str) -> dict[str, Any]:
    out = branch.outcome
    response = out.response if out is not None else None
    report = response.report if response is not None else None
    return {
        "branch": branch.index,
        "turn": branch.turn,
        "description": branch.description,
        "prompt": branch.prompt,
        "episode_id": response.episode_id if response is not None else worker_episode_id,
        "status": branch.status,
        "replica": out.replica if out is not None else None,
        "attempts": out.attempts if out is not None else 0,
        "error": (out.error if out is not None else "") or (response.trajectory.error if response else ""),
        "started_at": branch.started_at,
        "seconds": branch.seconds,
        "report": {
            "answer": report.answer if report else "",
            "explanation": report.explanation if report else "",
            "confidence": report.confidence if report else "",
            "raw_text": branch.report_text(),
        },
        "usage": usage_record(response.usage) if response is not None else usage_record(common_pb2.Usage()),
        "trajectory": trajectory_record(response) if response is not None else None,
    }


def episode_record(
    episode: CoordinatorEpisode,
    request: EpisodeRequest,
    episode_id: str,
    endpoint: Endpoint,
    limits: LoopLimits,
    worker_ids: dict[int, str],
) -> dict[str, Any]:
    """DESIGN.md §4's episode record: everything needed to grade, train on, or debug the episode."""
    workers = [branch_record(b, worker_ids.get(b.index, "")) for b in episode.branches]
    versions = sorted(
        {
            t["weight_version"]
            for w in workers
            if w["trajectory"]
            for t in w["trajectory"]["turns"]
            if t["weight_version"]
        }
    )
    worker_usage = {k: sum(w["usage"][k] for w in workers) for k in usage_record(common_pb2.Usage())}
    return {
        "schema": RECORD_SCHEMA,
        "episode_id": episode_id,
        "question_id": request.question_id,
        "group_id": request.group_id,
        "question": request.question,
        "gold_answer": request.gold_answer,
        "status": episode.status,
        "error": episode.error,
        "answer": episode.answer,
        "explanation": episode.explanation,
        "confidence": episode.confidence,
        "endpoint": endpoint.name,
        "endpoint_detail": {"model": endpoint.spec.model, "base_url": endpoint.spec.base_url},
        "created_at": episode.started_at,
        "finished_at": episode.started_at + episode.seconds,
        "seconds": episode.seconds,
        "limits": {
            "max_turns": limits.max_turns,
            "max_branches": limits.max_branches,
            "max_branches_per_turn": limits.max_branches_per_turn,
            "wall_time_seconds": limits.wall_time_seconds,
        },
        "worker_budget": request.worker_budget.model_dump(exclude_none=True) if request.worker_budget else {},
        "coordinator": {
            "messages": episode.messages,
            "turns": [
                {
                    "turn": t.index,
                    "seconds": t.seconds,
                    "attempts": t.attempts,
                    "prompt_tokens": t.prompt_tokens,
                    "completion_tokens": t.completion_tokens,
                    "calls": t.calls,
                    "errors": t.errors,
                    "workers_seconds": t.workers_seconds,
                    "total_seconds": t.total_seconds,
                }
                for t in episode.turns
            ],
            "usage": {"prompt_tokens": episode.prompt_tokens, "completion_tokens": episode.completion_tokens},
        },
        "workers": workers,
        "weight_versions": versions,
        "worker_usage": worker_usage,
    }


def response_body(record: dict[str, Any]) -> dict[str, Any]:
    """What POST /v1/episodes answers: the record without messages and token-level trajectories."""
    return {
        "episode_id": record["episode_id"],
        "question_id": record["question_id"],
        "status": record["status"],
        "error": record["error"],
        "answer": record["answer"],
        "explanation": record["explanation"],
        "confidence": record["confidence"],
        "endpoint": record["endpoint"],
        "worker_reports": [
            {
                "branch": w["branch"],
                "description": w["description"],
                "status": w["status"],
                "episode_id": w["episode_id"],
                "replica": w["replica"],
                "error": w["error"],
                **{k: w["report"][k] for k in ("answer", "explanation", "confidence", "raw_text")},
            }
            for w in record["workers"]
        ],
        "usage": {**record["coordinator"]["usage"], "turns": len(record["coordinator"]["turns"])},
        "worker_usage": record["worker_usage"],
        "weight_versions": record["weight_versions"],
        "seconds": record["seconds"],
    }


# --- the core ----------------------------------------------------------------------------------


@dataclass
class Admission:
    episode_id: str
    endpoint: Endpoint


class GatewayCore:
    def __init__(
        self,
        settings: CoordinatorSettings,
        registry: EndpointRegistry,
        pool: WorkerPool,
        store: RecordStore,
        metrics: CoordinatorMetrics,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.pool = pool
        self.store = store
        self.metrics = metrics
        self.active = 0
        self._running: set[str] = set()

    def limits_of(self, request: EpisodeRequest) -> LoopLimits:
        o = request.overrides or LoopOverrides()
        s = self.settings
        return LoopLimits(
            max_turns=o.max_turns or s.max_turns,
            max_branches=o.max_branches or s.max_branches,
            max_branches_per_turn=s.max_branches_per_turn,
            wall_time_seconds=o.wall_time_seconds or s.wall_time_seconds,
        )

    async def stored(self, episode_id: str) -> dict[str, Any] | None:
        return await asyncio.to_thread(self.store.get, episode_id)

    def admit(self, request: EpisodeRequest) -> Admission:
        """Reserve a slot, lease the active endpoint; raises InvalidEpisode, GatewayFull, EpisodeRunning."""
        if not request.question.strip():
            self.metrics.rejected.labels("invalid").inc()
            raise InvalidEpisode("question is empty")
        if len(request.question) > self.settings.max_question_chars:
            self.metrics.rejected.labels("invalid").inc()
            raise InvalidEpisode(
                f"question has {len(request.question)} characters; at most {self.settings.max_question_chars}"
            )
        if self.active >= self.settings.max_concurrent_episodes:
            self.metrics.rejected.labels("full").inc()
            raise GatewayFull(
                f"the gateway is running its maximum of {self.settings.max_concurrent_episodes} episodes"
            )
        episode_id = request.episode_id or uuid.uuid4().hex
        if episode_id in self._running:
            raise EpisodeRunning(f"episode {episode_id} is running now")
        self._running.add(episode_id)
        self.active += 1
        self.metrics.active.inc()
        return Admission(episode_id, self.registry.active())

    async def run(
        self,
        request: EpisodeRequest,
        admission: Admission,
        on_event: Callable[[str, dict], None] | None = None,
    ) -> dict[str, Any]:
        """Run an admitted episode to its end, record it durably, and return the record."""
        episode_id, endpoint = admission.episode_id, admission.endpoint
        try:
            limits = self.limits_of(request)
            budget = common_pb2.BudgetOverrides(
                **(request.worker_budget.model_dump(exclude_none=True) if request.worker_budget else {})
            )
            worker_ids: dict[int, str] = {}

            async def dispatch(branch: Branch):
                worker_id = f"{episode_id}.w{branch.index}"
                worker_ids[branch.index] = worker_id
                return await self.pool.run(
                    worker_pb2.RunWorkerEpisodeRequest(
                        episode_id=worker_id,
                        question_id=request.question_id or "",
                        group_id=request.group_id or "",
                        branch=worker_pb2.BranchTask(description=branch.description, prompt=branch.prompt),
                        budget=budget,
                    )
                )

            if on_event is not None:
                on_event("episode_started", {"episode_id": episode_id, "endpoint": endpoint.name})
            episode = await run_episode(
                request.question,
                chat=endpoint.client.chat,
                dispatch=dispatch,
                limits=limits,
                on_event=on_event,
            )
            record = episode_record(episode, request, episode_id, endpoint, limits, worker_ids)
            t0 = time.perf_counter()
            # Durable before anyone hears of it: a crash after this line loses nothing.
            await asyncio.to_thread(self.store.put, record)
            self.metrics.record_seconds.observe(time.perf_counter() - t0)
            self.metrics.episode(episode, endpoint.name)
            log.info(
                "episode %s (%s) ended %s after %d turn(s), %d branch(es), %.1f s on endpoint %s",
                episode_id,
                request.question_id or "-",
                episode.status,
                len(episode.turns),
                len(episode.branches),
                episode.seconds,
                endpoint.name,
            )
            return record
        finally:
            self._running.discard(episode_id)
            self.active -= 1
            self.metrics.active.dec()

    async def put_endpoint(self, change: EndpointChange) -> dict[str, Any]:
        before = self.registry.view()
        if change.endpoint is not None:
            self.metrics.endpoint_registered(change.endpoint.name)
        view = await self.registry.put(change.endpoint, activate=change.activate)
        swaps = view["swaps"] - before["swaps"]
        if swaps > 0:
            self.metrics.swaps.inc(swaps)
        self.metrics.active_endpoint.info({"name": view["active"]})
        return view


# --- transports --------------------------------------------------------------------------------


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _sse(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def build_http(core: GatewayCore, registry: CollectorRegistry, started: float) -> FastAPI:
    settings = core.settings
    background: set[asyncio.Task] = set()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.probe_on_start:
            await core.registry.probe_active()
        log.info(
            "coordinator gateway: endpoint %s active, %d worker replica(s), records in %s",
            core.registry.view()["active"],
            len(settings.workers),
            settings.records_path,
        )
        yield
        if background:  # streamed episodes whose client left: they still finish and are recorded
            await asyncio.wait(background, timeout=settings.shutdown_grace_seconds)

    app = create_app(
        SERVICE,
        settings,
        registry,
        health_check=lambda: {
            "active_episodes": core.active,
            "endpoint": core.registry.view()["active"],
            "uptime_s": round(time.time() - started),
        },
        lifespan=lifespan,
    )

    def refuse(exc: Exception) -> JSONResponse:
        if isinstance(exc, GatewayFull):
            return _error(429, str(exc), {"Retry-After": str(settings.retry_after_seconds)})
        if isinstance(exc, EpisodeRunning):
            return _error(409, str(exc))
        return _error(422, str(exc))

    @app.post("/v1/episodes")
    async def post_episode(body: EpisodeRequest, stream: bool = Query(False)) -> Any:
        if body.episode_id is not None:
            old = await core.stored(body.episode_id)
            if old is not None:  # a retried request: the recorded result, not a second episode
                return response_body(old)
        try:
            admission = core.admit(body)
        except (InvalidEpisode, GatewayFull, EpisodeRunning) as exc:
            return refuse(exc)
        if not stream:
            try:
                return response_body(await core.run(body, admission))
            except RecordStoreError as exc:
                log.error("%s", exc)
                return _error(503, f"the episode ran but could not be recorded: {exc}")

        queue: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()

        async def episode() -> None:
            try:
                record = await core.run(body, admission, on_event=lambda k, d: queue.put_nowait((k, d)))
                queue.put_nowait(("final", response_body(record)))
            except Exception as exc:  # a record-store failure; the stream must still end
                log.exception("episode %s failed", admission.episode_id)
                queue.put_nowait(("error", {"error": str(exc) or type(exc).__name__}))

        task = asyncio.create_task(episode())
        background.add(task)
        task.add_done_callback(background.discard)

        async def events() -> AsyncIterator[bytes]:
            while True:
                kind, data = await queue.get()
                yield _sse(kind, data)
                if kind in ("final", "error"):
                    return

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    @app.get("/v1/episodes/{episode_id}")
    async def get_episode(episode_id: str) -> Any:
        record = await core.stored(episode_id)
        if record is None:
            return _error(404, f"no recorded episode {episode_id!r}")
        return record

    @app.get("/v1/episodes")
    async def list_episodes(
        limit: int = Query(100, ge=1, le=10_000), question_id: str | None = Query(None, max_length=256)
    ) -> Any:
        items = await asyncio.to_thread(core.store.list, limit=limit, question_id=question_id)
        return {"episodes": items, "count": await asyncio.to_thread(core.store.count)}

    admin = [Depends(require_admin)]

    @app.get("/admin/coordinator", dependencies=admin)
    async def get_coordinator() -> Any:
        return {**core.registry.view(), "workers": core.pool.view()}

    @app.put("/admin/coordinator", dependencies=admin)
    async def put_coordinator(change: EndpointChange) -> Any:
        if change.endpoint is None and change.activate is None:
            return _error(422, "give an endpoint to add or change, a name to activate, or both")
        try:
            return await core.put_endpoint(change)
        except RegistryError as exc:
            log.warning("coordinator endpoint change refused: %s", exc)
            return _error(409, str(exc))

    return app


def response_message(record: dict[str, Any]) -> coordinator_pb2.RunCoordinatorEpisodeResponse:
    def usage(u: dict[str, int]) -> common_pb2.Usage:
        return common_pb2.Usage(
            **{k: v for k, v in u.items() if k in common_pb2.Usage.DESCRIPTOR.fields_by_name}
        )

    stop = {v: k for k, v in _STOP_NAMES.items()}
    return coordinator_pb2.RunCoordinatorEpisodeResponse(
        episode_id=record["episode_id"],
        question_id=record["question_id"] or "",
        answer=record["answer"],
        explanation=record["explanation"],
        confidence=record["confidence"],
        worker_reports=[
            common_pb2.WorkerReport(
                answer=w["report"]["answer"],
                explanation=w["report"]["explanation"],
                confidence=w["report"]["confidence"],
                stop_reason=stop.get(w["status"], common_pb2.STOP_REASON_ERROR),
                raw_text=w["report"]["raw_text"],
                episode_id=w["episode_id"],
            )
            for w in record["workers"]
        ],
        usage=usage(
            {
                **record["coordinator"]["usage"],
                "total_tokens": sum(record["coordinator"]["usage"].values()),
                "turns": len(record["coordinator"]["turns"]),
            }
        ),
        status=record["status"],
        error=record["error"],
        endpoint=record["endpoint"],
        weight_versions=record["weight_versions"],
        worker_usage=usage(record["worker_usage"]),
        seconds=record["seconds"],
    )


def request_of(message: coordinator_pb2.RunCoordinatorEpisodeRequest) -> EpisodeRequest:
    o, b = message.overrides, message.worker_budget

    def given(msg: Any, names: tuple[str, ...]) -> dict[str, Any]:
        return {n: getattr(msg, n) for n in names if msg.HasField(n)}

    return EpisodeRequest(
        question=message.question,
        question_id=message.question_id if message.HasField("question_id") else None,
        gold_answer=message.gold_answer if message.HasField("gold_answer") else None,
        group_id=message.group_id if message.HasField("group_id") else None,
        episode_id=message.episode_id if message.HasField("episode_id") else None,
        overrides=LoopOverrides(**given(o, ("max_turns", "max_branches", "wall_time_seconds"))),
        worker_budget=WorkerBudget(
            **given(b, ("max_tokens", "max_turns", "max_new_tokens", "context_length"))
        ),
    )


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServiceServicer):
    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    async def RunEpisode(self, request, context):  # noqa: N802 - gRPC method name
        from pydantic import ValidationError

        try:
            body = request_of(request)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(x) for x in first["loc"])
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: {first['msg']}")
        if body.episode_id is not None:
            old = await self.core.stored(body.episode_id)
            if old is not None:
                return response_message(old)
        try:
            admission = self.core.admit(body)
        except InvalidEpisode as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except GatewayFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except EpisodeRunning as exc:
            await context.abort(grpc.StatusCode.ABORTED, str(exc))
        try:
            record = await self.core.run(body, admission)
        except RecordStoreError as exc:
            log.error("%s", exc)
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"the episode ran but could not be recorded: {exc}"
            )
        return response_message(record)


def build(settings: CoordinatorSettings) -> tuple[FastAPI, GrpcServer | None, GatewayCore]:
    """Registry, worker pool, record store and both transports (what `bcstack serve coordinator` runs).

    Raises RegistryError / RecordStoreError / ValueError with a one-line reason for bad settings.
    """
    specs = settings.all_endpoints()
    if not specs:
        raise RegistryError(
            "no coordinator endpoint configured: pass --coordinator-url URL, set "
            "BCSTACK_COORDINATOR_COORDINATOR_URL, or list endpoints in the --config file"
        )
    registry = new_registry()
    metrics = CoordinatorMetrics(registry)
    for spec in specs:
        metrics.endpoint_registered(spec.name)
    endpoints = EndpointRegistry(
        specs,
        settings.active_endpoint,
        attempts=settings.upstream_attempts,
        backoff_seconds=settings.upstream_backoff_seconds,
        backoff_max_seconds=settings.upstream_backoff_max_seconds,
        breaker_failures=settings.breaker_failures,
        breaker_reset_seconds=settings.breaker_reset_seconds,
        on_retry=lambda name, kind: metrics.retries.labels(name, kind).inc(),
        on_attempt=metrics.attempt,
        on_breaker=metrics.breaker_changed,
    )
    metrics.active_endpoint.info({"name": endpoints.view()["active"]})
    pool = WorkerPool(
        settings.workers,
        attempts=settings.worker_attempts,
        timeout_seconds=settings.worker_timeout_seconds,
        on_attempt=lambda replica, outcome: metrics.worker_attempts.labels(replica, outcome).inc(),
        max_message_bytes=settings.grpc_max_message_bytes,
    )
    try:
        store = RecordStore(settings.records_path)
    except RecordStoreError:
        raise
    core = GatewayCore(settings, endpoints, pool, store, metrics)
    app = build_http(core, registry, time.time())
    server = None
    if settings.grpc_port is not None:
        server = GrpcServer(SERVICE, settings, registry)
        server.add(coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server, CoordinatorServicer(core))
    return app, server, core
