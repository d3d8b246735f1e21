"""Prometheus metrics of the worker sidecar (`bcstack_worker_*`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from core import protocol as p
from core.budget import CONTEXT_LENGTH, MAX_NEW_TOKENS_PER_TURN, MAX_TOKENS, MAX_TURNS
from services.worker.reload import CANARY_STEPS, OUTCOMES, CanaryStep, Outcome
from services.worker.runner import EpisodeResult, ToolCallRecord, TurnRecord
from services.worker.settings import WorkerSettings

STOP_REASONS = ("finish", "budget", "turns", "context", "error")
# Buckets that resolve the seed-001 limits exactly: an edge at each limit and one just below it,
# so the episodes that ran into a limit have a bucket of their own.
EPISODE_TOKEN_BUCKETS = (
    512, 1024, 2048, 4096, 8192, 12288, 16384, 20480, MAX_TOKENS - 2048, MAX_TOKENS - 512,
    MAX_TOKENS - 1, MAX_TOKENS, 28672, 32768, CONTEXT_LENGTH,
)  # fmt: skip
EPISODE_TURN_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 25, 30, 35, MAX_TURNS - 1, MAX_TURNS, 50)
TURN_TOKEN_BUCKETS = (
    8, 16, 32, 64, 128, 256, 512, 1024, 2048, 3072,
    MAX_NEW_TOKENS_PER_TURN - 1, MAX_NEW_TOKENS_PER_TURN, 8192,
)  # fmt: skip
RELOAD_SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry, settings: WorkerSettings) -> None:
        self.episode_tokens = Histogram(
            "bcstack_worker_episode_tokens",
            "Tokens per worker episode (prompt + generations + observations).",
            buckets=EPISODE_TOKEN_BUCKETS,
            registry=registry,
        )
        self.episode_turns = Histogram(
            "bcstack_worker_episode_turns",
            "Assistant turns per worker episode.",
            buckets=EPISODE_TURN_BUCKETS,
            registry=registry,
        )
        self.turn_tokens = Histogram(
            "bcstack_worker_turn_generated_tokens",
            "Generated tokens per assistant turn.",
            buckets=TURN_TOKEN_BUCKETS,
            registry=registry,
        )
        self.episodes = Counter(
            "bcstack_worker_episodes_total",
            "Finished worker episodes by stop reason.",
            ["stop_reason"],
            registry=registry,
        )
        for reason in STOP_REASONS:
            self.episodes.labels(reason)
        self.tool_calls = Counter(
            "bcstack_worker_tool_calls_total",
            "Tool calls by tool and outcome.",
            ["tool", "outcome"],
            registry=registry,
        )
        self.episode_seconds = Histogram(
            "bcstack_worker_episode_duration_seconds",
            "Wall time of a worker episode.",
            buckets=SECONDS_BUCKETS,
            registry=registry,
        )
        self.turn_seconds = Histogram(
            "bcstack_worker_turn_duration_seconds",
            "Wall time of one assistant turn: generation, tool calls, observation, bookkeeping.",
            buckets=SECONDS_BUCKETS,
            registry=registry,
        )
        self.turn_overhead = Histogram(
            "bcstack_worker_turn_overhead_seconds",
            "The worker's own time per turn: the turn minus engine and retrieval waits.",
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0),
            registry=registry,
        )
        self.engine_seconds = Histogram(
            "bcstack_worker_engine_request_duration_seconds",
            "Time of one /generate call.",
            buckets=SECONDS_BUCKETS,
            registry=registry,
        )
        self.engine_errors = Counter(
            "bcstack_worker_engine_errors_total",
            "Episodes ended by an engine or retrieval failure, by kind.",
            ["kind"],
            registry=registry,
        )
        self.gate_decisions = Counter(
            "bcstack_worker_stop_gate_decisions_total",
            "Runtime STOP gate decisions (stop, continue, unclear, error); none while the gate is off.",
            ["decision"],
            registry=registry,
        )
        for decision in ("stop", "continue", "unclear", "error"):
            self.gate_decisions.labels(decision)
        self.gate_tokens = Counter(
            "bcstack_worker_stop_gate_generated_tokens_total",
            "Tokens the STOP gate generated (not part of any trajectory or budget).",
            registry=registry,
        )
        self.active = Gauge("bcstack_worker_active_episodes", "Episodes running now.", registry=registry)
        self.rejected = Counter(
            "bcstack_worker_rejected_total",
            "Requests refused, by reason (full, invalid).",
            ["reason"],
            registry=registry,
        )
        limits = Gauge("bcstack_worker_limit", "Configured per-episode limits.", ["limit"], registry=registry)
        limits.labels("max_tokens").set(settings.max_tokens)
        limits.labels("max_turns").set(settings.max_turns)
        limits.labels("max_new_tokens_per_turn").set(settings.max_new_tokens_per_turn)
        limits.labels("context_length").set(settings.context_length)
        limits.labels("max_concurrent_episodes").set(settings.max_concurrent_episodes)
        self.reloads = Counter(
            "bcstack_worker_reloads_total",
            "POST /admin/reload attempts by outcome (ok, rejected: refused before pausing, failed).",
            ["outcome"],
            registry=registry,
        )
        for outcome in OUTCOMES:
            self.reloads.labels(outcome)
        self.canary_reloads = Counter(
            "bcstack_worker_canary_reloads_total",
            "Reloads by `bcstack worker reload --canary`, by step (canary: the canaries' reload, promote: "
            "the other replicas' after the canaries passed, rollback: the canaries' way back) and outcome.",
            ["step", "outcome"],
            registry=registry,
        )
        for step in CANARY_STEPS:
            for outcome in OUTCOMES:
                self.canary_reloads.labels(step, outcome)
        self.reload_seconds = Histogram(
            "bcstack_worker_reload_duration_seconds",
            "Wall time of a reload attempt (verification included).",
            buckets=RELOAD_SECONDS_BUCKETS,
            registry=registry,
        )
        self.reload_paused = Histogram(
            "bcstack_worker_reload_paused_seconds",
            "Time generation was paused by a reload (pause to continue).",
            buckets=RELOAD_SECONDS_BUCKETS,
            registry=registry,
        )
        self.weight_version_info = Gauge(
            "bcstack_worker_weight_version_info",
            "1 for the weight version the engine serves (as last seen), no other series.",
            ["weight_version"],
            registry=registry,
        )
        self._weight_version: str | None = None

    def gate_decision(self, decision: str, tokens: int) -> None:
        self.gate_decisions.labels(decision).inc()
        self.gate_tokens.inc(tokens)

    def reload(self, outcome: Outcome, seconds: float, paused_seconds: float | None) -> None:
        self.reloads.labels(outcome).inc()
        self.reload_seconds.observe(seconds)
        if paused_seconds is not None:
            self.reload_paused.observe(paused_seconds)

    def canary_step(self, step: CanaryStep, outcome: Outcome) -> None:
        self.canary_reloads.labels(step, outcome).inc()

    def weight_version(self, version: str | None) -> None:
        if version == self._weight_version:
            return
        if self._weight_version is not None:
            self.weight_version_info.remove(self._weight_version)
        if version is not None:
            self.weight_version_info.labels(version).set(1)
        self._weight_version = version

    def turn(self, record: TurnRecord) -> None:
        if self._weight_version is None and record.weight_version:
            # Until a reload or GET /admin/reload asks the engine, the first turn tells. Later turns
            # do not: a turn answered just before a swap may arrive after it.
            self.weight_version(record.weight_version)
        self.turn_tokens.observe(record.generated_tokens)
        self.engine_seconds.observe(record.engine_s)
        self.turn_seconds.observe(record.total_s)
        self.turn_overhead.observe(record.overhead_s)

    def tool_call(self, record: ToolCallRecord) -> None:
        tool = record.name if record.name in p.WORKER_TOOLS else "unknown"
        self.tool_calls.labels(tool, record.outcome).inc()

    def episode(self, result: EpisodeResult) -> None:
        self.episodes.labels(result.status).inc()
        self.episode_tokens.observe(result.tokens_used)
        self.episode_turns.observe(result.turns)
        self.episode_seconds.observe(result.seconds)
        if result.status == "error":
            kind = "engine" if result.trajectory.error.startswith("engine") else "retrieval"
            self.engine_errors.labels(kind).inc()
