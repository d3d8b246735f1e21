"""The worker/coordinator function-call protocol (DESIGN.md §3), FoldAgent-compatible.

Pure functions, no I/O. Two directions:

* model output → calls: :func:`parse_calls` never raises on any text and returns zero or more
  :class:`FunctionCall`; :func:`validate_call` turns a call into a typed action or the one-line
  error observation the model is shown instead.
* tool results → observation text: :func:`render_search_results`, :func:`render_open_page`,
  :func:`render_observation` produce the exact strings a trained worker saw in training.

Byte-level fidelity matters: the SFT checkpoints of the seed cards were trained on FoldAgent's
``envs/local_search.py`` (sunnweiwei/FoldAgent; the slime port keeps it), so the observation
format below follows it character for character:

* search: ``[Search Results for "<query>"]\\n`` then per hit
  ``\\n--- #<i>: <docid>---\\ndocid: <docid>\\nurl: <url>\\ncontent: <first 512 words>\\n`` and a
  closing ``\\n``. ``i`` counts every hit of the result list (1-based). A hit already shown in an
  earlier search is cut to 128 words behind a fixed notice and counts 0.25 toward ``topk``; the
  list stops as soon as the shown count reaches ``topk``.
* open_page: ``[Opened Page Content]\\ndocid: …\\nurl: …\\ncontent: …\\n`` then ``\\n``; content is
  cut at its 4,096th word followed by ``\\n[Document is truncated.]`` (upstream marks a page of
  exactly 4,096 words as truncated too; kept, since a trained worker has seen it that way).
* the observation of one turn is the concatenation for every call, the reflection nudge
  appended, then ``.strip()``.

Deliberate departures from upstream, each because upstream loses information or misbehaves:

* parameter values are stripped of surrounding white space (upstream keeps ``\\n`` around a
  value written on its own line, which then leaks into the search header);
* calls inside a ``<think>`` block are ignored (they are reasoning, not actions);
* an unknown function *adds* its error line to the observation rather than replacing the
  results of the turn's other calls;
* an open_page that finds nothing says so instead of rendering an empty block.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# --- observation strings (FoldAgent envs/local_search.py) ---------------------------------------
NO_CALL_ERROR = "No function call was detected in the model response."
SEARCH_QUERY_ERROR = '[Error] The "search" function requires a "query" argument.'
OPEN_PAGE_ARG_ERROR = '[Error] The "open_page" function requires either a "docid" or a "url".'
SEEN_PAGE_NOTICE = (
    "(This page was already seen in a previous search. Here, a shorter snippet is shown. "
    "If you find this page relevant, please use the open_page tool to inspect the full content) "
)
TRUNCATION_MARK = "\n[Document is truncated.]"
REFLECTION_NUDGE = (
    "\n\n* Please reflect on the information we have obtained, and keep searching for additional "
    "information if we still can not answer the question. Do not give the answer if the information "
    "is still not enough."
)
EMPTY_FINISH_RESUBMIT = (
    "Fail to parse answer. Please resubmit with the correct tool call format, eg\n"
    "<function=finish>\n"
    "<parameter=answer>YOUR ANSWER</parameter>\n"
    "<parameter=explanation>YOUR EXPLANATION</parameter>\n"
    "<parameter=confidence>YOUR CONFIDENCE</parameter>\n"
    "</function>"
)

# Upstream defaults; every one of them is a setting of the worker service.
SNIPPET_WORDS = 512
SEEN_SNIPPET_WORDS = 128
SEEN_HIT_WEIGHT = 0.25
PAGE_WORDS = 4096
DEFAULT_TOPK = 10
MAX_TOPK = 10

WORKER_TOOLS = ("search", "open_page", "finish")
COORDINATOR_TOOLS = ("branch", "finish")


def unsupported_function_error(name: str) -> str:
    return f'[Error] The function "{name}" is not supported.'


def missing_parameter_error(function: str, parameter: str) -> str:
    return f'[Error] The "{function}" function requires a "{parameter}" argument.'


def page_not_found_error(docid: str | None, url: str | None) -> str:
    what = f'docid "{docid}"' if docid else f'url "{url}"'
    return f"[Error] No page was found for {what}."


# --- parsing -------------------------------------------------------------------------------------

# A call starts at the beginning of a line (leading blanks allowed), as in upstream's
# ``(?m)^[ \t]*<function=...>``: prose that merely mentions the syntax mid-sentence is not a call.
_CALL_RE = re.compile(r"^[ \t]*<function=([^>\n]+)>(.*?)</function>", re.DOTALL | re.MULTILINE)
_PARAM_RE = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
# Upstream splits on separator markers like ``<[sep]>`` and keeps the text after the last one.
_SEGMENT_MARK_RE = re.compile(r"<\[[^\]\n]+\]>")
_THINK_END = "</think>"
# Calls separated by this many blank-ish lines or more are different groups; only the last group
# counts (upstream: a model sometimes writes a draft call, prose, then its real calls).
_GROUP_LINE_GAP = 4


@dataclass(frozen=True)
class FunctionCall:
    """One ``<function=NAME>`` block: the name and its parameters (values stripped)."""

    name: str
    params: dict[str, str] = field(default_factory=dict)

    def get(self, key: str, default: str | None = None) -> str | None:
        return self.params.get(key, default)


def _strip_reasoning(text: str) -> str:
    if _THINK_END in text:
        text = text.rsplit(_THINK_END, 1)[1]
    elif text.lstrip().startswith("<think>"):
        # A turn cut off inside its reasoning has no actions yet.
        return ""
    return _SEGMENT_MARK_RE.split(text)[-1]


def parse_calls(text: object) -> list[FunctionCall]:
    """Every function call of the last group in ``text``; ``[]`` when there is none.

    Total: any input (even a non-string) gives a list, never an exception.
    """
    if not isinstance(text, str) or "<function=" not in text:
        return []
    body = _strip_reasoning(text)
    matches = list(_CALL_RE.finditer(body))
    if not matches:
        return []
    group = [matches[0]]
    for prev, cur in zip(matches, matches[1:], strict=False):
        if body.count("\n", prev.end(), cur.start()) >= _GROUP_LINE_GAP:
            group = []
        group.append(cur)
    calls = []
    for m in group:
        params: dict[str, str] = {}
        for key, value in _PARAM_RE.findall(m.group(2)):
            params[key.strip()] = value.strip()
        calls.append(FunctionCall(name=m.group(1).strip(), params=params))
    return calls


def render_call(call: FunctionCall) -> str:
    """The canonical text of a call; ``parse_calls(render_call(c)) == [c]`` for well-formed ``c``."""
    lines = [f"<function={call.name}>"]
    lines += [f"<parameter={k}>{v}</parameter>" for k, v in call.params.items()]
    lines.append("</function>")
    return "\n".join(lines)


def render_calls(calls: Iterable[FunctionCall]) -> str:
    return "\n".join(render_call(c) for c in calls)


# --- validation: calls → typed actions -----------------------------------------------------------


@dataclass(frozen=True)
class SearchAction:
    query: str
    topk: int


@dataclass(frozen=True)
class OpenPageAction:
    docid: str | None
    url: str | None


@dataclass(frozen=True)
class FinishAction:
    answer: str
    explanation: str
    confidence: str


@dataclass(frozen=True)
class BranchAction:
    description: str
    prompt: str


@dataclass(frozen=True)
class CallError:
    """A call the model got wrong; ``message`` is the observation line it is shown."""

    message: str


Action = SearchAction | OpenPageAction | FinishAction | BranchAction | CallError


def _parse_topk(raw: str | None, default: int, cap: int) -> int:
    # Upstream: int(v) if str(v).isdigit() else 10. Capped to the protocol's maximum; 0 → default.
    if raw is None or not raw.isdigit():
        return default
    value = int(raw[:6])
    return min(value, cap) if value > 0 else default


def validate_call(
    call: FunctionCall,
    tools: Sequence[str] = WORKER_TOOLS,
    *,
    default_topk: int = DEFAULT_TOPK,
    max_topk: int = MAX_TOPK,
) -> Action:
    """Map a parsed call onto the action it asks for, or the error line for the model."""
    if call.name not in tools:
        return CallError(unsupported_function_error(call.name))
    if call.name == "search":
        query = call.get("query") or ""
        if not query:
            return CallError(SEARCH_QUERY_ERROR)
        return SearchAction(query=query, topk=_parse_topk(call.get("topk"), default_topk, max_topk))
    if call.name == "open_page":
        docid, url = call.get("docid") or None, call.get("url") or None
        if not docid and not url:
            return CallError(OPEN_PAGE_ARG_ERROR)
        return OpenPageAction(docid=docid, url=url)
    if call.name == "finish":
        return FinishAction(
            answer=call.get("answer") or "",
            explanation=call.get("explanation") or "",
            confidence=call.get("confidence") or "",
        )
    if call.name == "branch":
        for needed in ("description", "prompt"):
            if not call.get(needed):
                return CallError(missing_parameter_error("branch", needed))
        return BranchAction(description=call.params["description"], prompt=call.params["prompt"])
    return CallError(unsupported_function_error(call.name))


# --- observations --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Page:
    """A document as the retrieval service returns it (``text`` is the full text)."""

    docid: str
    url: str
    text: str


def first_words(text: str, n: int) -> str:
    """The first ``n`` white-space separated words, joined by single spaces (upstream snippet rule)."""
    return " ".join(text.split()[:n])


def keep_first_words(text: str, n: int) -> str:
    """``text`` up to the end of its n-th word plus the truncation mark; unchanged if shorter.

    Unlike :func:`first_words` this keeps the original white space (upstream ``keep_first_n_words``).
    """
    if not text:
        return ""
    for count, m in enumerate(re.finditer(r"\S+", text), 1):
        if count == n:
            return text[: m.end()] + TRUNCATION_MARK
    return text


def render_search_results(
    query: str,
    hits: Sequence[Page],
    seen: set[str],
    topk: int = DEFAULT_TOPK,
    *,
    snippet_words: int = SNIPPET_WORDS,
    seen_snippet_words: int = SEEN_SNIPPET_WORDS,
    seen_weight: float = SEEN_HIT_WEIGHT,
) -> str:
    """The search block for one call; adds the newly shown docids to ``seen`` (the episode's set)."""
    out = [f'[Search Results for "{query}"]\n']
    shown = 0.0
    for i, hit in enumerate(hits, 1):
        if hit.docid in seen:
            content = SEEN_PAGE_NOTICE + first_words(hit.text, seen_snippet_words)
            shown += seen_weight
        else:
            seen.add(hit.docid)
            content = first_words(hit.text, snippet_words)
            shown += 1
        out.append(f"\n--- #{i}: {hit.docid}---\ndocid: {hit.docid}\nurl: {hit.url}\ncontent: {content}\n")
        if shown >= topk:
            break
    out.append("\n")
    return "".join(out)


def render_open_page(pages: Sequence[Page], *, page_words: int = PAGE_WORDS) -> str:
    """The block for one open_page call (the retrieval service may return several matches)."""
    out = [
        f"[Opened Page Content]\ndocid: {page.docid}\nurl: {page.url}\n"
        f"content: {keep_first_words(page.text, page_words)}\n"
        for page in pages
    ]
    out.append("\n")
    return "".join(out)


def finish_observation(parts: Sequence[str], *, reflection_nudge: bool = True) -> str:
    """Join the blocks of one turn into the user message the model sees next."""
    text = "".join(parts)
    if reflection_nudge:
        text += REFLECTION_NUDGE
    return text.strip()


# --- reading observations back (scripted policies, evaluation) -----------------------------------

_SEARCH_HEADER_RE = re.compile(r'^\[Search Results for "(.*)"\]$', re.MULTILINE)
# Snippets are words joined by single spaces, so a hit's content never spans lines.
_HIT_RE = re.compile(r"^--- #(\d+): (.*?)---\ndocid: (.*)\nurl: (.*)\ncontent: (.*)$", re.MULTILINE)
_OPENED_RE = re.compile(
    r"^\[Opened Page Content\]\ndocid: (.*)\nurl: (.*)\ncontent: (.*?)"
    r"(?=\n\n\[|\n\[Opened Page Content\]|\n\n\* |\n*\Z)",
    re.DOTALL | re.MULTILINE,
)


@dataclass(frozen=True)
class ObservedHit:
    rank: int
    docid: str
    url: str
    content: str
    seen_before: bool


@dataclass(frozen=True)
class ParsedObservation:
    queries: list[str]
    hits: list[ObservedHit]
    pages: list[Page]


def parse_observation(text: str) -> ParsedObservation:
    """Search hits and opened pages found in an observation written by this module."""
    if not isinstance(text, str):
        return ParsedObservation([], [], [])
    queries = _SEARCH_HEADER_RE.findall(text)
    hits = []
    for m in _HIT_RE.finditer(text):
        content = m.group(5)
        seen = content.startswith(SEEN_PAGE_NOTICE)
        if seen:
            content = content[len(SEEN_PAGE_NOTICE) :]
        hits.append(ObservedHit(int(m.group(1)), m.group(3), m.group(4), content, seen))
    pages = [
        Page(docid=m.group(1), url=m.group(2), text=m.group(3).rstrip()) for m in _OPENED_RE.finditer(text)
    ]
    return ParsedObservation(queries, hits, pages)


# --- worker reports (worker → coordinator) -------------------------------------------------------

REPORT_HEADER = "[Worker Report]"


@dataclass(frozen=True)
class WorkerReportText:
    description: str
    status: str  # finish | budget | turns | context | error
    answer: str = ""
    explanation: str = ""
    confidence: str = ""


def render_worker_report(report: WorkerReportText) -> str:
    """What the coordinator reads when a branch comes back (a finished or an exhausted worker)."""
    lines = [REPORT_HEADER, f"task: {report.description}", f"status: {report.status}"]
    if report.status == "finish":
        lines += [
            f"answer: {report.answer}",
            f"explanation: {report.explanation}",
            f"confidence: {report.confidence}",
        ]
    else:
        reasons = {
            "budget": "the worker ran out of its token budget before finishing",
            "turns": "the worker reached its turn limit before finishing",
            "context": "the worker's context window was full before it finished",
            "error": "the worker failed with an error",
        }
        lines.append(f"note: {reasons.get(report.status, 'the worker did not finish')}; no answer was given.")
    return "\n".join(lines)


_REPORT_FIELD_RE = re.compile(r"^(task|status|answer|explanation|confidence): ?(.*)$", re.MULTILINE)


def parse_worker_reports(text: str) -> list[WorkerReportText]:
    """Every worker report in a coordinator observation, in order."""
    if not isinstance(text, str):
        return []
    reports = []
    for block in text.split(REPORT_HEADER)[1:]:
        fields: dict[str, str] = {}
        # A field written over several lines is read up to its first line break.
        for key, value in _REPORT_FIELD_RE.findall(block):
            fields.setdefault(key, value.strip())
        reports.append(
            WorkerReportText(
                description=fields.get("task", ""),
                status=fields.get("status", ""),
                answer=fields.get("answer", ""),
                explanation=fields.get("explanation", ""),
                confidence=fields.get("confidence", ""),
            )
        )
    return reports
