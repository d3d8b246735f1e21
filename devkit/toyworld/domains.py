"""Toy single-turn domains for the seed-004 specialists: problems with unique numeric answers.

Seed 004 trains domain specialists by single-turn RL on DAPO-Math-17k rows (a prompt and a numeric
`label`) and evaluates them by pass@1. A tiny model on a CPU cannot learn competition maths, so the
embedded default is two toy domains it can learn something of in minutes, written in the same row
format, so the same verifier, trainer and evaluation run on them and on the real data:

* ``arithmetic``: multi-step word problems ("Mia has 7 shells. She finds 5 more shells and then
  gives away 3 shells. How many shells does Mia have now?"), 1 or 2 single-digit steps, answers 0..20;
* ``sequence``: the next term of an arithmetic progression ("What number comes next in the
  sequence 3, 5, 7, 9?"), answers 0..52.

Two domains, because multi-teacher on-policy distillation needs a teacher per domain.

Preparation follows the seed's: duplicate problems are removed, a deterministic 64-prompt
development split and a test split are taken out, and the remaining rows are the training prompts;
`manifest.json` records every count and each file's SHA-256. The same seed gives byte-identical files
(one seeded RNG, no set iteration).

A duplicate is a problem with the same **numeric signature**, not the same text: the numbers and
operations that decide the answer — for ``arithmetic`` the start value and each step's operation and
operand (``"7+5-3"``; "Mia has 7 shells" and "Omar has 7 keys" with the same steps are one problem),
for ``sequence`` the shown terms (``"3,5,7,9"``, which fix the step). So "held out" means held out
by content: no signature is in two splits (audited again on the finished rows' ``signature`` field
before anything is written). The signature spaces are small and counted exactly
(`distinct_problems`): arithmetic has 1,944 (start 2..9, one or two steps of 1..9 up or down within
0..20), sequence 2,583 (21 steps x 3 lengths x 41 starts); asking for more train + 64 dev + test
problems than that is a DomainError.

Files: ``train.jsonl``, ``dev.jsonl``, ``test.jsonl`` with rows ``{"id", "domain", "prompt",
"label", "signature"}`` (DAPO-Math-17k's `prompt` + `label`, as slime's copy of it has them: the
prompt asks for an ``Answer:`` last line; prompt readers ignore the extra fields); ``sft.jsonl`` with
one chat row per training prompt whose reply works the problem out step by step (``{"messages",
"enable_thinking": false, "source"}``, for `bcstack train sft`), which is how the tests make a base
model that knows the answer format; ``corpus.jsonl`` holds the training prompts with their replies as
BrowseComp-Plus documents, for `bcstack model tiny --corpus` to train a tokenizer that knows the
domain's words.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

DOMAINS_VERSION = "2"  # 2: duplicates by numeric signature, not text; rows carry it
DEV_PROMPTS = 64  # seed 004: "a deterministic 64-prompt development split"
# DAPO-Math-17k's instruction around each problem (the prepared rows slime trains on).
PROMPT_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the "
    "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
PROMPT_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'

MAX_TOTAL = 20
_SEQUENCE_STEPS = tuple(d for d in range(-9, 13) if d)
_SEQUENCE_LENGTHS = (3, 4, 5)
_SEQUENCE_START_SPAN = 40  # starts in [low, low + 40]: 41 of them for every step and length
_NAMES = ("Mia", "Noah", "Ava", "Liam", "Zoe", "Omar", "Ivy", "Eli", "Ruth", "Sam", "Tara", "Ben")
_SHE = frozenset({"Mia", "Ava", "Zoe", "Ivy", "Ruth", "Tara"})
_THINGS = ("shells", "apples", "coins", "stamps", "marbles", "books", "pens", "cards", "stones", "keys")


class DomainError(ValueError):
    """A domain cannot be written as asked (one line, for the CLI)."""


@dataclass(frozen=True)
class Problem:
    question: str
    answer: int
    solution: str  # the worked reply, ending in the "Answer: N" line
    signature: str  # the numbers and operations ("7+5-3", "3,5,7,9"): the deduplication key


def _arithmetic(rng: random.Random) -> Problem:
    name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
    value = rng.randint(2, 9)
    text = [f"{name} has {value} {thing}."]
    signature = str(value)
    work: list[str] = []
    pronoun = "she" if name in _SHE else "he"
    for i in range(rng.randint(1, 2)):
        # Single-digit steps and totals up to 20: addition and subtraction facts a tiny model can learn.
        n = rng.randint(1, 9)
        if value + n > MAX_TOTAL or (value > n and rng.random() < 0.45):
            n = rng.randint(1, value)
            phrase = f"gives away {n} {thing}"
            work.append(f"{value} - {n} = {value - n}.")
            signature += f"-{n}"
            value -= n
        else:
            phrase = f"finds {n} more {thing}"
            work.append(f"{value} + {n} = {value + n}.")
            signature += f"+{n}"
            value += n
        text.append(f"Then {pronoun} {phrase}." if i else f"{pronoun.capitalize()} {phrase}.")
    text.append(f"How many {thing} does {name} have now?")
    return Problem(" ".join(text), value, " ".join(work) + f"\nAnswer: {value}", signature)


def _arithmetic_steps(value: int) -> list[str]:
    """Every step `_arithmetic` can take from `value`: +n while the total stays within MAX_TOTAL;
    -1..-value when it can subtract at all (value > some n, or value + 9 over MAX_TOTAL)."""
    steps = [f"+{n}" for n in range(1, 10) if value + n <= MAX_TOTAL]
    if value >= 2 or value + 9 > MAX_TOTAL:
        steps += [f"-{n}" for n in range(1, value + 1)]
    return steps


def _arithmetic_signatures() -> set[str]:
    found = set()
    for start in range(2, 10):
        for first in _arithmetic_steps(start):
            found.add(f"{start}{first}")
            after = start + int(first)
            found.update(f"{start}{first}{second}" for second in _arithmetic_steps(after))
    return found


def _sequence(rng: random.Random) -> Problem:
    step = rng.choice(_SEQUENCE_STEPS)
    length = rng.randint(_SEQUENCE_LENGTHS[0], _SEQUENCE_LENGTHS[-1])
    low = _sequence_low(step, length)
    start = rng.randint(low, low + _SEQUENCE_START_SPAN)
    terms = [start + step * i for i in range(length)]
    answer = terms[-1] + step
    shown = ", ".join(str(t) for t in terms)
    sign = "+" if step > 0 else "-"
    solution = f"The difference is {step}. {terms[-1]} {sign} {abs(step)} = {answer}.\nAnswer: {answer}"
    signature = ",".join(str(t) for t in terms)
    return Problem(f"What number comes next in the sequence {shown}?", answer, solution, signature)


def _sequence_low(step: int, length: int) -> int:
    # Decreasing progressions start high enough that the answer stays at 0 or above.
    return -step * length if step < 0 else 0


def _sequence_signatures() -> set[str]:
    return {
        ",".join(str(start + step * i) for i in range(length))
        for step in _SEQUENCE_STEPS
        for length in _SEQUENCE_LENGTHS
        for start in range(
            _sequence_low(step, length), _sequence_low(step, length) + _SEQUENCE_START_SPAN + 1
        )
    }


GENERATORS: dict[str, Callable[[random.Random], Problem]] = {"arithmetic": _arithmetic, "sequence": _sequence}
_SIGNATURES: dict[str, Callable[[], set[str]]] = {
    "arithmetic": _arithmetic_signatures,
    "sequence": _sequence_signatures,
}


@cache
def all_signatures(domain: str) -> frozenset[str]:
    """Every numeric signature the domain's generator can produce (enumerated, not sampled)."""
    return frozenset(_SIGNATURES[domain]())


def distinct_problems(domain: str) -> int:
    """How many distinct problems (numeric signatures) the domain has: the most one build can hold."""
    return len(all_signatures(domain))


def prompt_of(question: str) -> str:
    return PROMPT_PREFIX + question + PROMPT_SUFFIX


def _row(domain: str, index: int, problem: Problem) -> dict:
    return {
        "id": f"{domain}-{index:05d}",
        "domain": domain,
        "prompt": prompt_of(problem.question),
        "label": str(problem.answer),
        "signature": problem.signature,
    }


def build_domain(domain: str, *, train: int, test: int, seed: int = 0) -> dict[str, list]:
    """The splits of one domain: {"train", "dev", "test"} rows and "sft" chat rows."""
    if domain not in GENERATORS:
        raise DomainError(f"unknown domain {domain!r}; choose one of {', '.join(GENERATORS)}")
    want = train + DEV_PROMPTS + test
    have = distinct_problems(domain)
    if want > have:
        raise DomainError(
            f"the {domain} domain has {have:,} distinct problems (numeric signatures) and "
            f"{train:,} train + {DEV_PROMPTS} dev + {test:,} test = {want:,} were asked for; "
            f"ask for at most {have - DEV_PROMPTS:,} train + test"
        )
    # The seed mixes in the domain name so two domains with one seed are independent streams.
    rng = random.Random(f"{domain}:{seed}")
    make = GENERATORS[domain]
    problems: list[Problem] = []
    seen: set[str] = set()
    draws = duplicates = 0
    # Terminates: every signature has a non-negligible chance (all 1,944 arithmetic ones turn up in
    # about 50,000 draws, well under a second), and `want` is at most how many there are.
    while len(problems) < want:
        draws += 1
        problem = make(rng)
        if problem.signature in seen:
            duplicates += 1
            continue
        seen.add(problem.signature)
        problems.append(problem)
    dev, held, rest = (
        problems[:DEV_PROMPTS],
        problems[DEV_PROMPTS : DEV_PROMPTS + test],
        problems[DEV_PROMPTS + test :],
    )
    rows = {
        "dev": [_row(domain, i, p) for i, p in enumerate(dev)],
        "test": [_row(domain, DEV_PROMPTS + i, p) for i, p in enumerate(held)],
        "train": [_row(domain, DEV_PROMPTS + test + i, p) for i, p in enumerate(rest)],
    }
    rows["sft"] = [
        {
            "messages": [
                {"role": "user", "content": prompt_of(p.question)},
                {"role": "assistant", "content": "<think>\n\n</think>\n\n" + p.solution},
            ],
            "enable_thinking": False,
            "source": domain,
        }
        for p in rest
    ]
    # A corpus in the BrowseComp-Plus format, for `bcstack model tiny --corpus` to train a tokenizer on.
    rows["corpus"] = [
        {
            "docid": f"{domain}-{i:05d}",
            "text": prompt_of(p.question) + "\n" + p.solution,
            "url": f"toy://{domain}/{i}",
        }
        for i, p in enumerate(rest)
    ]
    rows["_stats"] = [{"generated": draws, "duplicates_removed": duplicates}]
    return rows


def _overlaps(rows: dict[str, list]) -> list[str]:
    """Signatures in two splits, or repeated within one: the audit of the finished rows, before writing."""
    found = []
    keys = {}
    for split in ("train", "dev", "test"):
        keys[split] = {r["signature"] for r in rows[split]}
        if len(keys[split]) < len(rows[split]):
            found.append(f"{len(rows[split]) - len(keys[split])} repeated signatures in {split}")
    for a, b in (("train", "dev"), ("train", "test"), ("dev", "test")):
        shared = keys[a] & keys[b]
        if shared:
            found.append(f"{len(shared)} signatures in both {a} and {b} (e.g. {min(shared)})")
    return found


def write_domain(
    out: Path, domain: str, *, train: int, test: int, seed: int = 0, force: bool = False
) -> dict:
    """Write the domain's files into `out` (new or empty unless `force`) and return the manifest."""
    if out.exists() and any(out.iterdir()) and not force:
        raise DomainError(f"{out} is not empty; pass --force to overwrite")
    rows = build_domain(domain, train=train, test=test, seed=seed)
    problems = _overlaps(rows)
    if problems:  # cannot happen by construction; the audit is what the seed's preparation promises
        raise DomainError(f"split audit failed: {'; '.join(problems)}")
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    for split in ("train", "dev", "test", "sft", "corpus"):
        path = out / f"{split}.jsonl"
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows[split]).encode()
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        files[path.name] = {"rows": len(rows[split]), "sha256": hashlib.sha256(data).hexdigest()}
    stats = rows["_stats"][0]
    manifest = {
        "domain": domain,
        "version": DOMAINS_VERSION,
        "seed": seed,
        "format": "DAPO-Math-17k rows: prompt + numeric label (Answer: last line)",
        "generated": stats["generated"],
        "duplicates_removed": stats["duplicates_removed"],
        "distinct_problems": distinct_problems(domain),
        "deduplication": "numeric signature (arithmetic: start and steps; sequence: the shown terms)",
        "splits": {"train": len(rows["train"]), "dev": len(rows["dev"]), "test": len(rows["test"])},
        "audit": "no numeric signature in two splits",
        "files": files,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


UNREQUESTED_FORMAT = "The answer is {answer}."


def write_mixed_format_sft(sources: list[Path], out: Path, share: float, seed: int = 0) -> int:
    """Concatenate sft.jsonl files, `share` of the replies ending "The answer is N." instead of the
    requested "Answer: N" line (which is the only one the verifier reads): the SFT rows of a base that
    half-follows a requested answer format, as bench/specialists.py and the tests make their base.
    Returns the number of rewritten replies.
    """
    if not 0 <= share <= 1:
        raise DomainError(f"the share of replies in the unrequested format must be in [0, 1], got {share}")
    rng = random.Random(seed)
    rewritten = 0
    with out.open("w", encoding="utf-8") as f:
        for path in sources:
            for line in path.read_text(encoding="utf-8").splitlines():
                row = json.loads(line)
                if rng.random() < share:
                    work, answer = row["messages"][1]["content"].rsplit("\nAnswer: ", 1)
                    row["messages"][1]["content"] = f"{work}\n" + UNREQUESTED_FORMAT.format(answer=answer)
                    rewritten += 1
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return rewritten
