"""The coordinator gateway (`bcstack serve coordinator`): episodes over HTTP (+SSE) and gRPC.

Thin transport around `services.coordinator.gateway.GatewayCore`, which runs one episode and
records it durably as a `core.records.EpisodeRecord` before anyone hears of it.

HTTP: `POST /v1/episodes` (`?stream=true`: server-sent events), `GET /v1/episodes/{id}` (the
stored record, in the current schema), `GET /v1/episodes` (summaries), `GET|PUT /admin/coordinator`
(bearer token), `/health`, `/metrics`, and the read-only episode viewer `GET /ui`,
`GET /ui/episodes/{id}` (`services.coordinator.ui`). gRPC: `bcstack.v1.CoordinatorService/RunEpisode`; its
messages convert to and from the record through `google.protobuf.json_format`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
from fastapi import Depends, FastAPI, Query
from fastapi.responses import JSONResponse, StreamingResponse
from google.protobuf import json_format
from prometheus_client import CollectorRegistry

from core.kit.auth import require_admin
from core.kit.grpc_server import GrpcServer
from core.kit.http import create_app
from core.kit.metrics import new_registry
from core.record_store import RecordStore, RecordStoreError, SchemaTooNew, SqliteRecordStore
from core.records import STOP_REASONS, EpisodeRecord
from core.v1 import coordinator_pb2, coordinator_pb2_grpc
from services.coordinator import openapi as doc
from services.coordinator.gateway import (
    EndpointChange,
    EpisodeRequest,
    EpisodeRunning,
    GatewayCore,
    GatewayFull,
    InvalidEpisode,
    response_body,
)
from services.coordinator.metrics import CoordinatorMetrics
from services.coordinator.registry import EndpointRegistry, RegistryError
from services.coordinator.settings import CoordinatorSettings
from services.coordinator.ui import add_viewer
from services.coordinator.viewer import TokenDecoder
from services.coordinator.workers import WorkerPool

SERVICE = "coordinator"
log = logging.getLogger("bcstack.coordinator")


# --- transports --------------------------------------------------------------------------------


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _sse(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def build_http(
    core: GatewayCore, registry: CollectorRegistry, started: float, decoder: TokenDecoder | None = None
) -> FastAPI:
    settings = core.settings
    background: set[asyncio.Task] = set()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if records_ready(core.store):
            # A swap made before this replica (re)started is adopted before it serves; when it cannot
            # be (a stored endpoint whose key file is not here yet) the replica is not ready and says
            # why in /health until follow_endpoints() adopts it.
            await core.try_sync_endpoints()
        if settings.probe_on_start:
            await core.registry.probe_active()
        log.info(
            "coordinator gateway %s: endpoint %s active, %d worker replica(s), records in %s",
            core.replica,
            core.registry.view()["active"],
            len(settings.workers),
            core.store.location,
        )
        tasks = [asyncio.create_task(core.heartbeat())]
        if not records_ready(core.store):
            tasks.append(asyncio.create_task(connect_records(core.store)))
        tasks.append(asyncio.create_task(core.follow_endpoints()))
        yield
        if background:  # streamed episodes whose client left: they still finish and are recorded
            await asyncio.wait(background, timeout=settings.shutdown_grace_seconds)
        for task in tasks:
            task.cancel()

    app = create_app(
        SERVICE,
        settings,
        registry,
        health_check=lambda: {
            "active_episodes": core.active,
            "endpoint": core.registry.view()["active"],
            "endpoint_version": core.endpoint_version,
            "uptime_s": round(time.time() - started),
            "replica": core.replica,
            **(
                {}
                if records_ready(core.store)
                else {"status": "unavailable", "records": f"waiting for {core.store.location}"}
            ),
            **(
                {
                    "status": "unavailable",
                    "endpoints": core.sync_problem or "not yet read from the record store",
                }
                if records_ready(core.store) and core.endpoint_version is None
                else {}
            ),
        },
        lifespan=lifespan,
    )

    async def store_unavailable(request: Any, exc: Exception) -> JSONResponse:
        log.error("%s", exc)
        return _error(503, f"the record store cannot be reached: {exc}", {"Retry-After": "2"})

    app.add_exception_handler(RecordStoreError, store_unavailable)

    def refuse(exc: Exception) -> JSONResponse:
        if isinstance(exc, GatewayFull):
            return _error(429, str(exc), {"Retry-After": str(settings.retry_after_seconds)})
        if isinstance(exc, EpisodeRunning):
            return _error(409, str(exc))
        return _error(422, str(exc))

    @app.post("/v1/episodes", responses=doc.POST_EPISODE)
    async def post_episode(body: EpisodeRequest, stream: bool = Query(False)) -> Any:
        try:
            admission = await core.begin(body)
        except (InvalidEpisode, GatewayFull, EpisodeRunning) as exc:
            return refuse(exc)
        if isinstance(admission, EpisodeRecord):  # recorded already (here or on another replica)
            return response_body(admission)
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

    @app.get("/v1/episodes/{episode_id}", responses=doc.GET_EPISODE)
    async def get_episode(episode_id: str) -> Any:
        record = await core.stored(episode_id)
        if record is None:
            return _error(404, f"no recorded episode {episode_id!r}")
        return record.dump()

    @app.get("/v1/episodes", responses={200: {"model": doc.EpisodeList}})
    async def list_episodes(
        limit: int = Query(100, ge=1, le=10_000), question_id: str | None = Query(None, max_length=256)
    ) -> Any:
        items = await asyncio.to_thread(core.store.list, limit=limit, question_id=question_id)
        return {"episodes": items, "count": await asyncio.to_thread(core.store.count)}

    admin = [Depends(require_admin)]

    @app.get("/admin/coordinator", dependencies=admin)
    async def get_coordinator() -> Any:
        return {**core.registry.view(), "workers": core.pool.view()}

    @app.put("/admin/coordinator", dependencies=admin, responses=doc.PUT_COORDINATOR)
    async def put_coordinator(change: EndpointChange) -> Any:
        if change.endpoint is None and change.activate is None:
            return _error(422, "give an endpoint to add or change, a name to activate, or both")
        try:
            return await core.put_endpoint(change)
        except RegistryError as exc:
            log.warning("coordinator endpoint change refused: %s", exc)
            return _error(409, str(exc))

    add_viewer(app, core, decoder)
    return app


def response_message(record: EpisodeRecord) -> coordinator_pb2.RunCoordinatorEpisodeResponse:
    """The gRPC answer: the HTTP response body, parsed by json_format (same field names)."""
    body = response_body(record)
    coordinator_usage = record.coordinator.usage
    body["usage"] = {
        **coordinator_usage.model_dump(),
        "total_tokens": coordinator_usage.prompt_tokens + coordinator_usage.completion_tokens,
        "turns": len(record.coordinator.turns),
    }
    body["question_id"] = body["question_id"] or ""
    body["worker_reports"] = [
        {
            "stop_reason": "STOP_REASON_" + (w.status.upper() if w.status in STOP_REASONS else "ERROR"),
            "episode_id": w.episode_id,
            **w.report.model_dump(),
        }
        for w in record.workers
    ]
    return json_format.ParseDict(body, coordinator_pb2.RunCoordinatorEpisodeResponse())


def request_of(message: coordinator_pb2.RunCoordinatorEpisodeRequest) -> EpisodeRequest:
    """The HTTP request shape from the gRPC one; unset optional fields stay unset (None)."""
    return EpisodeRequest.model_validate(json_format.MessageToDict(message, preserving_proto_field_name=True))


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
        try:
            admission = await self.core.begin(body)
        except InvalidEpisode as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except GatewayFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except EpisodeRunning as exc:
            await context.abort(grpc.StatusCode.ABORTED, str(exc))
        except RecordStoreError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the record store cannot be reached: {exc}")
        if isinstance(admission, EpisodeRecord):
            return response_message(admission)
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
        http_client=settings.upstream_http_client,
    )
    metrics.active_endpoint.info({"name": endpoints.view()["active"]})
    pool = WorkerPool(
        settings.workers,
        attempts=settings.worker_attempts,
        timeout_seconds=settings.worker_timeout_seconds,
        full_wait_seconds=settings.worker_full_wait_seconds,
        unavailable_wait_seconds=settings.worker_wait_seconds,
        on_attempt=lambda replica, outcome: metrics.worker_attempts.labels(replica, outcome).inc(),
        max_message_bytes=settings.grpc_max_message_bytes,
    )
    # A tokenizer that cannot be loaded stops the start (DecoderError, one line): it was asked for.
    decoder = TokenDecoder.load(settings.tokenizer) if settings.tokenizer is not None else None
    store = open_store(settings)
    core = GatewayCore(settings, endpoints, pool, store, metrics)
    app = build_http(core, registry, time.time(), decoder)
    server = None
    if settings.grpc_port is not None:
        server = GrpcServer(SERVICE, settings, registry)
        server.add(coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server, CoordinatorServicer(core))
    return app, server, core


# How long one attempt to reach the record database waits (at start, then every 2 s until it answers).
RECORDS_CONNECT_TIMEOUT_SECONDS = 5.0


def open_store(settings: CoordinatorSettings) -> RecordStore:
    """The gateway's record store: PostgreSQL when `records_url` is set, else the SQLite file.

    A PostgreSQL server that does not answer at start is not fatal: the gateway starts not ready
    (/health 503, episodes 503) and connects when the server comes (`connect_records`). A schema
    newer than this code, a bad URL or a bad SQLite file stop the start with one line."""
    if settings.records_url is None:
        return SqliteRecordStore(settings.records_path)
    from core.record_store_pg import PostgresRecordStore

    store = PostgresRecordStore(
        settings.records_url.get_secret_value(), wait=False, connect_timeout=RECORDS_CONNECT_TIMEOUT_SECONDS
    )
    try:
        store.connect()
    except SchemaTooNew:
        store.close()
        raise
    except RecordStoreError as exc:
        log.error("%s; the gateway is not ready until it answers", exc)
    return store


def records_ready(store: RecordStore) -> bool:
    return getattr(store, "ready", True)


async def connect_records(store: RecordStore) -> None:
    """Keep connecting to a record database that did not answer at start; a schema newer than this
    code, found once it answers, stops the gateway (SIGTERM to itself, after one line)."""
    while not records_ready(store):
        try:
            await asyncio.to_thread(store.connect)  # type: ignore[attr-defined]
        except SchemaTooNew as exc:
            log.critical("%s", exc)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        except RecordStoreError:
            await asyncio.sleep(2)
            continue
        log.info("record database %s answers: the gateway is ready", store.location)
