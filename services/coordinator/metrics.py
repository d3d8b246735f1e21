"""Prometheus metrics of the coordinator gateway (`bcstack_coordinator_*`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from core.kit.metrics import LATENCY_BUCKETS_SECONDS
from services.coordinator.loop import STATUSES, CoordinatorEpisode

COUNT_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
OVERHEAD_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0)
BREAKER_STATES = ("closed", "half_open", "open")


class CoordinatorMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.episodes = Counter(
            "bcstack_coordinator_episodes_total",
            "Finished coordinator episodes by status and endpoint.",
            ["status", "endpoint"],
            registry=registry,
        )
        self.episode_seconds = Histogram(
            "bcstack_coordinator_episode_duration_seconds",
            "Wall time of a coordinator episode.",
            buckets=LATENCY_BUCKETS_SECONDS,
            registry=registry,
        )
        self.turns = Histogram(
            "bcstack_coordinator_episode_turns",
            "Coordinator turns per episode.",
            buckets=COUNT_BUCKETS,
            registry=registry,
        )
        self.branches = Histogram(
            "bcstack_coordinator_episode_branches",
            "Worker branches per episode.",
            buckets=COUNT_BUCKETS,
            registry=registry,
        )
        self.branch_outcomes = Counter(
            "bcstack_coordinator_branches_total",
            "Worker branches by the worker's stop reason (error: no replica could run it).",
            ["status"],
            registry=registry,
        )
        self.turn_overhead = Histogram(
            "bcstack_coordinator_turn_overhead_seconds",
            "The gateway's own time per coordinator turn: the turn minus LLM and worker waits.",
            buckets=OVERHEAD_BUCKETS,
            registry=registry,
        )
        self.upstream_seconds = Histogram(
            "bcstack_coordinator_upstream_request_duration_seconds",
            "Time of one chat-completion attempt, by endpoint and outcome (ok or the error kind).",
            ["endpoint", "outcome"],
            buckets=LATENCY_BUCKETS_SECONDS,
            registry=registry,
        )
        self.upstream_errors = Counter(
            "bcstack_coordinator_upstream_errors_total",
            "Failed chat-completion attempts by endpoint and kind.",
            ["endpoint", "kind"],
            registry=registry,
        )
        self.retries = Counter(
            "bcstack_coordinator_upstream_retries_total",
            "Chat-completion retries by endpoint and the error that caused them.",
            ["endpoint", "kind"],
            registry=registry,
        )
        self.breaker = Gauge(
            "bcstack_coordinator_breaker_state",
            "Circuit breaker per endpoint: 1 on the current state's series.",
            ["endpoint", "state"],
            registry=registry,
        )
        self.worker_attempts = Counter(
            "bcstack_coordinator_worker_attempts_total",
            "Worker RunEpisode attempts by replica and outcome.",
            ["replica", "outcome"],
            registry=registry,
        )
        self.active_endpoint = Info(
            "bcstack_coordinator_active_endpoint", "The endpoint new episodes use.", registry=registry
        )
        self.swaps = Counter(
            "bcstack_coordinator_endpoint_swaps_total", "Changes of the active endpoint.", registry=registry
        )
        self.active = Gauge("bcstack_coordinator_active_episodes", "Episodes running now.", registry=registry)
        self.rejected = Counter(
            "bcstack_coordinator_rejected_total",
            "Episode requests refused, by reason (full, invalid).",
            ["reason"],
            registry=registry,
        )
        self.record_seconds = Histogram(
            "bcstack_coordinator_record_write_duration_seconds",
            "Time to write one episode record durably.",
            buckets=LATENCY_BUCKETS_SECONDS,
            registry=registry,
        )
        for reason in ("full", "invalid"):
            self.rejected.labels(reason)

    def endpoint_registered(self, name: str) -> None:
        for status in STATUSES:
            self.episodes.labels(status, name)
        self.breaker_changed(name, "closed")

    def breaker_changed(self, name: str, state: str) -> None:
        for s in BREAKER_STATES:
            self.breaker.labels(name, s).set(1.0 if s == state else 0.0)

    def attempt(self, name: str, outcome: str, seconds: float) -> None:
        self.upstream_seconds.labels(name, outcome).observe(seconds)
        if outcome != "ok":
            self.upstream_errors.labels(name, outcome).inc()

    def episode(self, episode: CoordinatorEpisode, endpoint: str) -> None:
        self.episodes.labels(episode.status, endpoint).inc()
        self.episode_seconds.observe(episode.seconds)
        self.turns.observe(len(episode.turns))
        self.branches.observe(len(episode.branches))
        for branch in episode.branches:
            self.branch_outcomes.labels(branch.status).inc()
        for turn in episode.turns:
            if turn.total_seconds > 0:
                self.turn_overhead.observe(turn.overhead_seconds)
