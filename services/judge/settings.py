"""Settings of the judge proxy (`bcstack serve judge`); env prefix `BCSTACK_JUDGE_`.

The grader is `rule` (normalized exact / numeric match; the embedded default) or `openai` (any
OpenAI-compatible chat endpoint: `grader_url`, `grader_model`, the API key from the env var named
by `grader_api_key_env` or the file `grader_api_key_file`, e.g. a mounted K8s Secret).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from core.kit.settings import ServiceSettings
from core.kit.upstream import EndpointSpec

Backend = Literal["rule", "openai"]


class JudgeSettings(ServiceSettings):
    service_name: ClassVar[str] = "judge"

    port: int = Field(8005, ge=0, le=65535, description="HTTP port (grading API, health, metrics)")
    grpc_port: int | None = Field(50055, ge=0, le=65535, description="gRPC port (JudgeService)")

    backend: Backend = Field(
        "rule", description="grader: rule (exact/numeric match, no LLM) or openai (an LLM grader endpoint)"
    )
    grader_url: str | None = Field(None, description="OpenAI-compatible base URL, e.g. http://grader:8000/v1")
    grader_model: str = Field("grader", description="model id of the grader endpoint")
    grader_api_key_env: str | None = Field(None, description="env var holding the grader API key")
    grader_api_key_file: Path | None = Field(None, description="file holding the grader API key (a Secret)")
    grader_temperature: float | None = Field(0.0, ge=0, description="grader sampling temperature")
    grader_max_tokens: int | None = Field(1024, gt=0, description="grader completion tokens at most")
    grader_timeout_seconds: float = Field(60.0, gt=0, description="one grader call at most")
    parse_attempts: int = Field(3, ge=1, le=10, description="grader calls to get a parseable verdict")

    upstream_attempts: int = Field(5, ge=1, description="attempts per grader call on 429/5xx/timeouts")
    upstream_backoff_seconds: float = Field(0.5, ge=0, description="first retry wait (doubles, with jitter)")
    upstream_backoff_max_seconds: float = Field(30.0, ge=0, description="longest retry wait")
    breaker_failures: int = Field(5, ge=1, description="consecutive failures that open the circuit breaker")
    breaker_reset_seconds: float = Field(30.0, gt=0, description="open breaker's wait before one trial call")
    max_concurrent_upstream: int = Field(16, ge=1, description="grader calls in flight at most")
    rate_limit_per_second: float = Field(20.0, gt=0, description="grader calls started per second at most")

    cache_path: Path | None = Field(
        Path("judge-cache.sqlite"), description="SQLite file of cached verdicts; unset = no persistent cache"
    )
    max_batch: int = Field(512, ge=1, description="items in one batch request at most")
    max_field_chars: int = Field(200_000, ge=1, description="longest text field accepted")

    @model_validator(mode="after")
    def _openai_needs_a_url(self) -> JudgeSettings:
        if self.backend == "openai" and not self.grader_url:
            raise ValueError("backend 'openai' needs grader_url (BCSTACK_JUDGE_GRADER_URL or --grader-url)")
        return self

    def grader_spec(self) -> EndpointSpec:
        """The grader endpoint as the shared upstream client takes it."""
        return EndpointSpec(
            name="grader",
            base_url=self.grader_url or "http://127.0.0.1:1/v1",
            model=self.grader_model,
            api_key_env=self.grader_api_key_env,
            api_key_file=self.grader_api_key_file,
            timeout_seconds=self.grader_timeout_seconds,
            temperature=self.grader_temperature,
            top_p=None,
            max_tokens=self.grader_max_tokens,
        )
