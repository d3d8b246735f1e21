"""`bcstack serve worker`: episodes over gRPC (RunEpisode), health and metrics over HTTP.

A request carries a task (chat messages, or the coordinator's branch description and prompt),
optional budget and sampling overrides; the response carries the worker report for the
coordinator, the token-level trajectory for the trainer, and usage. A budget, turn or context
stop is a normal response; a bad request is INVALID_ARGUMENT; a full worker answers
RESOURCE_EXHAUSTED at once (backpressure: the caller tries another replica or later).
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Any

import grpc
from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, RootModel

from core import protocol as p
from core.budget import BudgetLimits
from core.kit.auth import require_admin
from core.kit.grpc_server import GrpcServer
from core.kit.http import KitDetail, ValidationErrorBody, create_app
from core.kit.metrics import new_registry
from core.records import trajectory_to_proto
from core.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.worker.gate import ModelStopGate
from services.worker.metrics import WorkerMetrics
from services.worker.prompts import WORKER_SYSTEM_PROMPT
from services.worker.reload import CanaryStep, ReloadManager, ReloadRefused
from services.worker.runner import (
    EpisodeResult,
    EpisodeRunner,
    ProtocolSettings,
    Sampling,
)
from services.worker.settings import WorkerSettings

SERVICE = "worker"
_STOP_PB = {
    "finish": common_pb2.STOP_REASON_FINISH,
    "budget": common_pb2.STOP_REASON_BUDGET,
    "turns": common_pb2.STOP_REASON_TURNS,
    "context": common_pb2.STOP_REASON_CONTEXT,
    "error": common_pb2.STOP_REASON_ERROR,
}


class InvalidTask(ValueError):
    pass


@dataclass(frozen=True)
class Prepared:
    episode_id: str
    description: str
    messages: list[dict[str, str]]
    limits: BudgetLimits
    sampling: Sampling
    gold_answer: str | None = None  # for the no-search guard only; never shown to the model


class WorkerCore:
    """Validation, admission and bookkeeping around the episode runner (transport-free)."""

    def __init__(self, runner: EpisodeRunner, settings: WorkerSettings, metrics: WorkerMetrics) -> None:
        self.runner = runner
        self.settings = settings
        self.metrics = metrics
        self.active = 0
        self.system_prompt = (
            Path(settings.system_prompt_file).read_text()
            if settings.system_prompt_file
            else WORKER_SYSTEM_PROMPT
        )

    def messages_of(self, request: worker_pb2.RunWorkerEpisodeRequest) -> list[dict[str, str]]:
        kind = request.WhichOneof("task")
        if kind == "chat":
            messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            if not any(m["role"] == "user" and m["content"].strip() for m in messages):
                raise InvalidTask("chat task needs a non-empty user message")
            bad = [m["role"] for m in messages if m["role"] not in ("system", "user", "assistant")]
            if bad:
                raise InvalidTask(f"unknown message role {bad[0]!r}")
        elif kind == "branch":
            if not request.branch.prompt.strip():
                raise InvalidTask("branch task needs a non-empty prompt")
            messages = [
                {"role": "system", "content": self.system_prompt},
                {"role": "user", "content": request.branch.prompt},
            ]
        else:
            raise InvalidTask("no task: set chat or branch")
        size = sum(len(m["content"]) for m in messages)
        if size > self.settings.max_task_chars:
            raise InvalidTask(f"task is {size} characters; the limit is {self.settings.max_task_chars}")
        return messages

    def limits_of(self, request: worker_pb2.RunWorkerEpisodeRequest) -> BudgetLimits:
        s, b = self.settings, request.budget
        base = BudgetLimits(s.max_tokens, s.max_turns, s.max_new_tokens_per_turn, s.context_length)
        try:
            return base.with_overrides(
                max_tokens=b.max_tokens if b.HasField("max_tokens") else None,
                max_turns=b.max_turns if b.HasField("max_turns") else None,
                max_new_tokens_per_turn=b.max_new_tokens if b.HasField("max_new_tokens") else None,
                context_length=b.context_length if b.HasField("context_length") else None,
            )
        except ValueError as e:
            raise InvalidTask(str(e)) from None

    def sampling_of(self, request: worker_pb2.RunWorkerEpisodeRequest) -> Sampling:
        s, o = self.settings, request.sampling
        sampling = Sampling(
            temperature=o.temperature if o.HasField("temperature") else s.temperature,
            top_p=o.top_p if o.HasField("top_p") else s.top_p,
            top_k=o.top_k if o.HasField("top_k") else s.top_k,
            seed=o.seed if o.HasField("seed") else None,
        )
        # A float field of a protobuf can hold inf and NaN, which neither the checks' comparisons
        # (NaN < 0 is false) nor the engine's JSON body can carry (bench/fuzz_grpc.py: UNKNOWN).
        if (
            not 0 <= sampling.temperature < math.inf
            or not 0 < sampling.top_p <= 1
            or (sampling.top_k is not None and sampling.top_k < 1)
        ):
            raise InvalidTask("sampling: 0 <= temperature (finite), 0 < top_p <= 1, top_k >= 1")
        return sampling

    def prepare(self, request: worker_pb2.RunWorkerEpisodeRequest) -> Prepared:
        """Validate a request into what the runner needs; InvalidTask says what is wrong."""
        try:
            return Prepared(
                episode_id=request.episode_id or uuid.uuid4().hex,
                description=request.branch.description if request.WhichOneof("task") == "branch" else "task",
                messages=self.messages_of(request),
                limits=self.limits_of(request),
                sampling=self.sampling_of(request),
                gold_answer=request.gold_answer if request.HasField("gold_answer") else None,
            )
        except InvalidTask:
            self.metrics.rejected.labels("invalid").inc()
            raise

    def reserve(self, n: int) -> None:
        """Take ``n`` episode slots or refuse at once (backpressure, no queue)."""
        if self.active + n > self.settings.max_concurrent_episodes:
            self.metrics.rejected.labels("full").inc()
            raise OverCapacity(
                f"worker is running {self.active} of {self.settings.max_concurrent_episodes} episodes; "
                f"{n} more do not fit"
            )
        self.active += n
        self.metrics.active.set(self.active)

    async def execute(self, prepared: Prepared) -> EpisodeResult:
        """Run a reserved episode and free its slot."""
        try:
            result = await self.runner.run(
                prepared.messages,
                episode_id=prepared.episode_id,
                limits=prepared.limits,
                sampling=prepared.sampling,
                gold_answer=prepared.gold_answer,
            )
        finally:
            self.active -= 1
            self.metrics.active.set(self.active)
        self.metrics.episode(result)
        return result

    async def run(self, request: worker_pb2.RunWorkerEpisodeRequest) -> tuple[Prepared, EpisodeResult]:
        prepared = self.prepare(request)
        self.reserve(1)
        return prepared, await self.execute(prepared)


class OverCapacity(RuntimeError):
    pass


def response_of(result: EpisodeResult, description: str) -> worker_pb2.RunWorkerEpisodeResponse:
    t = result.trajectory
    report_text = p.render_worker_report(
        p.WorkerReportText(description, result.status, result.answer, result.explanation, result.confidence)
    )
    return worker_pb2.RunWorkerEpisodeResponse(
        episode_id=result.episode_id,
        report=common_pb2.WorkerReport(
            answer=result.answer,
            explanation=result.explanation,
            confidence=result.confidence,
            stop_reason=_STOP_PB[result.status],
            raw_text=report_text,
            episode_id=result.episode_id,
        ),
        trajectory=trajectory_to_proto(result.worker_trajectory(), worker_pb2.Trajectory),
        usage=common_pb2.Usage(
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
            observation_tokens=result.observation_tokens,
            total_tokens=result.tokens_used,
            turns=result.turns,
            tool_calls=len(t.tool_calls),
        ),
    )


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, core: WorkerCore) -> None:
        self.core = core

    async def RunEpisode(self, request, context):  # noqa: N802 - gRPC method name
        try:
            prepared, result = await self.core.run(request)
        except InvalidTask as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except OverCapacity as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        return response_of(result, prepared.description)

    async def RunEpisodes(self, request, context):  # noqa: N802
        if not request.episodes:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no episodes")
        prepared = []
        for i, episode in enumerate(request.episodes):
            try:
                prepared.append(self.core.prepare(episode))
            except InvalidTask as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"episode {i}: {e}")
        ids = [p_.episode_id for p_ in prepared]
        if len(set(ids)) != len(ids):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "episode_id values must be distinct")
        try:
            self.core.reserve(len(prepared))
        except OverCapacity as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        tasks = {asyncio.ensure_future(self.core.execute(p_)): p_ for p_ in prepared}
        try:
            for done in asyncio.as_completed(tasks):
                result = await done
                yield response_of(
                    result, next(p_ for p_ in prepared if p_.episode_id == result.episode_id).description
                )
        finally:
            for task in tasks:  # the caller went away: stop the episodes still running
                task.cancel()


# Not blank, no NUL byte (no path holds one): what `reload.resolve_checkpoint` takes as a path.
PATH_TEXT = r"^[^\x00]*[^\s\x00][^\x00]*$"


class ReloadRequest(BaseModel):
    checkpoint: str = Field(
        description="folder relative to checkpoint_root, or an absolute path inside it", pattern=PATH_TEXT
    )
    weight_version: Annotated[str, Field(pattern=r"\S")] | None = Field(
        None, description="version the engine reports; default: folder name"
    )
    canary_step: CanaryStep | None = Field(
        None, description="set by `bcstack worker reload --canary`: counted per step in metrics"
    )


def watcher_for(settings: WorkerSettings, manager: ReloadManager) -> Any:
    """The checkpoint watcher of `reload_watch` (None when off): each new complete export under
    `checkpoint_root` is reloaded through `manager`, the same path as POST /admin/reload."""
    if not settings.reload_watch:
        return None
    if settings.checkpoint_root is None:
        raise ValueError("reload_watch needs checkpoint_root (BCSTACK_WORKER_CHECKPOINT_ROOT)")
    from services.worker.watch import CheckpointWatcher

    async def reload(path: Any, version: str) -> Any:
        return await manager.reload(str(path), version)

    return CheckpointWatcher(
        settings.checkpoint_root, reload, interval=settings.reload_watch_interval_seconds
    )


class ReloadFailed(BaseModel):
    status: str = Field(description='"failed"')
    error: str


class ReloadDone(BaseModel):
    status: str = Field(description='"ok"')
    weight_version: str
    previous_version: str | None
    seconds: float
    paused_seconds: float


class ReloadAttemptView(BaseModel):
    checkpoint: str
    weight_version: str | None
    outcome: str
    error: str | None
    started_at: float
    seconds: float


class ReloadStatus(BaseModel):
    weight_version: str | None = Field(description="null: the engine did not answer")
    checkpoint_root: str | None
    checkpoint: str | None
    attempts: list[ReloadAttemptView]
    grpc_port: int | None


def _refused(description: str) -> dict[str, Any]:
    return {"description": description, "model": ReloadFailed}


RELOAD_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": ReloadDone},
    400: {
        "description": "a blank checkpoint or one no path can be (a NUL byte), an empty weight_version, "
        "or a body that cannot be parsed",
        "model": RootModel[ReloadFailed | KitDetail],
    },
    403: {
        "description": "reload disabled (no checkpoint_root), a checkpoint outside the checkpoint root, "
        "or the admin token is wrong or unset",
        "model": RootModel[ReloadFailed | KitDetail],
    },
    404: _refused("no folder of that name in the checkpoint root"),
    409: _refused("a reload is already running"),
    422: {
        "description": "the checkpoint failed verification, or the body is not a reload request",
        "model": RootModel[ReloadFailed | ValidationErrorBody],
    },
    502: _refused("the engine failed during the swap; the old weights keep serving"),
}


def add_reload_routes(app: FastAPI, manager: ReloadManager, grpc_port: int | None = None) -> None:
    """`POST /admin/reload` and `GET /admin/reload` (admin token; see services/worker/reload.py).
    The status also names the worker's gRPC port, where a canary evaluation sends its episodes."""
    admin = [Depends(require_admin)]

    @app.post("/admin/reload", dependencies=admin, responses=RELOAD_RESPONSES)
    async def reload(body: ReloadRequest) -> Any:
        try:
            return await manager.reload(body.checkpoint, body.weight_version, body.canary_step)
        except ReloadRefused as e:
            return JSONResponse({"status": "failed", "error": e.error}, status_code=e.status)

    @app.get("/admin/reload", dependencies=admin, responses={200: {"model": ReloadStatus}})
    async def reload_status() -> Any:
        return {**await manager.status(), "grpc_port": grpc_port}

    app.state.reload_manager = manager


def add_ready_route(app: FastAPI, engine: Any, manager: ReloadManager, timeout_s: float) -> None:
    """`GET /ready`, the pod's readiness: 200 when the engine generates (its /health_generate),
    and 200 while this worker's own reload has generation paused (SGLang's health routes fail
    during a pause, which would take the pod out of the Service for the length of every reload);
    503 otherwise."""

    @app.get("/ready", include_in_schema=False)
    async def ready() -> JSONResponse:
        if manager.in_progress:
            return JSONResponse({"status": "reloading"})
        try:
            async with asyncio.timeout(timeout_s):
                ok = await engine.health_generate()
        except TimeoutError:
            ok = False
        return JSONResponse({"status": "ok" if ok else "engine unavailable"}, status_code=200 if ok else 503)


def protocol_settings(settings: WorkerSettings) -> ProtocolSettings:
    """The runner's protocol settings; each is the worker setting of the same name."""
    return ProtocolSettings(**{f.name: getattr(settings, f.name) for f in fields(ProtocolSettings)})


def build(settings: WorkerSettings) -> tuple[FastAPI, GrpcServer | None, Any]:
    """The runner, its clients and both transports on one registry (what `bcstack serve worker` runs)."""
    from core.engine_client import EngineClient
    from services.worker.retrieval_client import RetrievalClient
    from services.worker.tokenizer import load_tokenizer

    if settings.tokenizer is None:
        raise ValueError(
            "no tokenizer: pass --tokenizer DIR (the served checkpoint) or set BCSTACK_WORKER_TOKENIZER"
        )
    registry = new_registry()
    metrics = WorkerMetrics(registry, settings)
    tokenizer = load_tokenizer(settings.tokenizer)  # tokenizer.json read without transformers (torch)
    engine = EngineClient(
        settings.engine_url,
        timeout_s=settings.engine_timeout_seconds,
        retries=settings.engine_retries,
        unreachable_wait_s=settings.engine_wait_seconds,
        admin_token=settings.admin_token.get_secret_value() if settings.admin_token else None,
    )
    retrieval = RetrievalClient(
        settings.retrieval_address,
        timeout_s=settings.retrieval_timeout_seconds,
        attempts=settings.retrieval_retries,
        unavailable_wait_s=settings.retrieval_wait_seconds,
    )
    runner = EpisodeRunner(
        engine,
        retrieval,
        tokenizer,
        limits=BudgetLimits(
            settings.max_tokens, settings.max_turns, settings.max_new_tokens_per_turn, settings.context_length
        ),
        sampling=Sampling(settings.temperature, settings.top_p, settings.top_k),
        protocol=protocol_settings(settings),
        on_turn=metrics.turn,
        on_tool_call=metrics.tool_call,
        stop_gate=(
            ModelStopGate(
                engine,
                tokenizer,
                max_new_tokens=settings.stop_gate_max_new_tokens,
                on_decision=metrics.gate_decision,
            )
            if settings.stop_gate == "model"
            else None
        ),
    )
    core = WorkerCore(runner, settings, metrics)
    started = time.time()
    manager = ReloadManager(
        engine, settings.checkpoint_root, metrics, pause_limit_s=settings.reload_pause_limit_seconds
    )
    watcher = watcher_for(settings, manager)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if watcher is not None:
            watcher.start()
        yield
        if watcher is not None:
            await watcher.stop()

    app = create_app(
        SERVICE,
        settings,
        registry,
        health_check=lambda: {"active_episodes": core.active, "uptime_s": round(time.time() - started)},
        lifespan=lifespan,
    )
    add_reload_routes(app, manager, settings.grpc_port)
    add_ready_route(app, engine, manager, settings.ready_timeout_seconds)
    server = None
    if settings.grpc_port is not None:
        server = GrpcServer(SERVICE, settings, registry)
        server.add(worker_pb2_grpc.add_WorkerServiceServicer_to_server, WorkerServicer(core))
    return app, server, (engine, retrieval)
