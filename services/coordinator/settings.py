"""Settings of the coordinator gateway (`bcstack serve coordinator`); env prefix
`BCSTACK_COORDINATOR_`.

The endpoint registry comes from `endpoints` (a list in the `--config` YAML file, or JSON in
`BCSTACK_COORDINATOR_ENDPOINTS`) and/or the one-endpoint shorthand `coordinator_url` /
`coordinator_model` / `coordinator_api_key_env`, which registers an endpoint named `default`.
API keys are never settings values: an endpoint names the env var or the mounted file (a K8s
Secret) that holds its key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, ClassVar

from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode

from core.kit.settings import OptionalSecret, ServiceSettings
from core.kit.upstream import EndpointSpec, HttpClientName


class CoordinatorSettings(ServiceSettings):
    service_name: ClassVar[str] = "coordinator"

    port: int = Field(8003, ge=0, le=65535, description="HTTP port (episodes API, admin, health, metrics)")
    grpc_port: int | None = Field(50053, ge=0, le=65535, description="gRPC port (RunEpisode)")

    # --- the coordinator LLM endpoints ---
    endpoints: list[EndpointSpec] = Field(
        default_factory=list, description="named coordinator endpoints (YAML list or JSON)"
    )
    active_endpoint: str | None = Field(
        None, description="the endpoint new episodes use; unset = the first one"
    )
    coordinator_url: str | None = Field(
        None, description="shorthand: base URL of an endpoint named 'default'"
    )
    coordinator_model: str = Field(
        "scripted-coordinator", description="shorthand: model of the 'default' endpoint"
    )
    coordinator_api_key_env: str | None = Field(
        None, description="shorthand: env var holding the 'default' endpoint's API key"
    )
    upstream_http_client: HttpClientName = Field(
        "aiohttp",
        description="HTTP client of the coordinator LLM calls: aiohttp, or httpx (about 4x the "
        "gateway's CPU per turn at 512 concurrent episodes: bench/gateway.py)",
    )
    probe_on_start: bool = Field(
        False, description="probe the active endpoint at start and refuse to start when it is dead"
    )
    endpoint_sync_seconds: float = Field(
        2.0,
        gt=0,
        le=300,
        description="how often a replica reads the endpoint state the record store holds (a swap made "
        "on any replica sharing the store reaches this one within it)",
    )

    # --- workers ---
    workers: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["127.0.0.1:50052"],
        description="worker service gRPC addresses host:port (comma-separated in env)",
    )
    worker_attempts: int = Field(
        3, ge=1, description="replicas tried for one branch before it is reported failed"
    )
    worker_timeout_seconds: float = Field(3600.0, gt=0, description="one worker episode at most")
    worker_full_wait_seconds: float = Field(
        600.0,
        ge=0,
        description="how long a branch waits while every worker answers RESOURCE_EXHAUSTED (full) "
        "before it fails; refusals while waiting do not use up worker_attempts (0: they do)",
    )
    worker_wait_seconds: float = Field(
        120.0,
        ge=0,
        description="how long a branch waits while every worker answers UNAVAILABLE (crashed, restarting) "
        "before it fails; failures while waiting do not use up worker_attempts (0: they do)",
    )

    # --- the episode loop (overridable per request) ---
    max_turns: int = Field(16, ge=1, description="coordinator turns per episode")
    max_branches: int = Field(32, ge=1, description="worker branches per episode")
    max_branches_per_turn: int = Field(8, ge=1, description="branch calls run from one coordinator turn")
    wall_time_seconds: float = Field(3600.0, gt=0, description="wall-clock limit of one episode")
    max_question_chars: int = Field(20_000, ge=1, description="longest question accepted")
    max_concurrent_episodes: int = Field(
        512, ge=1, description="episodes at once; more get 429 (gRPC RESOURCE_EXHAUSTED)"
    )
    retry_after_seconds: int = Field(1, ge=0, description="Retry-After sent with a 429 when full")

    # --- upstream protection ---
    upstream_attempts: int = Field(
        5, ge=1, description="attempts per chat completion on 429/5xx/timeouts/connection errors"
    )
    upstream_backoff_seconds: float = Field(0.5, ge=0, description="first retry wait (doubles, with jitter)")
    upstream_backoff_max_seconds: float = Field(30.0, ge=0, description="longest retry wait")
    breaker_failures: int = Field(
        5, ge=1, description="consecutive failed completions that open an endpoint's circuit breaker"
    )
    breaker_reset_seconds: float = Field(
        30.0, gt=0, description="time an open breaker waits before letting one trial request through"
    )

    # --- records ---
    records_path: Path = Field(
        Path("coordinator-records.sqlite"),
        description="SQLite file of durable episode records (one gateway); unused when records_url is set",
    )
    records_url: OptionalSecret = Field(
        None,
        description="PostgreSQL URL of a record store shared by every gateway replica "
        "(postgresql://USER@HOST:5432/DB); the password in it or in PGPASSWORD; never logged",
    )
    replica_name: str | None = Field(
        None,
        max_length=200,
        description="this gateway's name in episode claims (the pod's name); unset = HOST:PID",
    )
    claim_lease_seconds: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="an episode's claim lapses this long after its replica's last heartbeat; a retry "
        "on another replica then runs it again under the same id",
    )

    # --- the episode viewer (GET /ui; docs/guide/viewer.md) ---
    tokenizer: Path | None = Field(
        None,
        description="the worker model's tokenizer folder (tokenizer.json): the viewer decodes trajectory "
        "token ids with it; unset = the viewer shows token counts and ids, no text",
    )
    viewer_token: OptionalSecret = Field(
        None,
        description="bearer token of the read-only episode viewer (/ui), so readers need not hold the "
        "admin token; /ui takes it or the admin token, and is open only when neither is set",
    )

    @field_validator("workers", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        if isinstance(value, str):
            if value.strip().startswith("["):
                return json.loads(value)
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @model_validator(mode="after")
    def _registry_shape(self) -> CoordinatorSettings:
        names = [e.name for e in self.all_endpoints()]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"endpoint names must be unique; repeated: {', '.join(duplicates)}")
        if self.active_endpoint is not None and self.active_endpoint not in names:
            known = ", ".join(names) or "none"
            raise ValueError(
                f"active_endpoint {self.active_endpoint!r} is not a registered endpoint (known: {known})"
            )
        if not self.workers:
            raise ValueError("workers: give at least one worker gRPC address")
        return self

    def all_endpoints(self) -> list[EndpointSpec]:
        """`endpoints` plus the shorthand's 'default' endpoint when `coordinator_url` is set."""
        specs = list(self.endpoints)
        if self.coordinator_url:
            specs.insert(
                0,
                EndpointSpec(
                    name="default",
                    base_url=self.coordinator_url,
                    model=self.coordinator_model,
                    api_key_env=self.coordinator_api_key_env,
                ),
            )
        return specs
