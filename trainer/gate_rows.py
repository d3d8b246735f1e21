"""Gate rows (seed 001's second SFT source) from expert episode records; the format is `core.gate`'s.

Every observation of a worker trajectory is a decision point: the gate should say STOP when the
worker's next turn is its finish (the evidence is in hand) and CONTINUE otherwise. A CONTINUE point
whose observation already contains the gold answer's text is a *hard negative* (the answer is on
screen, but not yet supported the way the expert supports it: a snippet, not the opened page, or
an intermediate page of a longer chain); hard negatives are repeated, as seed 001's gate data
"already includes hard-negative repeats".

The messages are recovered from the trajectory's own token ids: decoded with special tokens kept,
the text is the rendered chat, split at ``<|im_start|>ROLE\\n ... <|im_end|>``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from core import protocol as p
from core.gate import CONTINUE, STOP, gate_messages

_BLOCK = re.compile(r"<\|im_start\|>(system|user|assistant|tool)\n(.*?)<\|im_end\|>", re.DOTALL)


def messages_from_tokens(
    token_ids: Sequence[int], decode: Callable[[list[int]], str]
) -> list[dict[str, str]]:
    """The chat messages a trajectory's tokens render (a turn cut before its <|im_end|> is dropped)."""
    text = decode(list(token_ids))
    return [{"role": m.group(1), "content": m.group(2)} for m in _BLOCK.finditer(text)]


def decision_points(messages: Sequence[dict[str, str]], gold_answer: str | None) -> Iterator[dict[str, Any]]:
    """One gate row per observation that an assistant turn follows."""
    for i in range(1, len(messages) - 1):
        obs, nxt = messages[i], messages[i + 1]
        if obs["role"] != "user" or nxt["role"] != "assistant" or messages[i - 1]["role"] != "assistant":
            continue
        finishes = any(c.name == "finish" for c in p.parse_calls(nxt["content"]))
        decision = STOP if finishes else CONTINUE
        hard = bool(
            decision == CONTINUE and gold_answer and gold_answer.strip().lower() in obs["content"].lower()
        )
        yield {
            "source": "gate",
            "supervise": "last",
            "label": decision.lower(),
            "hard_negative": hard,
            "messages": [*gate_messages(messages[: i + 1]), {"role": "assistant", "content": decision}],
        }


def gate_rows_from_records(
    path: Path, tokenizer: Any, *, only_correct: bool = True, hard_negative_repeat: int = 2
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Gate rows from every (correctly answered) worker trajectory in a records file, and counts."""
    from core.records import RecordError, load_lenient
    from trainer.data import read_records
    from trainer.grpo import rule_grades

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False)

    rows: list[dict[str, Any]] = []
    counts = dict.fromkeys(("records", "trajectories", "stop", "continue", "hard_negative", "rows"), 0)
    for _, raw in read_records(Path(path)):
        counts["records"] += 1
        try:
            record, _ = load_lenient(raw)
        except RecordError:
            continue
        if only_correct and rule_grades(record).reward < 1.0:
            continue
        for worker in record.workers:
            if worker.trajectory is None or not worker.trajectory.token_ids:
                continue
            counts["trajectories"] += 1
            messages = messages_from_tokens(worker.trajectory.token_ids, decode)
            for row in decision_points(messages, record.gold_answer):
                counts[row["label"]] += 1
                copies = hard_negative_repeat if row["hard_negative"] else 1
                counts["hard_negative"] += row["hard_negative"]
                rows.extend([row] * copies)
    counts["rows"] = len(rows)
    return rows, counts
