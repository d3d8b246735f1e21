"""Settings of the worker sidecar (`bcstack serve worker`); budgets and sampling from seed 001."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from core import budget
from core.kit.settings import ServiceSettings


class WorkerSettings(ServiceSettings):
    service_name: ClassVar[str] = "worker"

    port: int = Field(8002, ge=0, le=65535, description="HTTP port (health, metrics)")
    grpc_port: int | None = Field(50052, ge=0, le=65535, description="gRPC port (RunEpisode)")
    engine_url: str = Field("http://127.0.0.1:30000", description="SGLang (or CPU engine) base URL")
    retrieval_address: str = Field("127.0.0.1:50051", description="retrieval service gRPC address host:port")
    tokenizer: Path | None = Field(None, description="checkpoint or tokenizer dir; renders the chat template")

    # Seed 001's budget and sampling (core/budget.py).
    max_tokens: int = Field(
        budget.MAX_TOKENS, gt=0, description="episode token budget (prompt + generations + observations)"
    )
    max_turns: int = Field(budget.MAX_TURNS, gt=0, description="assistant turns per episode")
    max_new_tokens_per_turn: int = Field(
        budget.MAX_NEW_TOKENS_PER_TURN, gt=0, description="generated tokens per turn at most"
    )
    context_length: int = Field(budget.CONTEXT_LENGTH, gt=0, description="the engine's context window")
    temperature: float = Field(budget.TEMPERATURE, ge=0, description="sampling temperature")
    top_p: float = Field(budget.TOP_P, gt=0, le=1, description="nucleus sampling")
    top_k: int | None = Field(None, gt=0, description="top-k sampling; unset = off")

    max_concurrent_episodes: int = Field(
        64, gt=0, description="episodes at once; more get RESOURCE_EXHAUSTED"
    )
    engine_timeout_seconds: float = Field(600.0, gt=0, description="one /generate call at most")
    engine_retries: int = Field(3, ge=1, description="attempts per /generate on connection errors and 5xx")
    engine_wait_seconds: float = Field(
        120.0,
        ge=0,
        description="how long a /generate call keeps retrying an engine it cannot reach at all (crashed, "
        "restarting) before the episode ends with an error stop; 0: engine_retries only",
    )
    retrieval_timeout_seconds: float = Field(10.0, gt=0, description="one retrieval call at most")
    retrieval_retries: int = Field(3, ge=1, description="attempts per retrieval call on UNAVAILABLE/timeouts")
    retrieval_wait_seconds: float = Field(
        120.0,
        ge=0,
        description="how long a search or open_page keeps retrying a retrieval service that is "
        "UNAVAILABLE (crashed, restarting) before the episode ends with an error stop; "
        "0: retrieval_retries only",
    )

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
    default_topk: int = Field(
        10, ge=1, le=100, description="hits a search without a topk shows (FoldAgent: 10)"
    )
    max_topk: int = Field(
        10, ge=1, le=100, description="hits a search may show at most (slime port: 10; FoldAgent: no cap)"
    )
    # Fidelity with FoldAgent's environment: docs/guide/worker.md, "Worker protocol: fidelity
    # settings" says what each does upstream and why ours differs where it does.
    no_search_guard: bool = Field(
        True,
        description="void an answer given before any search; bounce it once when it matches the gold answer",
    )
    native_tool_calls: bool = Field(
        True, description="also read Qwen3 <tool_call> JSON and <answer> blocks (FoldAgent's fallback)"
    )
    strip_call_whitespace: bool = Field(
        True, description="strip white space around call names and parameter values (FoldAgent keeps it)"
    )
    ignore_calls_in_reasoning: bool = Field(
        True, description="ignore calls written inside <think> (FoldAgent runs them)"
    )
    unknown_function_replaces: bool = Field(
        False, description="an unknown function's error replaces the turn's other results (FoldAgent: yes)"
    )
    report_missing_page: bool = Field(
        True, description="an open_page that finds nothing says so (FoldAgent: an empty block)"
    )
    zero_topk_is_default: bool = Field(
        True, description="topk 0 shows the default number of hits (FoldAgent: one hit)"
    )
    native_string_is_one: bool = Field(
        True,
        description="a native search/visit with one string instead of a list is one call (FoldAgent: one per "
        "character)",
    )
    stop_gate: Literal["off", "model"] = Field(
        "off",
        description="runtime STOP gate between turns: off (every seed evaluation) or model (one short greedy "
        "generation by the worker model at the gate prompt, core/gate.py)",
    )
    stop_gate_max_new_tokens: int = Field(16, gt=0, le=256, description="tokens the gate may generate")
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
    reload_pause_limit_seconds: float = Field(
        240.0,
        gt=0,
        description="longest a reload keeps generation paused waiting for the engine to load the weights; "
        "the chart keeps the engine's liveness window above it",
    )
    ready_timeout_seconds: float = Field(
        4.0, gt=0, description="how long GET /ready waits for the engine's /health_generate"
    )
