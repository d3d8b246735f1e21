"""Single-turn prompts and their sampled responses (seed 004): the rows, the chat rendering and the
engine round trip that the specialists' RL, pass@k evaluation and distillation share.

Rows. A prompt file is JSONL (or a JSON array) in DAPO-Math-17k's form as slime reads it: ``prompt``
(a string, or a list of ``{"role", "content"}`` messages) and ``label`` (the verifier's target: a
number or text for maths, a JSON list of tests or checks for code and instruction following), plus
optional ``id`` and ``domain``. verl's ``reward_model.ground_truth`` is accepted for ``label``. Bad
rows are refused with their line number, never dropped silently.

Rendering. A string prompt becomes one user message; the conversation goes through the worker's
chat template with the generation prompt and thinking disabled (seed 004: "thinking disabled"), which
appends Qwen3's empty ``<think>\\n\\n</think>\\n\\n`` block. Tokenization uses the model folder's
``tokenizer.json`` through the `tokenizers` library (no torch), so the ids are those the trainer and
the engine see.

Sampling. Each response is one SGLang ``/generate`` call with ``input_ids`` and ``return_logprob``
(`core.engine_client.EngineClient`), so the trainer gets the exact response ids and the engine's
log-probs; ``n`` responses to a prompt are ``n`` concurrent calls, each with its own
``sampling_seed`` derived from (seed, prompt, index), so a run is reproducible on the CPU engine.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.chat_template import render_chat

MAX_PROMPT_CHARS = 200_000  # input size limit per row
MAX_ROWS = 1_000_000


class PromptError(ValueError):
    """A prompt file or row that cannot be used (one line: where and why)."""


@dataclass(frozen=True)
class PromptRow:
    id: str
    messages: tuple[dict[str, str], ...]
    label: str
    domain: str | None = None


@dataclass(frozen=True)
class SamplingSettings:
    """The sampling of one rollout or evaluation (SGLang's names; top_k -1 is "off")."""

    temperature: float = 1.0  # seed 004 training: T 1.0, top-p 1.0, top-k off
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 16_384  # seed 004: responses capped at 16,384 tokens


@dataclass
class Response:
    prompt_ids: list[int]
    output_ids: list[int]  # the stop token included when the engine stopped on one
    logprobs: list[float]
    text: str  # the decoded response, special tokens skipped
    finish_reason: str  # stop | length | abort
    weight_version: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


def _rows_of(path: Path) -> list[tuple[str, Any]]:
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise PromptError(f"{path}: not a JSON array ({e.msg} at line {e.lineno})") from None
        return [(f"{path}[{i}]", v) for i, v in enumerate(values)]
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if len(line) > MAX_PROMPT_CHARS:
            raise PromptError(
                f"{path}:{number}: row of {len(line):,} characters is over {MAX_PROMPT_CHARS:,}"
            )
        try:
            rows.append((f"{path}:{number}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise PromptError(f"{path}:{number}: not JSON ({e.msg} at column {e.colno})") from None
    return rows


def _label_of(row: dict[str, Any], where: str) -> str:
    label = row.get("label")
    if label is None and isinstance(row.get("reward_model"), dict):
        label = row["reward_model"].get("ground_truth")
    if label is None:
        raise PromptError(f'{where}: no "label" (or reward_model.ground_truth)')
    if isinstance(label, bool) or not isinstance(label, str | int | float | list | dict):
        raise PromptError(f'{where}: "label" must be text, a number or JSON')
    return label if isinstance(label, str) else json.dumps(label)


def _messages_of(prompt: Any, where: str) -> tuple[dict[str, str], ...]:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise PromptError(f'{where}: "prompt" is empty')
        return ({"role": "user", "content": prompt},)
    if isinstance(prompt, list) and prompt:
        messages = []
        for i, m in enumerate(prompt):
            if (
                not isinstance(m, dict)
                or m.get("role") not in ("system", "user", "assistant")
                or not isinstance(m.get("content"), str)
            ):
                raise PromptError(
                    f"{where}: prompt message {i} needs a role (system, user, assistant) and text"
                )
            messages.append({"role": m["role"], "content": m["content"]})
        if messages[-1]["role"] != "user":
            raise PromptError(f"{where}: the prompt's last message must be the user's")
        return tuple(messages)
    raise PromptError(f'{where}: "prompt" must be text or a non-empty list of messages')


def load_prompts(path: str | Path, *, limit: int | None = None) -> list[PromptRow]:
    """The rows of a prompt file; PromptError (one line) for a missing file or a bad row."""
    path = Path(path)
    if not path.is_file():
        raise PromptError(f"{path}: no such prompt file")
    rows: list[PromptRow] = []
    seen: set[str] = set()
    for where, row in _rows_of(path):
        if not isinstance(row, dict):
            raise PromptError(f"{where}: expected an object with prompt and label")
        rid = str(row.get("id", row.get("query_id", f"{path.stem}-{len(rows)}")))
        if rid in seen:
            raise PromptError(f"{where}: id {rid!r} repeats")
        seen.add(rid)
        domain = row.get("domain")
        rows.append(
            PromptRow(
                rid,
                _messages_of(row.get("prompt"), where),
                _label_of(row, where),
                str(domain) if domain is not None else None,
            )
        )
        if len(rows) > MAX_ROWS:
            raise PromptError(f"{path}: more than {MAX_ROWS:,} rows")
        if limit is not None and len(rows) >= limit:
            break
    if not rows:
        raise PromptError(f"{path}: no prompt rows")
    return rows


class TextCodec:
    """Encode prompts and decode responses with a model folder's `tokenizer.json` (no torch)."""

    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise PromptError(f"{model_dir}: no tokenizer.json")
        self.tokenizer = Tokenizer.from_file(str(path))
        self.eos_id = self.tokenizer.token_to_id("<|im_end|>")
        if self.eos_id is None:
            raise PromptError(
                f"{model_dir}: the tokenizer has no <|im_end|> token (not a Qwen3 chat tokenizer)"
            )

    def prompt_ids(self, row: PromptRow, *, enable_thinking: bool = False) -> list[int]:
        text = render_chat(list(row.messages), add_generation_prompt=True, enable_thinking=enable_thinking)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def sampling_seed(seed: int, row_id: str, index: int) -> int:
    """A per-response seed from the run's seed, the prompt id and the response index (stable)."""
    digest = hashlib.sha256(f"{seed}\0{row_id}\0{index}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


async def sample_responses(
    client: Any,  # core.engine_client.EngineClient
    codec: TextCodec,
    row: PromptRow,
    n: int,
    settings: SamplingSettings,
    *,
    seed: int = 0,
    context_length: int | None = None,
) -> list[Response]:
    """`n` responses to one prompt from the engine, concurrently, each with the engine's log-probs."""
    prompt = codec.prompt_ids(row)
    max_new = settings.max_new_tokens
    if context_length is not None:
        max_new = min(max_new, context_length - len(prompt) - 1)
        if max_new < 1:
            raise PromptError(
                f"prompt {row.id}: {len(prompt):,} tokens leave no room in a {context_length:,} context"
            )
    greedy = settings.temperature <= 0

    async def one(i: int) -> Response:
        result = await client.generate(
            prompt,
            max_new_tokens=max_new,
            temperature=settings.temperature,
            top_p=settings.top_p,
            top_k=settings.top_k,
            stop_token_ids=[codec.eos_id],
            seed=None if greedy else sampling_seed(seed, row.id, i),
        )
        return Response(
            prompt_ids=prompt,
            output_ids=list(result.output_ids),
            logprobs=list(result.logprobs),
            text=codec.decode(result.output_ids),
            finish_reason=result.finish_reason,
            weight_version=result.weight_version,
        )

    return list(await asyncio.gather(*(one(i) for i in range(n))))
