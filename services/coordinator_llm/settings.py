"""Settings of the stand-in coordinator LLM (`bcstack serve coordinator-llm`); env prefix
`BCSTACK_COORDINATOR_LLM_`."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from core.kit.settings import OptionalSecret, ServiceSettings

Policy = Literal["scripted"]
FailMode = Literal["http500", "http429", "garbage", "hang"]


class CoordinatorLlmSettings(ServiceSettings):
    service_name: ClassVar[str] = "coordinator-llm"

    port: int = Field(8004, ge=0, le=65535, description="HTTP port (0 = any free port)")

    policy: Policy = Field(
        "scripted", description="what answers: scripted (the toy world's scripted coordinator policy)"
    )
    fanout: int = Field(1, ge=1, description="workers the scripted policy branches each question to")
    max_rounds: int = Field(
        2, ge=1, description="rounds of branching before the scripted policy gives up with 'unknown'"
    )
    model_name: str = Field(
        "scripted-coordinator",
        min_length=1,
        description="the model id served: listed by /v1/models; a request naming another model gets 404",
    )
    api_key: OptionalSecret = Field(
        None, description="Bearer token every /v1 route requires; unset = no key needed"
    )

    # Fault injection, for testing the coordinator gateway's retries and timeouts.
    fail_rate: float = Field(
        0.0, ge=0.0, le=1.0, description="fraction of chat completions answered with the injected fault"
    )
    fail_mode: FailMode = Field(
        "http500",
        description=(
            "the fault: http500, http429 (with Retry-After), garbage (200 whose content holds no "
            "function call) or hang (answer after hang_seconds)"
        ),
    )
    fault_seed: int = Field(0, description="seed of the fault draws: the same seed, the same pattern")
    retry_after_seconds: int = Field(1, ge=0, description="Retry-After of an injected 429, in seconds")
    hang_seconds: float = Field(30.0, ge=0.0, description="delay of an injected hang, in seconds")
