"""The gateway's episodes: request shapes, the typed episode record, and `GatewayCore`.

`GatewayCore.run` runs one admitted episode: it leases the active endpoint from the registry (a swap
never touches an episode in flight), runs `loop.run_episode` with that endpoint's chat client and
the worker pool as the branch dispatcher, builds the `core.records.EpisodeRecord`, writes it durably
(`core.record_store`: SQLite for one gateway, PostgreSQL shared by replicas; a group commit) and
only then returns it. The HTTP and gRPC transports around it are in `services.coordinator.service`.

An episode id a client names is one episode across every replica sharing the record store
(`GatewayCore.begin`): a recorded id answers its record; an unrecorded one is claimed in the store
(this replica's name and a lease it renews while the episode runs) before it runs. A request for an
id another replica is running waits until that one is recorded, or until its claim lapses (its
replica died), and then runs it under the same id. The record's write drops the claim.

A worker trajectory is validated where it enters the record (`core.records.trajectory_from_proto`):
a worker that sends a broken one (mask and token counts that disagree, ...) gets its branch
recorded as an error with the reason, and its tokens never reach a training sample.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format
from pydantic import BaseModel, ConfigDict, Field, field_validator

from core.engine_client import derive_seed
from core.kit.upstream import EndpointSpec
from core.record_store import RecordExists, RecordStore, RecordStoreError, default_replica
from core.records import (
    CoordinatorLog,
    CoordinatorTurn,
    CoordinatorUsage,
    EndpointDetail,
    EpisodeLimits,
    EpisodeRecord,
    RecordError,
    Usage,
    WorkerRecord,
    WorkerReport,
    trajectory_from_proto,
)
from core.v1 import common_pb2, worker_pb2
from services.coordinator.loop import Branch, CoordinatorEpisode, LoopLimits, run_episode
from services.coordinator.metrics import CoordinatorMetrics
from services.coordinator.registry import Endpoint, EndpointRegistry, RegistryError
from services.coordinator.settings import CoordinatorSettings
from services.coordinator.workers import WorkerPool

# The record-store setting that holds the endpoints changed at runtime and the active one.
ENDPOINT_STATE = "coordinator.endpoints"

log = logging.getLogger("bcstack.coordinator")


# --- request shapes ----------------------------------------------------------------------------


class LoopOverrides(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_turns: int | None = Field(None, ge=1, le=1000)
    max_branches: int | None = Field(None, ge=1, le=10_000)
    wall_time_seconds: float | None = Field(None, gt=0, le=7 * 24 * 3600)


INT32_MAX = 2**31 - 1  # the proto's BudgetOverrides fields are int32: a larger value cannot be sent


class WorkerBudget(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_tokens: int | None = Field(None, gt=0, le=INT32_MAX)
    max_turns: int | None = Field(None, gt=0, le=INT32_MAX)
    max_new_tokens: int | None = Field(None, gt=0, le=INT32_MAX)
    context_length: int | None = Field(None, gt=0, le=INT32_MAX)


class WorkerSampling(BaseModel):
    """Sampling for every worker episode of the request (the worker's settings where unset): RL
    rollouts sample at top_p 1.0, so the engine's recorded log-probs are those of the distribution
    sampled from."""

    model_config = ConfigDict(extra="forbid")

    # Strict: true/false is no number (found by schemathesis). The seed is lax because gRPC's JSON
    # mapping writes an int64 as a string; a boolean is refused by hand.
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False, strict=True)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False, strict=True)
    top_k: int | None = Field(None, ge=1, le=INT32_MAX, strict=True)
    # Integers a JSON number holds exactly (2**53): above it a client's float parser rounds the bound.
    seed: int | None = Field(None, ge=0, le=2**53 - 1)

    @field_validator("seed", mode="before")
    @classmethod
    def _no_bool_seed(cls, value: object) -> object:
        if isinstance(value, bool):
            raise ValueError("seed must be an integer, not a boolean")
        return value


class EpisodeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    question: str = Field(min_length=1)
    question_id: str | None = Field(None, max_length=256)
    gold_answer: str | None = Field(None, max_length=20_000)
    group_id: str | None = Field(None, max_length=256)
    episode_id: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
    overrides: LoopOverrides | None = None
    worker_budget: WorkerBudget | None = None
    worker_sampling: WorkerSampling | None = None
    # The gold answer reaches the workers' no-search guard (FoldAgent's rule: a right answer given
    # before any search is bounced once; a wrong one voided). False: every search-free answer is
    # voided, and nothing of the gold answer reaches a worker. The record keeps the gold either way.
    worker_gold: bool = Field(True, strict=True)  # true or false, never 0/1 or "yes"


class EndpointChange(BaseModel):
    """PUT /admin/coordinator: add or change an endpoint, activate one, or both."""

    model_config = ConfigDict(extra="forbid")

    endpoint: EndpointSpec | None = None
    activate: str | None = None


def worker_request(
    request: EpisodeRequest, worker_id: str, description: str, prompt: str, branch_index: int = 0
) -> worker_pb2.RunWorkerEpisodeRequest:
    """The worker episode a branch of `request` runs: its budget and sampling overrides, and the gold
    answer for the worker's no-search guard unless `worker_gold` is false."""
    budget = request.worker_budget.model_dump(exclude_none=True) if request.worker_budget else {}
    sampling = request.worker_sampling.model_dump(exclude_none=True) if request.worker_sampling else {}
    if "seed" in sampling:  # each branch its own stream, the same for the same branch of any run
        sampling["seed"] = derive_seed(sampling["seed"], "branch", branch_index)
    return worker_pb2.RunWorkerEpisodeRequest(
        episode_id=worker_id,
        question_id=request.question_id or "",
        group_id=request.group_id or "",
        branch=worker_pb2.BranchTask(description=description, prompt=prompt),
        budget=common_pb2.BudgetOverrides(**budget),
        sampling=common_pb2.SamplingOverrides(**sampling),
        gold_answer=request.gold_answer if request.worker_gold else None,  # unset when None
    )


class InvalidEpisode(ValueError):
    """The request cannot run (empty or oversized question, ...): 422 / INVALID_ARGUMENT."""


class GatewayFull(RuntimeError):
    """The gateway runs its maximum of concurrent episodes: 429 / RESOURCE_EXHAUSTED."""


class EpisodeRunning(RuntimeError):
    """The episode id is being run right now by another request: 409 / ABORTED."""


# --- records -----------------------------------------------------------------------------------


def usage_of(message: common_pb2.Usage) -> Usage:
    return Usage.model_validate(
        json_format.MessageToDict(
            message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
    )


def worker_record(branch: Branch, worker_episode_id: str) -> WorkerRecord:
    """One branch and the worker episode that served it (None trajectory: no response came back)."""
    out = branch.outcome
    response = out.response if out is not None else None
    report = response.report if response is not None else None
    error = (out.error if out is not None else "") or (response.trajectory.error if response else "")
    status = branch.status
    trajectory = None
    if response is not None and response.HasField("trajectory"):
        try:
            trajectory = trajectory_from_proto(response.trajectory)
        except RecordError as exc:
            log.error("worker episode %s sent a broken trajectory: %s", response.episode_id, exc)
            status, error = "error", f"invalid trajectory from the worker: {exc}"
    return WorkerRecord(
        branch=branch.index,
        turn=branch.turn,
        description=branch.description,
        prompt=branch.prompt,
        episode_id=response.episode_id if response is not None else worker_episode_id,
        status=status,
        replica=out.replica if out is not None else None,
        attempts=out.attempts if out is not None else 0,
        error=error,
        started_at=branch.started_at,
        seconds=branch.seconds,
        report=WorkerReport(
            answer=report.answer if report else "",
            explanation=report.explanation if report else "",
            confidence=report.confidence if report else "",
            raw_text=branch.report_text(),
        ),
        usage=usage_of(response.usage) if response is not None else Usage(),
        trajectory=trajectory,
    )


def episode_record(
    episode: CoordinatorEpisode,
    request: EpisodeRequest,
    episode_id: str,
    endpoint: Endpoint,
    limits: LoopLimits,
    worker_ids: dict[int, str],
) -> EpisodeRecord:
    """DESIGN.md §4's episode record: everything needed to grade, train on, or debug the episode."""
    workers = [worker_record(b, worker_ids.get(b.index, "")) for b in episode.branches]
    versions = sorted({v for w in workers if w.trajectory for v in w.trajectory.weight_versions})
    usages = [w.usage.model_dump() for w in workers]
    return EpisodeRecord(
        episode_id=episode_id,
        question_id=request.question_id,
        group_id=request.group_id,
        question=request.question,
        gold_answer=request.gold_answer,
        status=episode.status,
        error=episode.error,
        answer=episode.answer,
        explanation=episode.explanation,
        confidence=episode.confidence,
        endpoint=endpoint.name,
        endpoint_detail=EndpointDetail(model=endpoint.spec.model, base_url=endpoint.spec.base_url),
        created_at=episode.started_at,
        finished_at=episode.started_at + episode.seconds,
        seconds=episode.seconds,
        limits=EpisodeLimits(
            max_turns=limits.max_turns,
            max_branches=limits.max_branches,
            max_branches_per_turn=limits.max_branches_per_turn,
            wall_time_seconds=limits.wall_time_seconds,
        ),
        worker_budget=request.worker_budget.model_dump(exclude_none=True) if request.worker_budget else {},
        worker_sampling=request.worker_sampling.model_dump(exclude_none=True)
        if request.worker_sampling
        else {},
        worker_gold=request.worker_gold,
        coordinator=CoordinatorLog(
            messages=episode.messages,
            turns=[
                CoordinatorTurn(
                    turn=t.index,
                    seconds=t.seconds,
                    attempts=t.attempts,
                    prompt_tokens=t.prompt_tokens,
                    completion_tokens=t.completion_tokens,
                    calls=t.calls,
                    errors=t.errors,
                    workers_seconds=t.workers_seconds,
                    total_seconds=t.total_seconds,
                )
                for t in episode.turns
            ],
            usage=CoordinatorUsage(
                prompt_tokens=episode.prompt_tokens, completion_tokens=episode.completion_tokens
            ),
        ),
        workers=workers,
        weight_versions=versions,
        worker_usage=Usage(**{k: sum(u[k] for u in usages) for k in Usage.model_fields}),
    )


def response_body(record: EpisodeRecord) -> dict[str, Any]:
    """What POST /v1/episodes answers: the record without messages and token-level trajectories."""
    return {
        "episode_id": record.episode_id,
        "question_id": record.question_id,
        "status": record.status,
        "error": record.error,
        "answer": record.answer,
        "explanation": record.explanation,
        "confidence": record.confidence,
        "endpoint": record.endpoint,
        "worker_reports": [
            {
                "branch": w.branch,
                "description": w.description,
                "status": w.status,
                "episode_id": w.episode_id,
                "replica": w.replica,
                "error": w.error,
                **w.report.model_dump(),
            }
            for w in record.workers
        ],
        "usage": {**record.coordinator.usage.model_dump(), "turns": len(record.coordinator.turns)},
        "worker_usage": record.worker_usage.model_dump(),
        "weight_versions": record.weight_versions,
        "seconds": record.seconds,
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
        self.replica = settings.replica_name or default_replica()
        self.lease_seconds = settings.claim_lease_seconds
        self._claimed: set[str] = set()  # ids this replica holds a claim on (renewed by heartbeat())
        # The version of the stored endpoint state this replica runs (None: not read yet).
        self.endpoint_version: int | None = None
        self._sync_problem: str | None = None

    def limits_of(self, request: EpisodeRequest) -> LoopLimits:
        o = request.overrides or LoopOverrides()
        s = self.settings
        return LoopLimits(
            max_turns=o.max_turns or s.max_turns,
            max_branches=o.max_branches or s.max_branches,
            max_branches_per_turn=s.max_branches_per_turn,
            wall_time_seconds=o.wall_time_seconds or s.wall_time_seconds,
        )

    async def stored(self, episode_id: str) -> EpisodeRecord | None:
        """The recorded episode (any stored schema version, read as the current one), or None."""
        data = await asyncio.to_thread(self.store.get, episode_id)
        return None if data is None else EpisodeRecord.load(data)

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

    def _finish(self, episode_id: str) -> None:
        """Give back what admit() reserved."""
        self._running.discard(episode_id)
        self._claimed.discard(episode_id)
        self.active -= 1
        self.metrics.active.dec()

    async def begin(self, request: EpisodeRequest) -> Admission | EpisodeRecord:
        """What a POST does before running an episode: a recorded id answers its record; else an
        admission (a slot reserved; a named id claimed cluster-wide, waiting while another replica
        runs it). One round trip to the store per look (`claim_or_record`). Raises InvalidEpisode,
        GatewayFull, EpisodeRunning, RecordStoreError."""
        episode_id = request.episode_id
        if episode_id is None:
            return self.admit(request)  # a fresh uuid: no other replica can hold it
        if episode_id in self._running:
            raise EpisodeRunning(f"episode {episode_id} is running now")
        admission: Admission | None = None
        waited_for: str | None = None
        delay = 0.05
        try:
            while True:
                record, holder = await asyncio.to_thread(
                    self.store.claim_or_record, episode_id, self.replica, self.lease_seconds
                )
                if record is not None:  # a retried request: the recorded result, not a second episode
                    if admission is not None:
                        self._finish(episode_id)
                        admission = None
                    return EpisodeRecord.load(record)
                if holder is None:  # ours now
                    try:
                        admission = admission or self.admit(request)
                    except BaseException:
                        await self._release(episode_id)
                        raise
                    self._claimed.add(episode_id)
                    if waited_for is not None:
                        log.warning(
                            "episode %s: the claim of replica %s lapsed unrecorded; running it here",
                            episode_id,
                            waited_for,
                        )
                    return admission
                admission = admission or self.admit(request)  # a slot held while waiting
                if waited_for is None:
                    log.info(
                        "episode %s is running on replica %s; waiting for its record", episode_id, holder
                    )
                waited_for = holder
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
        except BaseException:
            if admission is not None and episode_id not in self._claimed:
                self._finish(episode_id)
            raise

    async def _release(self, episode_id: str) -> None:
        """Drop this replica's claim on an id it will not run (best effort: the lease lapses)."""
        try:
            await asyncio.to_thread(self.store.release, episode_id, self.replica)
        except Exception as exc:  # noqa: BLE001
            log.warning(
                "episode %s: cannot release its claim (%s); it lapses in %g s",
                episode_id,
                exc,
                self.lease_seconds,
            )

    async def heartbeat(self) -> None:
        """Renew this replica's claims every third of a lease, for as long as the gateway runs."""
        failing = False
        while True:
            await asyncio.sleep(self.lease_seconds / 3)
            if not self._claimed:
                continue
            try:
                await asyncio.to_thread(
                    self.store.renew, sorted(self._claimed), self.replica, self.lease_seconds
                )
                if failing:
                    log.info("episode claims renewed again")
                failing = False
            except Exception as exc:  # noqa: BLE001 - the loop must outlive a database outage
                if not failing:
                    log.error("cannot renew episode claims: %s", exc)
                failing = True

    async def run(
        self,
        request: EpisodeRequest,
        admission: Admission,
        on_event: Callable[[str, dict], None] | None = None,
    ) -> EpisodeRecord:
        """Run an admitted episode to its end, record it durably, and return the record."""
        episode_id, endpoint = admission.episode_id, admission.endpoint
        try:
            limits = self.limits_of(request)
            worker_ids: dict[int, str] = {}

            async def dispatch(branch: Branch):
                worker_id = f"{episode_id}.w{branch.index}"
                worker_ids[branch.index] = worker_id
                return await self.pool.run(
                    worker_request(request, worker_id, branch.description, branch.prompt, branch.index)
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
            try:
                await self.store.put_async(record.dump())
            except RecordExists:
                # Another replica ran it too (this one's claim had lapsed) and recorded it first:
                # the id is one episode, the stored one.
                stored = await self.stored(episode_id)
                if stored is None:
                    raise
                log.warning(
                    "episode %s was recorded by another replica meanwhile; answering that record", episode_id
                )
                return stored
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
        except BaseException:
            if episode_id in self._claimed:  # not recorded: free the id for a retry at once
                await self._release(episode_id)
            raise
        finally:
            self._finish(episode_id)

    async def put_endpoint(self, change: EndpointChange) -> dict[str, Any]:
        """Probe, persist in the record store (every replica adopts it from there, and it outlives a
        restart), then apply. RegistryError (refused) or RecordStoreError (not persisted): nothing
        changed."""
        await self.try_sync_endpoints()  # build on the newest stored state (last writer wins)
        before = self.registry.view()
        if change.endpoint is not None:
            self.metrics.endpoint_registered(change.endpoint.name)

        async def persist(state: dict[str, Any]) -> None:
            self.endpoint_version = await asyncio.to_thread(self.store.write_setting, ENDPOINT_STATE, state)

        view = await self.registry.put(change.endpoint, activate=change.activate, commit=persist)
        self._counted(before["swaps"], view)
        return {**view, "version": self.endpoint_version}

    def _counted(self, swaps_before: int, view: dict[str, Any]) -> None:
        swaps = view["swaps"] - swaps_before
        if swaps > 0:
            self.metrics.swaps.inc(swaps)
        self.metrics.active_endpoint.info({"name": view["active"]})

    async def sync_endpoints(self) -> bool:
        """Adopt the stored endpoint state when it is newer than what runs here; whether it was.
        RecordStoreError when the store cannot be read; RegistryError when the state cannot be
        adopted yet (a key file the kubelet has not written yet): both retried by the caller."""
        stored = await asyncio.to_thread(self.store.read_setting, ENDPOINT_STATE)
        version, state = stored if stored is not None else (0, None)
        if self.endpoint_version is not None and version <= self.endpoint_version:
            return False
        before = self.registry.view()
        if state is not None:
            for spec in state.get("endpoints", []):
                if isinstance(spec, dict) and isinstance(spec.get("name"), str):
                    self.metrics.endpoint_registered(spec["name"])
            if await self.registry.adopt(state):
                log.info(
                    "coordinator endpoint '%s' active here from the record store (version %d)",
                    self.registry.view()["active"],
                    version,
                )
        self.endpoint_version = version
        self._counted(before["swaps"], self.registry.view())
        return True

    @property
    def sync_problem(self) -> str | None:
        """Why the stored endpoint state could not be adopted the last time (None: it was)."""
        return self._sync_problem

    async def try_sync_endpoints(self) -> None:
        """`sync_endpoints()`, its failure kept in `sync_problem` and logged once per new problem."""
        try:
            await self.sync_endpoints()
            if self._sync_problem is not None:
                log.info("coordinator endpoint state in sync with the record store again")
            self._sync_problem = None
        except (RecordStoreError, RegistryError) as exc:
            if str(exc) != self._sync_problem:
                log.error("cannot adopt the stored coordinator endpoint state: %s", exc)
            self._sync_problem = str(exc)

    async def follow_endpoints(self) -> None:
        """Keep this replica on the stored endpoint state (the swaps other replicas make), every
        `endpoint_sync_seconds`, for as long as the gateway runs."""
        while True:
            await asyncio.sleep(self.settings.endpoint_sync_seconds)
            await self.try_sync_endpoints()
