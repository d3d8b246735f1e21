"""Settings of the CPU engine (`bcstack serve engine`); env prefix `BCSTACK_ENGINE_`."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, SecretStr

from core import budget
from core.kit.settings import ServiceSettings

Policy = Literal["expert", "expert-snippets"]
Dtype = Literal["auto", "float32", "bfloat16"]


class EngineSettings(ServiceSettings):
    service_name: ClassVar[str] = "engine"

    # 30000 is SGLang's default port (server_args.py), so a worker pointed at "an SGLang server"
    # finds the CPU engine where it would find the real one.
    port: int = Field(30000, ge=0, le=65535, description="HTTP port (0 = any free port)")

    model: Path | None = Field(None, description="HF-format checkpoint folder (`bcstack model tiny`)")
    tokenizer: Path | None = Field(
        None, description="tokenizer folder; unset = the model folder (required with --policy)"
    )
    policy: Policy | None = Field(
        None,
        description="serve a scripted policy instead of a model: expert (the toy world's expert worker) or "
        "expert-snippets (the same expert reading facts off search snippets, written to be copied)",
    )
    world: Path | None = Field(None, description="toy world folder (`bcstack toyworld generate`); checked")

    context_length: int | None = Field(
        None, gt=0, description="context window in tokens; unset = the model's max_position_embeddings"
    )
    max_context_length: int = Field(
        budget.CONTEXT_LENGTH, gt=0, description="largest context window (Qwen3-4B's: the worker's)"
    )
    max_running_requests: int = Field(16, ge=1, description="sequences decoded together in one step")
    max_queued_requests: int = Field(4096, ge=1, description="requests waiting for a slot; more get 503")
    prefix_cache_tokens: int = Field(
        262_144,
        ge=0,
        description="prefix cache (SGLang's radix cache): KV of at most this many tokens kept for "
        "requests that start with the same ids, LRU; 0 = off; flushed on weight updates. The tiny "
        "model's KV is 512 bytes a token (128 MiB at the default); the start-up log says the size",
    )
    weight_version: str = Field("default", description="weight version before any update (SGLang's default)")
    dtype: Dtype = Field("auto", description="weights dtype on the CPU: auto (as saved), float32 or bfloat16")
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads; unset = 1 below 100M parameters, else torch's default",
    )
    served_model_name: str | None = Field(
        None, description="like SGLang's --served-model-name: the name /model_info gives (unset: the path)"
    )
    admin_api_key: SecretStr | None = Field(
        None,
        description="like SGLang's --admin-api-key: Bearer token of the admin routes (weights, pause, flush, "
        "abort); unset = BCSTACK_ADMIN_TOKEN, and with neither the admin routes are disabled (403)",
    )
    api_key: SecretStr | None = Field(
        None,
        description="like SGLang's --api-key: Bearer token required on every route but /health*, /metrics",
    )
    health_generate_timeout_seconds: float = Field(
        20.0, gt=0, description="how long /health_generate waits for its one token (SGLang: 20)"
    )


def source_problem(settings: EngineSettings) -> str | None:
    """Why these settings name no servable source (a model or a scripted policy), or None."""
    if settings.model is None and settings.policy is None:
        return "serve a model (--model DIR) or a scripted policy (--policy expert --tokenizer DIR)"
    if settings.model is not None and settings.policy is not None:
        return "--model and --policy exclude each other"
    if settings.policy is not None and settings.tokenizer is None:
        return "--policy needs --tokenizer DIR (a `bcstack model tiny` folder)"
    return None
