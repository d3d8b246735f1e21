"""The episode viewer's view-models: what a person reads of the gateway's episode records.

    view = episode_view(record, decoder)   # one EpisodeRecord, ready to render

(The list page's view-model is `services.coordinator.episode_list`.)

The gateway's `/ui` pages (`services.coordinator.ui`, Jinja templates) and `bcstack episodes show`
(Rich) render these same objects; neither looks into the record itself.

A worker trajectory stores token ids, not text: its turns are read back by decoding spans of
`token_ids` with the worker model's tokenizer (`TokenDecoder`). A turn's text is
`token_ids[gen_start:gen_end]`; what the model saw before it (the task, then each tool result as a
ChatML user message) is `token_ids[prompt_start:gen_start]`, so the observation a turn's tool calls
produced is the prompt part of the next turn. Without a tokenizer every view still holds the
structure, counts, tool calls and limits, and says why the text is missing.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from core import budget
from core.records import EpisodeRecord, WorkerRecord, WorkerTrajectory

# A text longer than this (characters or lines) is folded behind its first line.
FOLD_CHARS = 800
FOLD_LINES = 12
# Token ids shown for a span when there is no tokenizer to decode it.
IDS_PREVIEW = 48
SIGNATURE_VALUE_CHARS = 80

_CHAT_MESSAGE = re.compile(r"<\|im_start\|>(\w+)\n(.*?)(?=<\|im_end\|>|<\|im_start\|>|\Z)", re.S)
_END_MARKERS = ("<|im_end|>", "<|endoftext|>")


class DecoderError(ValueError):
    """The configured tokenizer cannot be loaded; the message is one line naming the path."""


class TokenDecoder:
    """Token ids -> text with a `tokenizers` tokenizer (`tokenizer.json`), special tokens kept:
    the chat markers are how a turn's prompt part is split into messages."""

    def __init__(self, tokenizer: Any, source: str) -> None:
        self._tokenizer = tokenizer
        self.source = source
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def load(cls, path: Path) -> TokenDecoder:
        """From a model folder holding `tokenizer.json`, or that file itself."""
        from tokenizers import Tokenizer

        file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
        if not file.is_file():
            raise DecoderError(f"tokenizer {path}: no tokenizer.json there (give the worker model's folder)")
        try:
            return cls(Tokenizer.from_file(str(file)), str(file))
        except Exception as exc:  # tokenizers raises plain Exception subclasses with long messages
            reason = " ".join(str(exc).split())[:200]
            raise DecoderError(f"tokenizer {file} cannot be loaded: {reason}") from None

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)


# --- small pieces ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelText:
    """A model's turn split at its `<think>` block (thinking None: there was none)."""

    thinking: str | None
    text: str


def split_thinking(raw: str) -> ModelText:
    """`<think>…</think>` apart from the rest; an unclosed `<think>` (a cut-off turn) is all thinking,
    a lone `</think>` (the template opened the block in the prompt) closes what came before."""
    text = raw
    for marker in _END_MARKERS:
        text = text.replace(marker, "")
    start, end = text.find("<think>"), text.find("</think>")
    if start == -1 and end == -1:
        return ModelText(None, text.strip())
    if start != -1 and (end == -1 or end < start):
        return ModelText(text[start + len("<think>") :].strip(), text[:start].strip())
    head = text[:start] if start != -1 else ""
    inner = text[start + len("<think>") : end] if start != -1 else text[:end]
    return ModelText(inner.strip(), (head + text[end + len("</think>") :]).strip())


def chat_messages(text: str) -> list[tuple[str, str]]:
    """ChatML `<|im_start|>role\\n…<|im_end|>` messages of a decoded span, in order; a span without
    chat markers (another template) is one message with no role."""
    found = [(role, content.strip("\n")) for role, content in _CHAT_MESSAGE.findall(text)]
    if not found:
        bare = text
        for marker in _END_MARKERS:
            bare = bare.replace(marker, "")
        return [("", bare.strip())] if bare.strip() else []
    return found


@dataclass(frozen=True)
class Folded:
    """A text to show whole, or behind `summary` when it is long."""

    text: str

    @property
    def folded(self) -> bool:
        return len(self.text) > FOLD_CHARS or self.text.count("\n") >= FOLD_LINES

    @property
    def summary(self) -> str:
        first = next((line for line in self.text.splitlines() if line.strip()), "")
        first = first if len(first) <= 120 else first[:117] + "..."
        return f"{first} ({len(self.text):,} characters, {self.text.count(chr(10)) + 1:,} lines)"


@dataclass(frozen=True)
class Bar:
    """`used` against a limit, for a bar: tokens against the budget, turns against the turn limit."""

    label: str
    used: int
    limit: int

    @property
    def percent(self) -> float:
        return 0.0 if self.limit <= 0 else min(100.0, 100.0 * self.used / self.limit)

    @property
    def over(self) -> bool:
        return self.limit > 0 and self.used >= self.limit


def when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if ts > 0 else ""


def verdict_label(correct: bool | None, graded: bool) -> str:
    if not graded:
        return "not graded"
    return "ungraded" if correct is None else ("correct" if correct else "incorrect")


# --- one episode ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCallView:
    name: str
    params: dict[str, str]
    outcome: str
    error: str
    docids: list[str]

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    @property
    def signature(self) -> str:
        """`search(query='…', topk='5')`, each value cut to SIGNATURE_VALUE_CHARS."""
        short = {k: v if len(v) <= SIGNATURE_VALUE_CHARS else v[: SIGNATURE_VALUE_CHARS - 1] + "…"
                 for k, v in self.params.items()}  # fmt: skip
        return f"{self.name}({', '.join(f'{k}={v!r}' for k, v in short.items())})"


@dataclass(frozen=True)
class WorkerTurnView:
    index: int
    weight_version: str
    finish_reason: str
    generated_tokens: int
    observation_tokens: int
    model: ModelText | None  # None: no tokenizer
    tool_calls: list[ToolCallView]
    observation: Folded | None  # what the tool calls brought back; None: nothing followed the turn


@dataclass(frozen=True)
class MaskSegment:
    """A run of tokens with the same loss mask: `trained` ones are what the trainer learns from."""

    trained: bool
    start: int
    tokens: int
    text: str

    @property
    def folded(self) -> bool:
        return not self.trained and Folded(self.text).folded


@dataclass(frozen=True)
class BranchView:
    branch: int
    turn: int
    description: str
    prompt: Folded
    episode_id: str
    status: str
    replica: str | None
    attempts: int
    error: str
    started_offset: float | None  # seconds after the episode started
    seconds: float
    report: dict[str, str]
    contribution: float | None
    stop_reason: str | None
    tokens: Bar
    turns_bar: Bar
    budget_overridden: bool
    weight_versions: list[str]
    events: list[str]
    task: list[tuple[str, Folded]]  # the worker's first prompt as messages (system, user)
    turns: list[WorkerTurnView]
    mask: list[MaskSegment]
    trained_tokens: int
    total_tokens: int


@dataclass(frozen=True)
class CoordinatorTurnView:
    index: int
    model: ModelText
    calls: list[str]
    errors: list[str]
    seconds: float
    workers_seconds: float
    total_seconds: float
    prompt_tokens: int
    completion_tokens: int
    attempts: int
    reply: Folded | None  # the user message that followed: worker reports, as the coordinator read them
    branches: list[BranchView]


@dataclass(frozen=True)
class VerdictView:
    label: str  # correct | incorrect | ungraded
    extracted_final_answer: str
    grader_version: str
    parse_error: bool


@dataclass(frozen=True)
class EpisodeView:
    episode_id: str
    question_id: str | None
    group_id: str | None
    question: str
    gold_answer: str | None
    status: str
    error: str
    answer: str
    explanation: str
    confidence: str
    endpoint: str
    endpoint_model: str
    created: str
    finished: str
    seconds: float
    weight_versions: list[str]
    verdict: VerdictView | None
    system_prompt: Folded | None
    turns: list[CoordinatorTurnView]
    unplaced_branches: list[BranchView]  # branches whose turn has no coordinator turn (a damaged record)
    coordinator_turns: Bar
    branches: Bar
    worker_tokens: int
    decoder_note: str | None  # why worker text is missing or suspect; None: decoded as recorded
    decoded: bool = False

    @property
    def all_branches(self) -> list[BranchView]:
        return [b for t in self.turns for b in t.branches] + self.unplaced_branches


def _decode(decoder: TokenDecoder | None, ids: Sequence[int]) -> str:
    if decoder is not None:
        return decoder.decode(ids)
    shown = " ".join(str(i) for i in ids[:IDS_PREVIEW])
    return shown + (f" … ({len(ids):,} token ids)" if len(ids) > IDS_PREVIEW else "")


def _observation(decoder: TokenDecoder | None, ids: Sequence[int]) -> Folded | None:
    if not ids:
        return None
    if decoder is None:
        return Folded(_decode(None, ids))
    # The prompt part after a turn is "<|im_end|>\n<|im_start|>user\n{tool results}<|im_end|>\n
    # <|im_start|>assistant\n": the tool results are its non-assistant messages.
    parts = [content for role, content in chat_messages(decoder.decode(ids)) if role != "assistant"]
    return Folded("\n\n".join(p for p in parts if p))


def mask_segments(t: WorkerTrajectory, decoder: TokenDecoder | None) -> list[MaskSegment]:
    segments: list[MaskSegment] = []
    start = 0
    for i in range(1, len(t.loss_mask) + 1):
        if i == len(t.loss_mask) or t.loss_mask[i] != t.loss_mask[start]:
            ids = t.token_ids[start:i]
            segments.append(MaskSegment(bool(t.loss_mask[start]), start, i - start, _decode(decoder, ids)))
            start = i
    return segments


def branch_view(w: WorkerRecord, record: EpisodeRecord, decoder: TokenDecoder | None) -> BranchView:
    max_tokens = record.worker_budget.get("max_tokens", budget.MAX_TOKENS)
    max_turns = record.worker_budget.get("max_turns", budget.MAX_TURNS)
    t = w.trajectory
    turns: list[WorkerTurnView] = []
    task: list[tuple[str, Folded]] = []
    if t is not None:
        if t.turns:
            first = _decode(decoder, t.token_ids[: t.turns[0].gen_start])
            messages = chat_messages(first) if decoder is not None else [("", first)]
            task = [(role, Folded(text)) for role, text in messages if role != "assistant" and text]
        for k, span in enumerate(t.turns):
            after_end = t.turns[k + 1].gen_start if k + 1 < len(t.turns) else len(t.token_ids)
            after = t.token_ids[span.gen_end : after_end]
            generated = t.token_ids[span.gen_start : span.gen_end]
            turns.append(
                WorkerTurnView(
                    index=k,
                    weight_version=span.weight_version,
                    finish_reason=span.finish_reason,
                    generated_tokens=span.generated_tokens,
                    observation_tokens=len(after),
                    model=split_thinking(decoder.decode(generated)) if decoder is not None else None,
                    tool_calls=[
                        ToolCallView(c.name, dict(c.params), c.outcome, c.error, list(c.docids))
                        for c in t.tool_calls
                        if c.turn == k
                    ],
                    observation=_observation(decoder, after),
                )
            )
    used = t.tokens_used if t is not None else w.usage.total_tokens
    turns_used = t.turns_used if t is not None else w.usage.turns
    return BranchView(
        branch=w.branch,
        turn=w.turn,
        description=w.description,
        prompt=Folded(w.prompt),
        episode_id=w.episode_id,
        status=w.status,
        replica=w.replica,
        attempts=w.attempts,
        error=w.error or (t.error if t is not None else ""),
        started_offset=(w.started_at - record.created_at) if w.started_at and record.created_at else None,
        seconds=w.seconds,
        report=w.report.model_dump(),
        contribution=w.contribution,
        stop_reason=t.stop_reason if t is not None else None,
        tokens=Bar("tokens", used, max_tokens),
        turns_bar=Bar("turns", turns_used, max_turns),
        budget_overridden=bool({"max_tokens", "max_turns"} & record.worker_budget.keys()),
        weight_versions=list(t.weight_versions) if t is not None else [],
        events=list(t.events) if t is not None else [],
        task=task,
        turns=turns,
        mask=mask_segments(t, decoder) if t is not None else [],
        trained_tokens=sum(t.loss_mask) if t is not None else 0,
        total_tokens=len(t.token_ids) if t is not None else 0,
    )


def _decoder_note(record: EpisodeRecord, decoder: TokenDecoder | None) -> str | None:
    has_tokens = any(w.trajectory and w.trajectory.token_ids for w in record.workers)
    if not has_tokens:
        return None
    if decoder is None:
        return (
            "worker text is not shown: no tokenizer is configured to decode the trajectories' token ids "
            "(set the worker model's tokenizer folder: BCSTACK_COORDINATOR_TOKENIZER, or --tokenizer)"
        )
    highest = max(
        max(w.trajectory.token_ids) for w in record.workers if w.trajectory and w.trajectory.token_ids
    )
    if highest >= decoder.vocab_size:
        return (
            f"token id {highest} is beyond this tokenizer's vocabulary ({decoder.vocab_size:,} tokens, "
            f"{decoder.source}): it is not the worker model's tokenizer, and the text below is wrong"
        )
    return None


def episode_view(record: EpisodeRecord, decoder: TokenDecoder | None = None) -> EpisodeView:
    """Everything the episode page shows, in reading order."""
    messages = record.coordinator.messages
    system = next((m for m in messages if m.get("role") == "system"), None)
    assistant_at = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    branches = {w.branch: branch_view(w, record, decoder) for w in record.workers}
    placed: set[int] = set()
    turns: list[CoordinatorTurnView] = []
    for position, turn in enumerate(record.coordinator.turns):
        content, reply = "", None
        if position < len(assistant_at):
            at = assistant_at[position]
            content = str(messages[at].get("content") or "")
            following = messages[at + 1] if at + 1 < len(messages) else None
            if following is not None and following.get("role") != "assistant":
                reply = Folded(str(following.get("content") or ""))
        mine = [b for b in branches.values() if b.turn == turn.turn]
        placed.update(b.branch for b in mine)
        turns.append(
            CoordinatorTurnView(
                index=turn.turn,
                model=split_thinking(content),
                calls=list(turn.calls),
                errors=list(turn.errors),
                seconds=turn.seconds,
                workers_seconds=turn.workers_seconds,
                total_seconds=turn.total_seconds,
                prompt_tokens=turn.prompt_tokens,
                completion_tokens=turn.completion_tokens,
                attempts=turn.attempts,
                reply=reply,
                branches=mine,
            )
        )
    grades = record.grades
    return EpisodeView(
        episode_id=record.episode_id,
        question_id=record.question_id,
        group_id=record.group_id,
        question=record.question,
        gold_answer=record.gold_answer,
        status=record.status,
        error=record.error,
        answer=record.answer,
        explanation=record.explanation,
        confidence=record.confidence,
        endpoint=record.endpoint,
        endpoint_model=record.endpoint_detail.model,
        created=when(record.created_at),
        finished=when(record.finished_at),
        seconds=record.seconds,
        weight_versions=list(record.weight_versions),
        verdict=None
        if grades is None
        else VerdictView(
            label=verdict_label(grades.correct, True),
            extracted_final_answer=grades.extracted_final_answer,
            grader_version=grades.grader_version,
            parse_error=grades.parse_error,
        ),
        system_prompt=Folded(str(system.get("content") or "")) if system is not None else None,
        turns=turns,
        unplaced_branches=[b for n, b in branches.items() if n not in placed],
        coordinator_turns=Bar("coordinator turns", len(record.coordinator.turns), record.limits.max_turns),
        branches=Bar("branches", len(record.workers), record.limits.max_branches),
        worker_tokens=record.worker_usage.total_tokens,
        decoder_note=_decoder_note(record, decoder),
        decoded=decoder is not None,
    )
