"""The worker/coordinator function-call protocol (DESIGN.md §3), FoldAgent-compatible.

Pure functions, no I/O. Two directions:

* model output → calls: :func:`parse_calls` never raises on any text and returns zero or more
  :class:`FunctionCall`; :func:`validate_call` turns a call into a typed action or the one-line
  error observation the model is shown instead.
* tool results → observation text: :func:`render_search_results`, :func:`render_open_page`,
  :class:`TurnObservation` produce the exact strings a trained worker saw in training.

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
  appended, then ``.strip()``. Three messages stand alone, without the nudge: the no-call line,
  the empty-finish resubmit and the no-search bounce (:func:`no_search_verdict`).
* Qwen3's native ``<tool_call>{"name", "arguments"}</tool_call>`` and ``<answer>…</answer>``
  blocks are read too (``native=True``): ``search`` with a list of queries becomes one search per
  query, ``visit`` with a list of urls one ``open_page`` per url. When a turn holds native calls
  they are the turn's calls, whatever ``<function=…>`` blocks it also has (upstream's order).
* ``finish`` before any ``search`` in the episode is voided (no search, no reward); a voided
  answer that would have been right (:func:`lenient_match`) is bounced once instead.

Deliberate departures from upstream, each because upstream loses information or misbehaves, and
each one keyword argument away from upstream's behaviour (README, "Worker protocol: fidelity
settings", has the table):

* white space around function names, parameter names and values is stripped (upstream keeps
  the ``\\n`` around a value written on its own line, which then leaks into the search header):
  ``parse_calls(strip_whitespace=False)``;
* calls inside a ``<think>`` block are ignored (they are reasoning, not actions):
  ``parse_calls(ignore_reasoning=False)``;
* an unknown function *adds* its error line to the observation rather than replacing the
  results of the turn's other calls: ``TurnObservation(unknown_function_replaces=True)``;
* an open_page that finds nothing says so instead of rendering an empty block:
  ``render_open_result(report_missing=False)``;
* ``topk`` 0 means the default (upstream shows one hit): ``validate_call(zero_topk_is_default=False)``;
* a native search or visit whose ``query``/``url`` is one string instead of a list is one call
  (upstream makes a call per character): ``parse_calls(native_string_is_one=False)``.
"""

from __future__ import annotations

import ast
import json
import re
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

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
NO_SEARCH_BOUNCE = (
    "Answer submission failed. You MUST use the search tool to verify the answer and all the "
    "evidence, and cite the correct source document in your explanation to support your claim."
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
# Names are upstream's ``[^>]+`` (a line break included) so that both parse the same calls.
_CALL_RE = re.compile(r"^[ \t]*<function=([^>]+)>(.*?)</function>", re.DOTALL | re.MULTILINE)
_PARAM_RE = re.compile(r"<parameter=([^>]+)>(.*?)</parameter>", re.DOTALL)
# Upstream splits on separator markers like ``<[sep]>`` and keeps the text after the last one.
_SEGMENT_MARK_RE = re.compile(r"<\[[^\]\n]+\]>")
_THINK_END = "</think>"
# Calls separated by this many blank-ish lines or more are different groups; only the last group
# counts (upstream: a model sometimes writes a draft call, prose, then its real calls).
_GROUP_LINE_GAP = 4
# Qwen3's own tool-call syntax, and a bare answer block (upstream ``extract_json_tool``).
_NATIVE_MARKERS = ("<tool_call>", "<answer>")
_NATIVE_RE = re.compile(r"<(tool_call|answer)>\s*(.*?)\s*</\1>", re.DOTALL)
_FENCE_RE = re.compile(r"^```(?:json)?\s*|\s*```$", re.DOTALL)
_BRACES_RE = re.compile(r"\{.*\}", re.DOTALL)
# A native search with n queries shows max(10 // (n + 1), 2) hits per query (upstream).
NATIVE_SEARCH_TOPK_SHARE = 10
NATIVE_SEARCH_MIN_TOPK = 2


@dataclass(frozen=True)
class FunctionCall:
    """One call: the name and its parameters as text (``<function=NAME>`` or a native block)."""

    name: str
    params: dict[str, str] = field(default_factory=dict)

    def get(self, key: str, default: str | None = None) -> str | None:
        return self.params.get(key, default)


def _without_reasoning(text: str) -> str:
    if _THINK_END in text:
        return text.rsplit(_THINK_END, 1)[1]
    if text.lstrip().startswith("<think>"):
        # A turn cut off inside its reasoning has no actions yet.
        return ""
    return text


def parse_calls(
    text: object,
    *,
    native: bool = False,
    strip_whitespace: bool = True,
    ignore_reasoning: bool = True,
    native_string_is_one: bool = True,
) -> list[FunctionCall]:
    """The calls of one model turn; ``[]`` when there is none.

    ``<function=…>`` calls: every call of the last group. ``native``: Qwen3 ``<tool_call>`` JSON
    and ``<answer>`` blocks, which win when present (upstream's order). The other switches are
    the departures of the module docstring, upstream's behaviour when False.

    Total: any input (even a non-string) gives a list, never an exception.
    """
    if not isinstance(text, str):
        return []
    body = _without_reasoning(text) if ignore_reasoning else text
    if native and any(m in body for m in _NATIVE_MARKERS):
        calls = _native_calls(body, strip_whitespace=strip_whitespace, string_is_one=native_string_is_one)
        if calls:
            return calls
    if "<function=" not in body:
        return []
    body = _SEGMENT_MARK_RE.split(body)[-1]
    matches = list(_CALL_RE.finditer(body))
    if not matches:
        return []
    group = [matches[0]]
    for prev, cur in zip(matches, matches[1:], strict=False):
        if body.count("\n", prev.end(), cur.start()) >= _GROUP_LINE_GAP:
            group = []
        group.append(cur)
    tidy = str.strip if strip_whitespace else str
    calls = []
    for m in group:
        params = {tidy(key): tidy(value) for key, value in _PARAM_RE.findall(m.group(2))}
        calls.append(FunctionCall(name=tidy(m.group(1)), params=params))
    return calls


def _load_object(text: str) -> object:
    """JSON, else a Python literal, else the same for the outermost ``{…}`` (upstream's tries)."""
    for candidate in (text, *(m.group(0) for m in [_BRACES_RE.search(text)] if m)):
        for load in (json.loads, ast.literal_eval):
            try:
                return load(candidate)
            except Exception:  # model output: anything may fail to parse, nothing may raise
                continue
    return None


def _as_text(value: object) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


def _items(value: object, string_is_one: bool) -> list[object]:
    if isinstance(value, list | tuple):
        return list(value)
    if isinstance(value, str):
        return [value] if string_is_one else list(value)
    return []


def _native_calls(text: str, *, strip_whitespace: bool, string_is_one: bool) -> list[FunctionCall]:
    tidy = str.strip if strip_whitespace else str
    calls: list[FunctionCall] = []
    for kind, body in _NATIVE_RE.findall(text):
        body = body.strip()
        if kind == "answer":
            calls.append(FunctionCall("finish", {"answer": body}))
            continue
        if body.startswith("```") and body.endswith("```"):
            body = _FENCE_RE.sub("", body).strip()
        obj = _load_object(body)
        if not isinstance(obj, dict) or "name" not in obj:
            continue
        name = tidy(str(obj["name"]))
        args = obj.get("arguments", {})
        args = args if isinstance(args, dict) else {}
        if name == "search":
            queries = _items(args.get("query"), string_is_one)
            topk = str(max(NATIVE_SEARCH_TOPK_SHARE // (len(queries) + 1), NATIVE_SEARCH_MIN_TOPK))
            for query in queries:
                params = {"topk": topk} if query is None else {"query": tidy(_as_text(query)), "topk": topk}
                calls.append(FunctionCall("search", params))
        elif name == "visit":
            for url in _items(args.get("url"), string_is_one):
                calls.append(FunctionCall("open_page", {} if url is None else {"url": tidy(_as_text(url))}))
        else:
            params = {tidy(_as_text(k)): tidy(_as_text(v)) for k, v in args.items() if v is not None}
            calls.append(FunctionCall(name, params))
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


def _parse_topk(raw: str | None, default: int, cap: int, zero_is_default: bool) -> int:
    # Upstream: int(v) if str(v).isdigit() else 10. ``isdecimal``: int() refuses some isdigit()
    # characters ("²"), where upstream raises. Capped to the protocol's maximum.
    if raw is None or not raw.isdecimal():
        return default
    digits = raw.lstrip("0")
    value = cap + 1 if len(digits) > 6 else int(digits or "0")
    if value == 0:
        return default if zero_is_default else 0
    return min(value, cap)


def validate_call(
    call: FunctionCall,
    tools: Sequence[str] = WORKER_TOOLS,
    *,
    default_topk: int = DEFAULT_TOPK,
    max_topk: int = MAX_TOPK,
    zero_topk_is_default: bool = True,
) -> Action:
    """Map a parsed call onto the action it asks for, or the error line for the model."""
    if call.name not in tools:
        return CallError(unsupported_function_error(call.name))
    if call.name == "search":
        query = call.get("query") or ""
        if not query:
            return CallError(SEARCH_QUERY_ERROR)
        topk = _parse_topk(call.get("topk"), default_topk, max_topk, zero_topk_is_default)
        return SearchAction(query=query, topk=topk)
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


def render_open_result(
    pages: Sequence[Page],
    docid: str | None,
    url: str | None,
    *,
    page_words: int = PAGE_WORDS,
    report_missing: bool = True,
) -> str:
    """What one open_page call shows; when nothing is found, the not-found line (upstream: an
    empty block, unless ``report_missing`` is False)."""
    if pages or not report_missing:
        return render_open_page(pages, page_words=page_words)
    return page_not_found_error(docid, url)


@dataclass
class TurnObservation:
    """The user message answering one assistant turn, built call by call (upstream ``run_action``)."""

    reflection_nudge: bool = True
    unknown_function_replaces: bool = False
    parts: list[str] = field(default_factory=list)
    alone: str | None = None

    def add(self, block: str) -> None:
        self.parts.append(block)

    def add_unsupported(self, name: str) -> str:
        """The unknown-function line; upstream's way, it replaces what the turn rendered so far."""
        if self.unknown_function_replaces:
            self.parts.clear()
        message = unsupported_function_error(name)
        self.parts.append(message)
        return message

    def stand_alone(self, message: str) -> None:
        """The turn's whole observation is ``message``, without the nudge (no call, resubmit, bounce)."""
        self.alone = message

    def text(self) -> str:
        if self.alone is not None:
            return self.alone.strip()
        return finish_observation(self.parts, reflection_nudge=self.reflection_nudge)


# --- the no-search guard: no search, no reward ---------------------------------------------------

_STOPWORDS = frozenset({"a", "an", "the", "of", "on", "in", "and", "&", "for", "to", "by", "with"})
_PARENTHETICAL_RE = re.compile(r"\s*\([^)]*\)\s*")
_QUOTES_RE = re.compile(r"[“”\"'`]+")
_PUNCTUATION_RE = re.compile(r"[:–—\-_/.,;!()?]+")
_YEAR_RE = re.compile(r"\d{4}")

NoSearchVerdict = Literal["accept", "bounce", "void"]


def _loose_form(text: str) -> str:
    decomposed = unicodedata.normalize("NFKD", text)
    s = "".join(c for c in decomposed if not unicodedata.combining(c)).lower()
    s = _PARENTHETICAL_RE.sub(" ", s)  # "(Egypt)", "(US)": qualifiers
    s = _QUOTES_RE.sub("", s)
    s = _PUNCTUATION_RE.sub(" ", s)
    return " ".join(s.split())


def lenient_match(gold: str, answer: str) -> bool:
    """FoldAgent's lenient exact match (``em_score``), the rule the no-search guard uses.

    After removing accents, case, parentheticals, quotes and punctuation: the same characters;
    or the same content words in any order (articles, short prepositions and four-digit years
    dropped); or, with two words or more each, the same last word and the same first word up to
    a prefix of four letters or more ("Chris Nolan" / "Christopher Nolan"). Upstream's last rule,
    the part before a dash, can no longer differ once punctuation is gone, so it is left out.
    """
    g, a = _loose_form(gold), _loose_form(answer)
    if g.replace(" ", "") == a.replace(" ", ""):
        return True
    gw = [w for w in g.split() if w not in _STOPWORDS and not _YEAR_RE.fullmatch(w)]
    aw = [w for w in a.split() if w not in _STOPWORDS and not _YEAR_RE.fullmatch(w)]
    if not gw or not aw:
        return False
    if Counter(gw) == Counter(aw):
        return True
    if len(gw) >= 2 and len(aw) >= 2 and gw[-1] == aw[-1]:
        first_g, first_a = gw[0], aw[0]
        prefix = min(len(first_g), len(first_a)) >= 4 and (
            first_g.startswith(first_a) or first_a.startswith(first_g)
        )
        return first_g == first_a or prefix
    return False


def no_search_verdict(answer: str, gold: str | None, *, searched: bool, may_bounce: bool) -> NoSearchVerdict:
    """What becomes of a ``finish``: accepted after a search; before any, voided (the answer is
    emptied: no reward), or bounced with :data:`NO_SEARCH_BOUNCE` when it would have been right
    and the episode has not been bounced yet (``may_bounce``)."""
    if searched:
        return "accept"
    if may_bounce and gold and lenient_match(gold, answer):
        return "bounce"
    return "void"


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
