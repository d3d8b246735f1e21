"""SFT samples (DESIGN.md §9, seed 001): token ids plus an exact supervised-token mask, from two kinds
of source, and the token-balanced mixture seed 001 trains on.

Sources
- **Episode records** (the coordinator's SQLite record file, or JSONL of records): every worker
  trajectory already holds the exact token ids the worker saw and generated, and its loss mask (1 on
  generated tokens, the `<|im_end|>` that ended each turn included). By default only trajectories of
  episodes the rule grader judges correct are kept (`only_correct`), as one keeps expert
  demonstrations that worked.
- **Chat JSONL**: one row per line, ``{"messages": [{"role", "content"}, ...], "source": NAME?,
  "supervise": "assistant" | "last"?, "enable_thinking": false?}``. A row is rendered through the
  worker's own chat template (`core.chat_template.render_chat`, Qwen3 fixed keep-thinking,
  append-only) and tokenized with the model's tokenizer; the supervised tokens are exactly the tokens
  the worker would have generated for each assistant message (its reply and the `<|im_end|>` after
  it) — the same mask a record made by the worker holds. ``supervise: "last"`` trains on the last
  assistant message only (gate rows: the context is the episode so far, the target is the gate's
  decision). ``enable_thinking: false``
  renders generation prompts with thinking disabled (the seed-004 single-turn domains).

  The worker tokenizes each generation prompt and appends the generated ids, so a row is trained on
  correctly only if tokenizing every rendered prefix gives a prefix of the next one's tokens. A row
  where that fails (text that merges across a turn boundary) is refused with a one-line reason, never
  silently re-tokenized: its masks would not be the ones the worker produces.

Mixture (seed 001: "core trajectories repeated 3 times plus gate rows sampled until the supervised
tokens match, seed 42"): each source has a repeat factor, or is sampled to a supervised-token target
(another source's total, a fraction of it, or a number). Sampling draws rows without replacement
from a seeded shuffle, reshuffling when the pool runs out, and stops before the row that would pass
the target, so a sampled source's total is below its target by less than one row's tokens.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.chat_template import render_chat

IM_END = "<|im_end|>"
logger = logging.getLogger(__name__)
SUPERVISE_MODES = ("assistant", "last")
_ROLES = ("system", "user", "assistant", "tool")
# A chat row larger than this is refused (input size limit; the worker's budget is 24,576 tokens).
MAX_ROW_CHARS = 1_000_000


class SFTDataError(ValueError):
    """A source that cannot be read, or a mixture that cannot be built; the message says which and why."""


@dataclass(frozen=True)
class SFTSample:
    """One training row: aligned token ids and loss mask (1 = supervised), and where it came from."""

    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    source: str
    origin: str  # file:line, or the record's episode and worker ids

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def supervised_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def rollout_logprobs(self) -> tuple[float, ...]:
        # trainer.packing packs anything with aligned token_ids / loss_mask / rollout_logprobs.
        return (0.0,) * len(self.token_ids)


# --- chat rows -------------------------------------------------------------------------------------


def render_chat_row(
    messages: Sequence[Mapping[str, Any]],
    encode: Callable[[str], list[int]],
    eos_id: int,
    *,
    supervise: str = "assistant",
    enable_thinking: bool = True,
) -> tuple[list[int], list[int]]:
    """Token ids and the supervised mask of one conversation, as the worker would have produced it.

    `enable_thinking=False` renders each generation prompt as Qwen3 does with thinking disabled (an
    empty think block closes it), so a reply must then start with that block; only what follows it
    is supervised, as a model served with thinking disabled generates only that.

    Raises SFTDataError (one line) for a conversation that cannot be trained on exactly.
    """
    if supervise not in SUPERVISE_MODES:
        raise SFTDataError(f'"supervise" must be one of {", ".join(SUPERVISE_MODES)}, got {supervise!r}')
    if not messages:
        raise SFTDataError("no messages")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") not in _ROLES or not isinstance(m.get("content"), str):
            raise SFTDataError(f"message {i}: needs a role ({', '.join(_ROLES)}) and a string content")
    targets = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not targets:
        raise SFTDataError("no assistant message to supervise")
    if supervise == "last":
        targets = targets[-1:]
    ids: list[int] = []
    mask: list[int] = []
    for i in targets:
        prompt = encode(
            render_chat(messages[:i], add_generation_prompt=True, enable_thinking=enable_thinking)
        )
        if prompt[: len(ids)] != ids:
            raise SFTDataError(
                f"message {i}: the tokens of the conversation up to it are not an extension of the tokens "
                "before it (text merges across a turn boundary); the worker could not have produced it"
            )
        full = encode(render_chat(messages[: i + 1]))
        if full[: len(prompt)] != prompt:
            raise SFTDataError(
                f"message {i}: the reply's tokens merge with the generation prompt's; the worker could not "
                "have produced it"
            )
        reply = full[len(prompt) :]
        if eos_id not in reply:
            raise SFTDataError(f"message {i}: the rendered reply has no {IM_END}")
        generated = reply[: reply.index(eos_id) + 1]
        mask += [0] * (len(prompt) - len(ids)) + [1] * len(generated)
        ids = prompt + generated
    return ids, mask


def load_chat_jsonl(
    path: Path, tokenizer: Any, *, source: str | None = None
) -> tuple[list[SFTSample], list[str]]:
    """The rows of a chat JSONL file that can be trained on, and one line per refused row."""
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    if eos_id is None or eos_id == getattr(tokenizer, "unk_token_id", object()):
        raise SFTDataError(f"the tokenizer has no {IM_END} token; it is not a Qwen3-style chat tokenizer")

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    samples: list[SFTSample] = []
    refused: list[str] = []
    for number, line in _lines(path):
        where = f"{path}:{number}"
        if len(line) > MAX_ROW_CHARS:
            refused.append(f"{where}: row of {len(line):,} characters is over the {MAX_ROW_CHARS:,} limit")
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            refused.append(f"{where}: not JSON ({e.msg} at column {e.colno})")
            continue
        if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
            refused.append(f'{where}: expected an object with a "messages" list')
            continue
        thinking = row.get("enable_thinking", True)
        if not isinstance(thinking, bool):
            refused.append(f'{where}: "enable_thinking" must be true or false')
            continue
        try:
            ids, mask = render_chat_row(
                row["messages"],
                encode,
                eos_id,
                supervise=str(row.get("supervise", "assistant")),
                enable_thinking=thinking,
            )
        except SFTDataError as e:
            refused.append(f"{where}: {e}")
            continue
        name = source or str(row.get("source") or path.stem)
        samples.append(SFTSample(tuple(ids), tuple(mask), name, where))
    return samples, refused


def _lines(path: Path) -> list[tuple[int, str]]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SFTDataError(f"no such file: {path}") from None
    except UnicodeDecodeError:
        raise SFTDataError(f"{path}: not UTF-8 text") from None
    return [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]


# --- episode records -------------------------------------------------------------------------------


def load_record_samples(
    path: Path, *, source: str, only_correct: bool = True
) -> tuple[list[SFTSample], dict[str, int]]:
    """Worker trajectories of the episode records in `path` as SFT rows, and counts of what was kept.

    Counts: `records`, `trajectories`, `incorrect` (left out: the episode's answer was wrong),
    `rejected` (trajectories that break the record's invariants, logged by trainer.data), `samples`.
    """
    from core.records import RecordError, load_lenient
    from trainer.data import read_record, read_records
    from trainer.grpo import rule_grades

    counts = dict.fromkeys(("records", "trajectories", "incorrect", "rejected", "samples"), 0)
    samples: list[SFTSample] = []
    try:
        rows = list(read_records(Path(path)))
    except (FileNotFoundError, ValueError) as e:
        raise SFTDataError(str(e)) from None
    for origin, raw in rows:
        counts["records"] += 1
        try:
            record, _ = load_lenient(raw)
        except RecordError as e:
            counts["rejected"] += 1
            logger.warning("rejected record (%s): %s", origin, e)
            continue
        got = read_record(record, None, None, "keep")
        counts["trajectories"] += got.trajectories
        counts["rejected"] += len(got.errors)
        for error in got.errors:
            logger.warning("rejected trajectory (%s): %s", origin, error)
        if only_correct and rule_grades(record).reward < 1.0:
            counts["incorrect"] += len(got.samples)
            continue
        for s in got.samples:
            where = f"{origin}, worker {s.worker_episode_id}"
            samples.append(SFTSample(tuple(s.token_ids), tuple(s.loss_mask), source, where))
    counts["samples"] = len(samples)
    return samples, counts


def is_chat_jsonl(path: Path) -> bool:
    """True when the first row of a JSONL file is a chat row (has "messages"), not an episode record."""
    path = Path(path)
    with path.open("rb") as f:
        head = f.read(16)
    if head.startswith(b"SQLite format 3"):
        return False
    for _, line in _lines(path)[:1]:
        try:
            first = json.loads(line)
        except json.JSONDecodeError:
            return True  # read as chat rows, which refuse the line with its reason
        return isinstance(first, dict) and "messages" in first
    return True


# --- the mixture -----------------------------------------------------------------------------------

_SPEC = re.compile(r"^(?P<name>[A-Za-z0-9_.-]+)=(?P<path>[^:]+)(?P<opts>(:[a-z_]+=[^:]+)*)$")


@dataclass(frozen=True)
class SourceSpec:
    """One source of the mixture: `repeat` copies of every row, or rows sampled to a token target.

    `match`: sample until the supervised tokens reach `fraction` x another source's (after its
    repeats); `tokens`: sample until this many supervised tokens. At most one of repeat>1 / match /
    tokens.
    """

    name: str
    path: Path
    repeat: int = 1
    match: str | None = None
    fraction: float = 1.0
    tokens: int | None = None
    only_correct: bool = True

    @classmethod
    def parse(cls, text: str) -> SourceSpec:
        """``NAME=PATH[:repeat=N][:match=OTHER][:fraction=F][:tokens=N][:only_correct=false]``."""
        m = _SPEC.match(text.strip())
        if not m:
            raise SFTDataError(
                f"--source {text!r}: expected NAME=PATH[:repeat=N][:match=SOURCE][:fraction=F][:tokens=N]"
            )
        opts: dict[str, Any] = {}
        for part in filter(None, m.group("opts").split(":")):
            key, value = part.split("=", 1)
            if key not in ("repeat", "tokens", "fraction", "match", "only_correct"):
                raise SFTDataError(
                    f"--source {text!r}: unknown option {key!r} "
                    "(repeat, match, fraction, tokens, only_correct)"
                )
            try:
                if key in ("repeat", "tokens"):
                    opts[key] = int(value)
                elif key == "fraction":
                    opts[key] = float(value)
                elif key == "match":
                    opts[key] = value
                else:
                    opts[key] = value.lower() in ("1", "true", "yes")
            except ValueError:
                raise SFTDataError(f"--source {text!r}: {key}={value!r} is not a number") from None
        spec = cls(m.group("name"), Path(m.group("path")), **opts)
        if spec.repeat < 1 or (spec.tokens is not None and spec.tokens < 1) or not spec.fraction > 0:
            raise SFTDataError(f"--source {text!r}: repeat and tokens must be at least 1, fraction above 0")
        if sum((spec.repeat > 1, spec.match is not None, spec.tokens is not None)) > 1:
            raise SFTDataError(f"--source {text!r}: give one of repeat, match or tokens")
        return spec


@dataclass(frozen=True)
class Mixture:
    """The constructed mixture: shuffled rows, and per source what went in (the card's numbers)."""

    rows: tuple[SFTSample, ...]
    table: tuple[dict[str, Any], ...]  # name, source_rows, rows, supervised_tokens, how
    seed: int

    def digest(self) -> str:
        """A fingerprint of the rows in order (a resumed run checks it rebuilt the same mixture)."""
        h = hashlib.sha256()
        for row in self.rows:
            h.update(f"{row.origin}|{len(row)}|{row.supervised_tokens};".encode())
        return h.hexdigest()[:16]


def _sample_to(pool: Sequence[SFTSample], target: int, rng: random.Random) -> list[SFTSample]:
    chosen: list[SFTSample] = []
    total = 0
    while True:
        order = list(pool)
        rng.shuffle(order)
        for row in order:
            if total + row.supervised_tokens > target:
                return chosen
            chosen.append(row)
            total += row.supervised_tokens


def build_mixture(
    pools: Mapping[str, Sequence[SFTSample]], specs: Sequence[SourceSpec], *, seed: int = 42
) -> Mixture:
    """Repeat or sample every source as its spec says, then shuffle everything with `seed`."""
    rng = random.Random(seed)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise SFTDataError(f"source names repeat: {', '.join(names)}")
    built: dict[str, list[SFTSample]] = {}
    how: dict[str, str] = {}
    for spec in sorted(specs, key=lambda s: s.match is not None):  # matched sources after the rest
        pool = list(pools[spec.name])
        if not pool:
            raise SFTDataError(f"source {spec.name} ({spec.path}) has no rows to train on")
        if spec.match is not None:
            if spec.match not in built:
                raise SFTDataError(
                    f"source {spec.name}: match={spec.match} names no source that is repeated or sized "
                    f"by tokens (sources: {', '.join(names)})"
                )
            target = int(spec.fraction * sum(r.supervised_tokens for r in built[spec.match]))
            built[spec.name] = _sample_to(pool, target, rng)
            how[spec.name] = f"sampled to {spec.fraction:g} x {spec.match}'s supervised tokens"
        elif spec.tokens is not None:
            built[spec.name] = _sample_to(pool, spec.tokens, rng)
            how[spec.name] = f"sampled to {spec.tokens:,} supervised tokens"
        else:
            built[spec.name] = pool * spec.repeat
            how[spec.name] = f"x{spec.repeat}"
    rows = [row for spec in specs for row in built[spec.name]]
    rng.shuffle(rows)
    table = tuple(
        {
            "name": spec.name,
            "source_rows": len(pools[spec.name]),
            "rows": len(built[spec.name]),
            "supervised_tokens": sum(r.supervised_tokens for r in built[spec.name]),
            "tokens": sum(len(r) for r in built[spec.name]),
            "how": how[spec.name],
        }
        for spec in specs
    )
    return Mixture(tuple(rows), table, seed)
