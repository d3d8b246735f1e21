"""The judge's grading core: templates, prompt rendering, verdict parsing and rule-based grading.

Pure functions, no I/O beyond reading the versioned template files next to this module.

Two questions get graded:
- episode correctness, with a BrowseComp-style grader template: the grader LLM answers with
  `extracted_final_answer:`, `reasoning:`, `correct: yes|no` and `confidence:` lines;
- a worker report's contribution to the episode, on `CONTRIBUTION_SCALE`.

Parsing reads the *captured* value of each field. The simple-evals reference compares the whole
regex match (`group(0)`, i.e. "correct: yes") with "yes" and so scores every answer wrong; we do not.

The rule backend (the embedded default, no LLM) grades by normalized exact match or numeric equality
of the response's `Exact Answer:` line with the gold answer.
"""

from __future__ import annotations

import math
import re
import unicodedata
from dataclasses import asdict, dataclass, fields
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

TEMPLATES_DIR = Path(__file__).resolve().parent / "grader_templates"
RULE_VERSION = "rule-v1"  # normalized exact + numeric match; bump when the rules change
EXACT_VERSION = "exact-v1"  # the exact fast path's version, whatever the backend

TemplateKind = Literal["answer", "contribution"]


def response_text(answer: str, explanation: str, confidence: str) -> str:
    """The final answer in the BrowseComp answer format the grader template expects.

    An empty confidence (an episode that never called finish) renders no `Confidence:` line, so
    `response_confidence` reads None, not a confidence of 0 that was never stated.
    """
    text = f"Explanation: {explanation}\nExact Answer: {answer}"
    return f"{text}\nConfidence: {confidence}" if confidence and confidence.strip() else text


# Placeholders each template kind must contain (and the only ones rendering fills in).
_PLACEHOLDERS: dict[str, tuple[str, ...]] = {
    "answer": ("question", "response", "correct_answer"),
    "contribution": ("question", "task", "report", "final_answer", "gold_answer"),
}

# Label -> score of a worker report's contribution to the correct answer. The single source of truth:
# contribution_v1.txt lists the same labels and scores (a test keeps them in step).
#   decisive:    the report contains the correct answer with evidence the final answer relied on
#   substantial: a key step or piece of evidence toward the correct answer, not the answer itself
#   partial:     useful, relevant findings that narrow the search
#   marginal:    on topic but adds little, or supports a wrong final answer
#   none:        irrelevant, wrong, empty, or out of budget without findings
CONTRIBUTION_SCALE: dict[str, float] = {
    "decisive": 1.0,
    "substantial": 0.75,
    "partial": 0.5,
    "marginal": 0.25,
    "none": 0.0,
}

# A response without an `Exact Answer:` line counts as a bare answer only when it is one line shorter
# than this; anything longer is prose, and grading prose needs the LLM grader, not a rule.
_BARE_ANSWER_MAX_CHARS = 200
_NUMERIC_REL_TOL = 1e-9


# --------------------------------------------------------------------------- templates


@dataclass(frozen=True)
class Template:
    name: str
    version: str
    text: str

    @property
    def id(self) -> str:
        """The grader version recorded with each verdict, e.g. "browsecomp-answer-v1"."""
        return f"{self.name}-{self.version}"


_VERSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_HEADER_RE = re.compile(r"#\s*([A-Za-z_][\w-]*)\s*:\s*(.*?)\s*")


def load_template(kind: TemplateKind, version: str = "v1", *, directory: Path | None = None) -> Template:
    """The template `{kind}_{version}.txt` from `directory` (default: the templates next to this module).

    The file is a header of `# key: value` lines (`name` and `version` required; `version` must equal
    the requested one), a blank line, then the prompt text with `{placeholders}`. A missing or malformed
    file raises ValueError naming the file.
    """
    return _load_template(kind, version, Path(directory) if directory is not None else TEMPLATES_DIR)


@lru_cache(maxsize=32)  # a version's file never changes once released: a new wording is a new version
def _load_template(kind: str, version: str, directory: Path) -> Template:
    if kind not in _PLACEHOLDERS:
        raise ValueError(f"unknown template kind {kind!r}; expected one of {sorted(_PLACEHOLDERS)}")
    if not isinstance(version, str) or not _VERSION_RE.fullmatch(version):
        raise ValueError(
            f"template file {kind}_{version}.txt: malformed version {version!r}"
            " (letters, digits, '_', '.', '-')"
        )
    path = directory / f"{kind}_{version}.txt"
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"template file {path} not found (kind {kind!r}, version {version!r})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"template file {path} is unreadable: {e}") from None

    header: dict[str, str] = {}
    lines = raw.splitlines(keepends=True)
    i = 0
    while i < len(lines) and lines[i].strip():
        m = _HEADER_RE.fullmatch(lines[i].rstrip("\r\n"))
        if not m:
            raise ValueError(f"template file {path}: header line {i + 1} is not '# key: value'")
        header[m.group(1).lower()] = m.group(2)
        i += 1
    text = "".join(lines[i + 1 :]).strip("\n")
    if not header:
        raise ValueError(f"template file {path}: no '# key: value' header")
    for key in ("name", "version"):
        if not header.get(key):
            raise ValueError(f"template file {path}: header lacks '# {key}:'")
    if header["version"] != version:
        raise ValueError(f"template file {path}: header says version {header['version']!r}, not {version!r}")
    if not text.strip():
        raise ValueError(f"template file {path}: no prompt text after the header")
    missing = [p for p in _PLACEHOLDERS[kind] if "{" + p + "}" not in text]
    if missing:
        raise ValueError(f"template file {path}: placeholders missing: {', '.join(missing)}")
    return Template(name=header["name"], version=header["version"], text=text)


def _render(template: Template, values: dict[str, str]) -> str:
    # One pass over the template text only: braces in the inputs are never interpreted, and an input
    # that happens to contain "{response}" is not filled in by a later substitution.
    pattern = re.compile(r"\{(" + "|".join(map(re.escape, values)) + r")\}")
    return pattern.sub(lambda m: values[m.group(1)], template.text)


def render_answer_prompt(t: Template, *, question: str, response: str, correct_answer: str) -> str:
    return _render(t, {"question": question, "response": response, "correct_answer": correct_answer})


def render_contribution_prompt(
    t: Template, *, question: str, task: str, report: str, final_answer: str, gold_answer: str
) -> str:
    return _render(
        t,
        {
            "question": question,
            "task": task,
            "report": report,
            "final_answer": final_answer,
            "gold_answer": gold_answer,
        },
    )


# --------------------------------------------------------------------------- verdicts


def _from_dict(cls: type, d: dict[str, Any]) -> Any:
    names = {f.name for f in fields(cls)}
    try:
        return cls(**{k: v for k, v in d.items() if k in names})
    except TypeError as e:
        raise ValueError(f"not a {cls.__name__}: {e}") from None


@dataclass
class AnswerVerdict:
    correct: bool | None
    extracted_final_answer: str
    reasoning: str
    confidence: float | None
    parse_error: bool
    grader_version: str
    method: str  # "exact" (fast path), "rule" or "llm"
    cached: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AnswerVerdict:
        """Inverse of `to_dict`; unknown keys are ignored, a missing required key is a ValueError."""
        return _from_dict(cls, d)


@dataclass
class ContributionVerdict:
    score: float
    label: str
    reasoning: str
    parse_error: bool
    grader_version: str
    method: str  # "rule" or "llm"
    cached: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ContributionVerdict:
        """Inverse of `to_dict`; unknown keys are ignored, a missing required key is a ValueError."""
        return _from_dict(cls, d)


# --------------------------------------------------------------------------- "label: value" parsing

_MARKUP = "*_`"


def _label_line_re(labels: dict[str, str]) -> re.Pattern[str]:
    """A line `label: value`, tolerating markdown: bullets, headings, quotes, `**label:**`, `**label**:`."""
    alternatives = "|".join(f"(?P<{key}>{pattern})" for key, pattern in labels.items())
    return re.compile(
        # bullets ("- ", "* ", "• "), numbering, headings and quotes; a "*" bullet needs its space so
        # that "**label**" is read as bold, not as two bullets
        # (possessive quantifiers: adjacent optional whitespace runs would backtrack quadratically)
        r"[ \t]*+(?:(?:[-*+•]|\d{1,3}[.)])[ \t]++|[>#][ \t]*+)*+"
        r"(?P<open>[*_`]{0,3})[ \t]*+"
        rf"(?:{alternatives})"
        r"[ \t]*+(?P<close>[*_`]{0,3})[ \t]*+:(?P<rest>.*)",
        re.IGNORECASE,
    )


def _find_fields(text: str, line_re: re.Pattern[str], keys: tuple[str, ...]) -> dict[str, str]:
    """Each field's value: the text after its label up to the next label line (multi-line allowed).

    A label that appears twice keeps its first value; any label line ends the previous field's value.
    """
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        m = line_re.fullmatch(line)
        key = next((k for k in keys if m.group(k) is not None), None) if m else None
        if m is None or key is None:
            if current is not None:
                current.append(line)
            continue
        rest = m.group("rest")
        opener = m.group("open")
        if opener and not m.group("close"):
            if rest.lstrip().startswith(opener):  # `**label:** value`: the closing markup follows the colon
                rest = rest.lstrip()[len(opener) :]
            elif rest.rstrip().endswith(opener):  # `**label: value**`: the whole line is wrapped
                rest = rest.rstrip()[: -len(opener)]
        if key in found:
            current = None  # a repeated label: ignore its value (first one wins)
        else:
            current = found[key] = [rest]
    return {k: "\n".join(v).strip() for k, v in found.items()}


def _unwrap(value: str) -> str:
    """Strip whitespace and markup that wraps the whole value (`**x**`, `*x*`, `` `x` ``)."""
    value = value.strip()
    while len(value) >= 2 and value[0] in _MARKUP and value[-1] == value[0]:
        value = value[1:-1].strip()
    return value


def _first_line(value: str) -> str:
    return next((line.strip() for line in value.splitlines() if line.strip()), "")


_YES_NO_STRIP = " \t*_`'\"“”‘’«»()[].,;:!?"
_CONFIDENCE_NUMBER_RE = re.compile(r"(?<![\d.])([-+]?)(\d+(?:\.\d+)?|\.\d+)\s*(%?)")


def _parse_yes_no(value: str) -> bool | None:
    word = _first_line(value).strip(_YES_NO_STRIP).casefold()
    return {"yes": True, "no": False}.get(word)


def _parse_confidence(value: str) -> float | None:
    """A confidence on the 0-100 scale from text like "85", "85%", "85 / 100" or "0.85".

    A number written with a decimal point, at most 1 and without "%" ("0.85", "1.0") is read as a
    fraction and scaled to 0-100; integers ("1", "85") and anything with "%" are percentages.
    Results are clamped to [0, 100]; no number gives None.
    """
    m = _CONFIDENCE_NUMBER_RE.search(_first_line(value))
    if not m:
        return None
    sign, digits, percent = m.groups()
    number = float(digits) * (-1.0 if sign == "-" else 1.0)
    if not percent and "." in digits and 0.0 <= number <= 1.0:
        number *= 100.0
    return min(100.0, max(0.0, number))


# --------------------------------------------------------------------------- grader output parsing

_ANSWER_FIELDS = {
    "extracted_final_answer": r"extracted[ _-]?final[ _-]?answer",
    "reasoning": r"reasoning",
    "correct": r"correct",
    "confidence": r"confidence",
}
_ANSWER_LINE_RE = _label_line_re(_ANSWER_FIELDS)
_CONTRIBUTION_FIELDS = {"contribution": r"contribution", "reasoning": r"reasoning"}
_CONTRIBUTION_LINE_RE = _label_line_re(_CONTRIBUTION_FIELDS)


@dataclass(frozen=True)
class ParsedAnswer:
    extracted_final_answer: str
    reasoning: str
    correct: bool
    confidence: float | None


def parse_answer_verdict(text: str) -> ParsedAnswer | None:
    """The answer grader's verdict, or None when `correct:` is missing or not a bare yes/no.

    Fields may come in any order and in markdown (`**correct:** yes`, `- Correct: Yes.`); values are
    the captured text after each label, up to the next label line. Never raises.
    """
    if not isinstance(text, str):
        return None
    try:
        found = _find_fields(text, _ANSWER_LINE_RE, tuple(_ANSWER_FIELDS))
        correct = _parse_yes_no(found.get("correct", ""))
        if correct is None:
            return None
        return ParsedAnswer(
            extracted_final_answer=_unwrap(found.get("extracted_final_answer", "")),
            reasoning=_unwrap(found.get("reasoning", "")),
            correct=correct,
            confidence=_parse_confidence(found["confidence"]) if "confidence" in found else None,
        )
    except Exception:  # a parser of model output must not take the service down
        return None


@dataclass(frozen=True)
class ParsedContribution:
    label: str
    score: float
    reasoning: str


_LABEL_RE = re.compile(r"([^\W\d_]+)(.*)", re.DOTALL)


def _contribution_label(value: str) -> str | None:
    # "decisive", "**Decisive**", "decisive (1.0)" and "decisive - 1.0" name a label; "none of it" does not.
    line = _first_line(value).strip(_YES_NO_STRIP)
    m = _LABEL_RE.fullmatch(line)
    if not m:
        return None
    label, tail = m.group(1).casefold(), m.group(2)
    if label not in CONTRIBUTION_SCALE or re.search(r"[^\W\d_]", tail):
        return None
    return label


def parse_contribution(text: str) -> ParsedContribution | None:
    """The contribution grader's verdict, or None when the label is missing or not on the scale."""
    if not isinstance(text, str):
        return None
    try:
        found = _find_fields(text, _CONTRIBUTION_LINE_RE, tuple(_CONTRIBUTION_FIELDS))
        label = _contribution_label(found.get("contribution", ""))
        if label is None:
            return None
        return ParsedContribution(
            label=label, score=CONTRIBUTION_SCALE[label], reasoning=_unwrap(found.get("reasoning", ""))
        )
    except Exception:
        return None


# --------------------------------------------------------------------------- normalization

# Stripped from both ends of an answer; trailing punctuation too, but a leading "." may be a decimal (".5").
_EDGE_CHARS = " \t\n\"'“”‘’„«»`*_~()[]{}<>"
_TRAILING_CHARS = _EDGE_CHARS + ".,;:!?"
_ARTICLE_RE = re.compile(r"^(?:a|an|the)\s+")
_THOUSANDS_RE = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\u2013": "-", "\u2012": "-"})


def normalize_answer(text: str) -> str:
    """A canonical form for comparing short answers.

    NFKC, casefold, collapse whitespace, strip surrounding quotes / markdown / punctuation, drop one
    leading article (a, an, the) and thousands separators inside numbers ("1,738" -> "1738").
    """
    s = unicodedata.normalize("NFKC", text).casefold()
    s = " ".join(s.split()).lstrip(_EDGE_CHARS).rstrip(_TRAILING_CHARS)
    s = _ARTICLE_RE.sub("", s).lstrip(_EDGE_CHARS)
    return _THOUSANDS_RE.sub("", s)


_SCALE_WORDS = {"thousand": 1e3, "million": 1e6, "billion": 1e9, "trillion": 1e12}
_NUMBER_RE = re.compile(
    r"(?P<sign>[-+])?[ ]?(?P<currency>[$€£¥])?[ ]?"
    r"(?P<digits>\d+(?:\.\d+)?|\.\d+)"
    r"(?:[ ]?(?:%|percent\b))?"
    rf"(?:[ ](?P<scale>{'|'.join(_SCALE_WORDS)}))?"
    r"(?:[ ][^\W\d_]+(?:[ ][^\W\d_]+){0,2})?"  # up to three unit words, ignored
)


def parse_number(text: str) -> float | None:
    """The number a short answer states, or None.

    Supported: an optional sign and currency symbol ($ € £ ¥), digits with optional thousands commas
    and decimals, an optional "%" / "percent" (kept as the number: "85%" -> 85), an optional scale word
    (thousand, million, billion, trillion) and up to three trailing unit words, which are ignored
    ("$1.5 million" -> 1500000, "12 km" -> 12). Anything else (dates, ranges, words before the number,
    scientific notation) is not a number here.
    """
    m = _NUMBER_RE.fullmatch(normalize_answer(text).translate(_MINUS_SIGNS))
    if not m:
        return None
    value = float(m.group("digits")) * _SCALE_WORDS.get(m.group("scale") or "", 1.0)
    value = -value if m.group("sign") == "-" else value
    return value if math.isfinite(value) else None


# --------------------------------------------------------------------------- BrowseComp responses

_RESPONSE_FIELDS = {
    "exact_answer": r"exact[ _-]?answer",
    "explanation": r"explanation",
    "confidence": r"confidence",
}
_RESPONSE_LINE_RE = _label_line_re(_RESPONSE_FIELDS)


def _response_fields(response: str) -> dict[str, str]:
    return _find_fields(response, _RESPONSE_LINE_RE, tuple(_RESPONSE_FIELDS))


def extract_exact_answer(response: str) -> str:
    """The answer in the BrowseComp format (`Explanation:` / `Exact Answer:` / `Confidence:` lines).

    The `Exact Answer:` value (markdown tolerated; on the next line if the label line is empty); with
    no such line, a single short line (< 200 chars) is the answer itself; otherwise "".
    """
    if not isinstance(response, str):
        return ""
    found = _response_fields(response)
    if "exact_answer" in found:
        return _unwrap(_first_line(found["exact_answer"]))
    bare = response.strip()
    if bare and "\n" not in bare and len(bare) < _BARE_ANSWER_MAX_CHARS:
        return _unwrap(bare)
    return ""


def response_confidence(response: str) -> float | None:
    """The `Confidence: N%` a response states (0-100, clamped), or None if it states none."""
    if not isinstance(response, str):
        return None
    found = _response_fields(response)
    return _parse_confidence(found["confidence"]) if "confidence" in found else None


def _match(answer: str, correct_answer: str) -> str | None:
    """How `answer` matches the gold answer ("normalized exact match" / "numeric match"), or None."""
    a, b = normalize_answer(answer), normalize_answer(correct_answer)
    if not a or not b:
        return None
    if a == b:
        return "normalized exact match"
    x, y = parse_number(a), parse_number(b)
    if x is not None and y is not None and math.isclose(x, y, rel_tol=_NUMERIC_REL_TOL):
        return "numeric match"
    return None


def exact_match(response: str, correct_answer: str) -> bool:
    """The response's exact answer equals the gold answer after normalization, or as a number."""
    return _match(extract_exact_answer(response), correct_answer) is not None


def exact_verdict(response: str, correct_answer: str, grader_version: str) -> AnswerVerdict | None:
    """The fast path before any grader call: a correct verdict on an exact match, else None."""
    extracted = extract_exact_answer(response)
    how = _match(extracted, correct_answer)
    if how is None:
        return None
    return AnswerVerdict(
        correct=True,
        extracted_final_answer=extracted,
        reasoning=how,
        confidence=response_confidence(response),
        parse_error=False,
        grader_version=grader_version,
        method="exact",
    )


def rule_answer(response: str, correct_answer: str, grader_version: str) -> AnswerVerdict:
    """The rule backend's verdict: correct iff normalized exact or numeric match."""
    extracted = extract_exact_answer(response)
    how = _match(extracted, correct_answer)
    if how:
        reasoning = how
    elif not extracted:
        reasoning = "no exact answer found in the response"
    else:
        reasoning = f"{normalize_answer(extracted)!r} does not match {normalize_answer(correct_answer)!r}"
    return AnswerVerdict(
        correct=how is not None,
        extracted_final_answer=extracted,
        reasoning=reasoning,
        confidence=response_confidence(response),
        parse_error=False,
        grader_version=grader_version,
        method="rule",
    )


def _contains(haystack: str, needle: str) -> bool:
    # Whole-token containment: "1738" is not found in "17380".
    return re.search(rf"(?<!\w){re.escape(needle)}(?!\w)", haystack) is not None


def reported_answer(report: str) -> tuple[str, str]:
    """What a worker report answers, and where that was read: ("field", its answer field) for a report
    in the worker's format (`core.protocol.render_worker_report`; "" when it did not finish), else
    ("text", the whole text) for a free-text report, which has no field to read."""
    from core.protocol import REPORT_HEADER, parse_worker_reports

    if REPORT_HEADER in report:
        reports = parse_worker_reports(report)
        last = reports[-1] if reports else None
        return "field", last.answer if last is not None and last.status == "finish" else ""
    return "text", report


def rule_contribution(
    report: str, final_answer: str, gold_answer: str, grader_version: str
) -> ContributionVerdict:
    """The rule backend's contribution rating of a worker report.

    It reads the report's answer field (`reported_answer`), not its task or explanation lines: an
    explanation that mentions the gold answer among others ("not 1738 but 1739") is no finding of
    it. decisive: the answer contains the gold answer; marginal: it contains the (different) final
    answer only; none otherwise, and always when the gold answer is empty or the worker gave no
    answer. Texts are compared normalized. A free-text report (not in the worker's format) is read
    whole, as an LLM grader would read it.
    """
    where, answer = reported_answer(report)
    gold, final, text = (
        normalize_answer(gold_answer),
        normalize_answer(final_answer),
        normalize_answer(answer),
    )
    what = "the report's answer field" if where == "field" else "the report"
    if not gold:
        label, reasoning = "none", "no gold answer to look for"
    elif where == "field" and not text:
        label, reasoning = "none", "the worker gave no answer"
    elif _contains(text, gold):
        label, reasoning = "decisive", f"{what} contains the gold answer"
    elif final and final != gold and _contains(text, final):
        label, reasoning = "marginal", f"{what} contains the final answer, which is not the gold answer"
    else:
        label, reasoning = "none", f"{what} contains neither the gold answer nor the final answer"
    return ContributionVerdict(
        score=CONTRIBUTION_SCALE[label],
        label=label,
        reasoning=reasoning,
        parse_error=False,
        grader_version=grader_version,
        method="rule",
    )
