"""Prometheus metrics of the stand-in coordinator LLM (names per DESIGN.md §8)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from core.kit.metrics import LATENCY_BUCKETS_SECONDS

# ok / length: answered (length = cut at max_tokens); invalid: refused with 400/404/422;
# unauthorized: 401; fault_*: an injected fault; error: an unexpected server error.
OUTCOMES = (
    "ok",
    "length",
    "invalid",
    "unauthorized",
    "fault_http500",
    "fault_http429",
    "fault_garbage",
    "fault_hang",
    "error",
)


class CoordinatorLlmMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "bcstack_coordinator_llm_requests_total",
            "Chat completion requests, by outcome (ok, length, invalid, unauthorized, fault_*, error).",
            ["outcome"],
            registry=registry,
        )
        self.duration = Histogram(
            "bcstack_coordinator_llm_request_duration_seconds",
            "Chat completion latency, from the request to its last byte (a stream's [DONE]), in seconds.",
            buckets=LATENCY_BUCKETS_SECONDS,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "bcstack_coordinator_llm_prompt_tokens_total",
            "Prompt tokens of answered chat completions (a whitespace/punctuation estimate).",
            registry=registry,
        )
        self.completion_tokens = Counter(
            "bcstack_coordinator_llm_completion_tokens_total",
            "Completion tokens answered (a whitespace/punctuation estimate).",
            registry=registry,
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)

    def record(self, outcome: str, seconds: float) -> None:
        self.requests.labels(outcome).inc()
        self.duration.observe(seconds)
