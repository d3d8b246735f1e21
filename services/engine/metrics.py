"""The CPU engine's Prometheus metrics: SGLang's `sglang:*` families under `bcstack_engine_*` names
(REFERENCE.md: our names have no colons, use base units, and counters end in `_total`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from core.kit.metrics import LATENCY_BUCKETS_SECONDS

BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "bcstack_engine_requests_total",
            "Finished /generate requests, by finish reason (stop, length, abort).",
            ["finish_reason"],
            registry=registry,
        )
        self.rejected = Counter(
            "bcstack_engine_rejected_requests_total",
            "/generate requests refused before running (invalid, too long, queue full), by HTTP status.",
            ["code"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "bcstack_engine_prompt_tokens_total",
            "Prompt tokens of the requests admitted (from the prefix cache or computed).",
            registry=registry,
        )
        self.cached_prompt_tokens = Counter(
            "bcstack_engine_cached_prompt_tokens_total",
            "Prompt tokens whose KV came from the prefix cache (meta_info.cached_tokens).",
            registry=registry,
        )
        self.computed_prompt_tokens = Counter(
            "bcstack_engine_computed_prompt_tokens_total",
            "Prompt tokens run through the model at admission (not found in the prefix cache).",
            registry=registry,
        )
        self.prefix_cache_hits = Counter(
            "bcstack_engine_prefix_cache_hits_total",
            "Requests admitted with a prefix of their prompt found in the prefix cache.",
            registry=registry,
        )
        self.prefix_cache_misses = Counter(
            "bcstack_engine_prefix_cache_misses_total",
            "Requests admitted with no prefix found in the prefix cache (while it is on).",
            registry=registry,
        )
        self.prefix_cache_tokens = Gauge(
            "bcstack_engine_prefix_cache_tokens",
            "Tokens whose KV the prefix cache holds (at most prefix_cache_tokens).",
            registry=registry,
        )
        self.generation_tokens = Counter(
            "bcstack_engine_generation_tokens_total", "Tokens generated.", registry=registry
        )
        self.running = Gauge(
            "bcstack_engine_running_requests", "Requests in the decode batch.", registry=registry
        )
        self.queued = Gauge(
            "bcstack_engine_queued_requests", "Requests waiting for a batch slot.", registry=registry
        )
        self.paused = Gauge(
            "bcstack_engine_paused", "1 while generation is paused, else 0.", registry=registry
        )
        self.time_to_first_token = Histogram(
            "bcstack_engine_time_to_first_token_seconds",
            "Time from a request's arrival to its first generated token, in seconds.",
            buckets=LATENCY_BUCKETS_SECONDS,
            registry=registry,
        )
        self.e2e_latency = Histogram(
            "bcstack_engine_e2e_request_latency_seconds",
            "Time from a request's arrival to its last token, in seconds.",
            buckets=LATENCY_BUCKETS_SECONDS,
            registry=registry,
        )
        self.batch_size = Histogram(
            "bcstack_engine_decode_batch_size",
            "Sequences advanced together by one decode step.",
            buckets=BATCH_SIZE_BUCKETS,
            registry=registry,
        )
        self.weight_updates = Counter(
            "bcstack_engine_weight_updates_total",
            "update_weights_from_disk calls, by result (success, failure).",
            ["result"],
            registry=registry,
        )
        for reason in ("stop", "length", "abort"):
            self.requests.labels(reason)
        for result in ("success", "failure"):
            self.weight_updates.labels(result)
