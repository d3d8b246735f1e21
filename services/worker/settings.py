"""Settings of the worker sidecar (`bcstack serve worker`); budgets and sampling from seed 001."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field

from core.kit.settings import ServiceSettings


class WorkerSettings(ServiceSettings):
    service_name: ClassVar[str] = "worker"

    port: int = Field(8002, ge=0, le=65535, description="HTTP port (health, metrics)")
    grpc_port: int | None = Field(50052, ge=0, le=65535, description="gRPC port (RunEpisode)")
    engine_url: str = Field("http://127.0.0.1:30000", description="SGLang (or CPU engine) base URL")
    retrieval_address: str = Field("127.0.0.1:50051", description="retrieval service gRPC address host:port")
    tokenizer: Path | None = Field(None, description="checkpoint or tokenizer dir; renders the chat template")

    # Seed 001: worker episode budget 24,576 tokens, up to 40 turns, max 4,096 generated tokens per
    # turn, temperature 1, top-p .95, SGLang context 40,960.
    max_tokens: int = Field(
        24_576, gt=0, description="episode token budget (prompt + generations + observations)"
    )
    max_turns: int = Field(40, gt=0, description="assistant turns per episode")
    max_new_tokens_per_turn: int = Field(4_096, gt=0, description="generated tokens per turn at most")
    context_length: int = Field(40_960, gt=0, description="the engine's context window")
    temperature: float = Field(1.0, ge=0, description="sampling temperature")
    top_p: float = Field(0.95, gt=0, le=1, description="nucleus sampling")
    top_k: int | None = Field(None, gt=0, description="top-k sampling; unset = off")

    max_concurrent_episodes: int = Field(
        64, gt=0, description="episodes at once; more get RESOURCE_EXHAUSTED"
    )
    engine_timeout_seconds: float = Field(600.0, gt=0, description="one /generate call at most")
    engine_retries: int = Field(3, ge=1, description="attempts per /generate on connection errors and 5xx")
    retrieval_timeout_seconds: float = Field(10.0, gt=0, description="one retrieval call at most")
    retrieval_retries: int = Field(3, ge=1, description="attempts per retrieval call on UNAVAILABLE/timeouts")

    search_k: int = Field(
        50, ge=1, le=100, description="results asked of retrieval per search (FoldAgent: 50)"
    )
    snippet_words: int = Field(512, ge=1, description="words shown per new search hit (FoldAgent: 512)")
    seen_snippet_words: int = Field(
        128, ge=1, description="words shown for an already seen hit (FoldAgent: 128)"
    )
    page_words: int = Field(4096, ge=1, description="words shown by open_page (FoldAgent: 4096)")
    reflection_nudge: bool = Field(
        True, description="append the slime port's reflection nudge to observations"
    )
    resubmit_empty_finish: bool = Field(True, description="bounce a finish with an empty answer")
    system_prompt_file: Path | None = Field(
        None, description="system prompt for branch tasks; unset = built in"
    )
    max_task_chars: int = Field(200_000, gt=0, description="largest task text accepted")
    checkpoint_root: Path | None = Field(
        None,
        description="folder POST /admin/reload may load checkpoints from (as the engine sees it); unset = "
        "reload disabled",
    )
    reload_watch: bool = Field(
        False,
        description="watch checkpoint_root and reload the newest complete export (SHA256SUMS written last)",
    )
    reload_watch_interval_seconds: float = Field(10.0, gt=0, description="how often the watcher looks")
