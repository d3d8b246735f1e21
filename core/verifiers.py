"""Verifier rewards for single-turn domains (seed 004): maths against numeric labels, code against
tests in a sandboxed subprocess, instruction-following checks. Pure Python, no model.

One small interface, one class per domain (STYLE.md: the vLLM router's pattern)::

    verifier = verifier_for("math")
    verifier.score(response_text, label) -> Verdict(correct: bool, extracted: str | None, reason: str)

Maths (`MathVerifier`). DAPO-Math-17k's prompts ask for a last line ``Answer: $Answer``; many models
write ``\\boxed{…}`` instead. Extraction takes the last ``Answer:`` line, else the last ``\\boxed{…}``
(braces balanced), else nothing: a response with no final answer is wrong, never guessed from its
last number. Equivalence is numeric and exact: integers, decimals, fractions (``a/b``,
``\\frac{a}{b}``), thousands separators, a leading ``$`` or trailing ``.``/``%`` are normalised and
compared as `fractions.Fraction`, so ``0.5``, ``1/2`` and ``\\frac12`` all equal a label ``"1/2"``;
labels that are not numbers are compared as normalised strings. (The same rules as DAPO's
``math_dapo`` reward in spirit — last "Answer:" match, normalised string — made numeric.)

Code (`CodeVerifier`). The label is a JSON list of ``{"input", "output"}`` tests (DeepCoder's
stdin/stdout form). The response's last fenced Python block runs once per test in a fresh
``python -I`` subprocess: its own session and an empty environment, stdin from the test, a wall-clock
limit, and `resource` limits on CPU seconds, address space and output size, the seed's "4-second
wall, 3-second CPU, 1-GiB memory" by default. Correct when every test's stdout matches (trailing
whitespace per line ignored). This is process isolation, not a security boundary: run untrusted code
in a container with no network, as the chart's trainer pod is.

Instruction following (`InstructionVerifier`). The label is a JSON list of checks in IFEval's
spirit (``{"kind": "lowercase"}``, ``{"kind": "max_words", "n": 50}``, ``{"kind": "include",
"word": "…"}``, ``{"kind": "exclude", "word": "…"}``, ``{"kind": "no_commas"}``, ``{"kind":
"ends_with", "text": "…"}``); strict accuracy: every check must pass. New kinds are one function each.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Protocol

MAX_RESPONSE_CHARS = 1_000_000  # input size limit: a longer response is scored wrong, not parsed


@dataclass(frozen=True)
class Verdict:
    correct: bool
    extracted: str | None  # the final answer (or code) the verifier found, None when none
    reason: str  # one line: why it is right or wrong


class Verifier(Protocol):
    name: str

    def score(self, response: str, label: str) -> Verdict: ...


class VerifierError(ValueError):
    """A label the verifier cannot use (one line)."""


# --- maths -------------------------------------------------------------------------------------------

_ANSWER_LINE = re.compile(r"answer\s*[:：]\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE)
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}|\\[dt]?frac(\d)(\d)")


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None


def extract_answer(response: str) -> str | None:
    """The final answer: the last `Answer:` line, else the last `\\boxed{}`; None when neither."""
    lines = _ANSWER_LINE.findall(response)
    if lines:
        answer = lines[-1].strip()
        boxed = _last_boxed(answer)
        return boxed if boxed is not None else answer
    return _last_boxed(response)


def _strip_wrappers(text: str) -> str:
    text = text.strip().strip("$").strip()
    text = re.sub(r"\\(?:text|mathrm|mbox)\{([^{}]*)\}", r"\1", text)
    text = text.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
    text = _FRAC.sub(lambda m: f"({m.group(1) or m.group(3)})/({m.group(2) or m.group(4)})", text)
    return text.rstrip(".").strip()


def parse_number(text: str) -> Fraction | None:
    """An exact number from an answer string, or None: ints, decimals, a/b, thousands separators."""
    t = _strip_wrappers(text).replace(" ", "")
    if t.endswith("%"):
        t = t[:-1]
    if re.fullmatch(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?", t):
        t = t.replace(",", "")
    m = re.fullmatch(r"\(?([-+]?\d+(?:\.\d+)?)\)?/\(?([-+]?\d+(?:\.\d+)?)\)?", t)
    try:
        if m:
            den = Fraction(m.group(2))
            return None if den == 0 else Fraction(m.group(1)) / den
        if re.fullmatch(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?", t):
            return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def _normalised_text(text: str) -> str:
    return re.sub(r"\s+", "", _strip_wrappers(text)).lower()


class MathVerifier:
    name = "math"

    def score(self, response: str, label: str) -> Verdict:
        if len(response) > MAX_RESPONSE_CHARS:
            return Verdict(False, None, f"response over {MAX_RESPONSE_CHARS:,} characters")
        answer = extract_answer(response)
        if answer is None:
            return Verdict(False, None, "no final answer (no Answer: line, no \\boxed{})")
        want = parse_number(str(label))
        got = parse_number(answer)
        if want is not None:
            if got is None:
                return Verdict(False, answer, "the answer is not a number")
            return Verdict(got == want, answer, "equal" if got == want else f"{got} != {want}")
        same = _normalised_text(answer) == _normalised_text(str(label))
        return Verdict(same, answer, "equal as text" if same else "differs as text")


# --- code --------------------------------------------------------------------------------------------

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)


@dataclass(frozen=True)
class SandboxLimits:
    wall_seconds: float = 4.0  # seed 004: "4-second wall, 3-second CPU, 1-GiB memory limit per test"
    cpu_seconds: int = 3
    memory_bytes: int = 1 << 30
    output_bytes: int = 1 << 20


def _limit_child(limits: SandboxLimits) -> Callable[[], None]:
    def apply() -> None:  # runs in the child between fork and exec
        import resource

        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.output_bytes, limits.output_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def run_sandboxed(code: str, stdin: str, limits: SandboxLimits = SandboxLimits()) -> tuple[str, str]:
    """Run `code` on `stdin` in a limited subprocess: (outcome, stdout); outcome "ok" or why not."""
    with tempfile.TemporaryDirectory(prefix="bcstack-sandbox-") as work:
        path = os.path.join(work, "main.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(code)
        try:
            done = subprocess.run(
                [sys.executable, "-I", "-S", path],
                input=stdin.encode(),
                capture_output=True,
                cwd=work,
                env={"PATH": "/usr/bin:/bin"},
                timeout=limits.wall_seconds,
                preexec_fn=_limit_child(limits),
                start_new_session=True,
            )
        except subprocess.TimeoutExpired:
            return "wall-clock limit", ""
    out = done.stdout[: limits.output_bytes].decode("utf-8", "replace")
    if done.returncode != 0:
        last = (done.stderr.decode("utf-8", "replace").strip().splitlines() or [f"exit {done.returncode}"])[
            -1
        ]
        return f"failed: {last[:200]}", out
    return "ok", out


def _same_output(got: str, want: str) -> bool:
    def lines(text: str) -> list[str]:
        return [line.rstrip() for line in text.strip().splitlines()]

    return lines(got) == lines(want)


class CodeVerifier:
    name = "code"

    def __init__(self, limits: SandboxLimits = SandboxLimits()) -> None:
        self.limits = limits

    def score(self, response: str, label: str) -> Verdict:
        tests = _json_list(label, "code label: a JSON list of {input, output} tests")
        blocks = _FENCE.findall(response[:MAX_RESPONSE_CHARS])
        if not blocks:
            return Verdict(False, None, "no fenced Python block")
        code = blocks[-1]
        for i, test in enumerate(tests):
            if not isinstance(test, Mapping) or not {"input", "output"} <= test.keys():
                raise VerifierError(f"code label: test {i} needs input and output")
            outcome, out = run_sandboxed(code, str(test["input"]), self.limits)
            if outcome != "ok":
                return Verdict(False, code, f"test {i}: {outcome}")
            if not _same_output(out, str(test["output"])):
                return Verdict(False, code, f"test {i}: wrong output")
        return Verdict(True, code, f"{len(tests)} tests pass")


# --- instruction following ---------------------------------------------------------------------------


def _words(text: str) -> list[str]:
    return re.findall(r"\b\w+\b", text)


CHECKS: dict[str, Callable[[str, Mapping[str, Any]], bool]] = {
    "lowercase": lambda r, c: r == r.lower(),
    "uppercase": lambda r, c: r == r.upper(),
    "max_words": lambda r, c: len(_words(r)) <= int(c["n"]),
    "min_words": lambda r, c: len(_words(r)) >= int(c["n"]),
    "include": lambda r, c: str(c["word"]).lower() in r.lower(),
    "exclude": lambda r, c: str(c["word"]).lower() not in r.lower(),
    "no_commas": lambda r, c: "," not in r,
    "ends_with": lambda r, c: r.strip().endswith(str(c["text"])),
}


class InstructionVerifier:
    name = "if"

    def score(self, response: str, label: str) -> Verdict:
        checks = _json_list(label, "instruction label: a JSON list of checks")
        failed = []
        for i, check in enumerate(checks):
            kind = check.get("kind") if isinstance(check, Mapping) else None
            if kind not in CHECKS:
                raise VerifierError(f"instruction label: check {i} has unknown kind {kind!r}")
            try:
                ok = CHECKS[kind](response, check)
            except (KeyError, TypeError, ValueError) as e:
                raise VerifierError(f"instruction label: check {i} ({kind}) is missing {e}") from None
            if not ok:
                failed.append(kind)
        if failed:
            return Verdict(False, None, "failed: " + ", ".join(failed))
        return Verdict(True, None, f"{len(checks)} checks pass")


def _json_list(label: str, what: str) -> Sequence[Any]:
    try:
        value = json.loads(label)
    except json.JSONDecodeError:
        raise VerifierError(f"{what}, got text that is not JSON") from None
    if not isinstance(value, list) or not value:
        raise VerifierError(f"{what}, got {type(value).__name__}")
    return value


VERIFIERS: dict[str, Callable[[], Verifier]] = {
    "math": MathVerifier,
    "code": CodeVerifier,
    "if": InstructionVerifier,
}


def verifier_for(name: str) -> Verifier:
    if name not in VERIFIERS:
        raise VerifierError(f"unknown verifier {name!r}; choose one of {', '.join(VERIFIERS)}")
    return VERIFIERS[name]()
