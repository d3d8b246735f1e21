"""Prometheus metrics of the judge proxy (`bcstack_judge_*`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from core.kit.metrics import LATENCY_BUCKETS_SECONDS

GRADERS = ("answer", "contribution")
BREAKER_STATES = ("closed", "half_open", "open")


class JudgeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.verdicts = Counter(
            "bcstack_judge_verdicts_total",
            "Verdicts by grader (answer, contribution), outcome (answer: correct, incorrect, "
            "parse_error; contribution: its label or parse_error) and method (exact, rule, llm).",
            ["grader", "outcome", "method"],
            registry=registry,
        )
        self.cache = Counter(
            "bcstack_judge_cache_requests_total",
            "LLM-graded requests by cache result: hit, miss (the upstream was asked), coalesced "
            "(an identical request in flight answered it).",
            ["grader", "result"],
            registry=registry,
        )
        self.parse_errors = Counter(
            "bcstack_judge_parse_errors_total",
            "Grader answers that could not be parsed (each try; a verdict is a parse_error after all tries).",
            ["grader"],
            registry=registry,
        )
        self.upstream_seconds = Histogram(
            "bcstack_judge_upstream_request_duration_seconds",
            "Time of one grader call attempt, by outcome (ok or the error kind).",
            ["outcome"],
            buckets=LATENCY_BUCKETS_SECONDS,
            registry=registry,
        )
        self.upstream_errors = Counter(
            "bcstack_judge_upstream_errors_total",
            "Failed grader call attempts by kind.",
            ["kind"],
            registry=registry,
        )
        self.retries = Counter(
            "bcstack_judge_upstream_retries_total",
            "Grader call retries by the error that caused them.",
            ["kind"],
            registry=registry,
        )
        self.unavailable = Counter(
            "bcstack_judge_unavailable_total",
            "Requests answered 503/UNAVAILABLE because the grader could not be reached.",
            ["grader"],
            registry=registry,
        )
        self.breaker = Gauge(
            "bcstack_judge_breaker_state",
            "The grader's circuit breaker: 1 on the current state's series.",
            ["state"],
            registry=registry,
        )
        self.breaker_changed("closed")
        for grader in GRADERS:
            self.parse_errors.labels(grader)
            self.unavailable.labels(grader)
            for result in ("hit", "miss", "coalesced"):
                self.cache.labels(grader, result)

    def breaker_changed(self, state: str) -> None:
        for s in BREAKER_STATES:
            self.breaker.labels(s).set(1.0 if s == state else 0.0)

    def attempt(self, outcome: str, seconds: float) -> None:
        self.upstream_seconds.labels(outcome).observe(seconds)
        if outcome != "ok":
            self.upstream_errors.labels(outcome).inc()
