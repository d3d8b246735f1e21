"""Scripted policies for the toy world: an expert worker and a scripted coordinator.

Both are pure functions of the conversation so far (a list of ``{"role", "content"}`` messages)
returning the next assistant message, written in the real protocol (DESIGN.md §3). They know the
toy world's grammar (:mod:`devkit.toyworld.grammar`) but nothing else: the expert learns facts
only from the observations the tools returned, so it exercises search, open_page and finish
exactly as a model would. Later services serve them behind the real wire APIs: the expert as a
reference worker engine, the coordinator as the stand-in coordinator LLM.

Expert, each turn, from scratch:
1. find the question in the task and the relation chain it asks for;
2. replay the observations: every opened page (by title) and every search hit (by title);
3. walk the chain from its start page: a page already opened gives the next title; a title seen
   in search results is opened next; otherwise search for it (another wording if that query was
   already tried);
4. when the chain ends, finish with the answer and the evidence docids cited.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from core import protocol as p
from devkit.toyworld import grammar as g

Message = dict[str, str]
MAX_QUERIES_PER_TITLE = 3
EXPERT_TOPK = 5


def _call(name: str, **params: str) -> str:
    return p.render_call(p.FunctionCall(name, dict(params)))


def _say(thought: str, calls: str) -> str:
    return f"<think>\n{thought}\n</think>\n\n{calls}"


@dataclass
class _Knowledge:
    pages: dict[str, p.Page]  # title → opened page
    hits: dict[str, str]  # title → docid, from search results
    queries: list[str]  # every query already sent
    snippets: dict[str, str]  # title → the longest snippet shown for it


def _replay(messages: Sequence[Message]) -> _Knowledge:
    know = _Knowledge({}, {}, [], {})
    for m in messages:
        if m.get("role") == "assistant":
            for call in p.parse_calls(m.get("content", "")):
                if call.name == "search" and call.get("query"):
                    know.queries.append(call.params["query"])
        elif m.get("role") in ("user", "tool"):
            obs = p.parse_observation(m.get("content", ""))
            for page in obs.pages:
                title = g.doc_title(page.text)
                if title:
                    know.pages[title] = page
            for hit in obs.hits:
                title = g.doc_title(hit.content)
                if title:
                    know.hits.setdefault(title, hit.docid)
                    if len(hit.content) > len(know.snippets.get(title, "")):
                        know.snippets[title] = hit.content
    return know


# The kind of page each relation leads to, so the expert can word its searches for it.
_LEADS_TO = {"birth_city": "city", "city": "city", "institution": "institution"}


def _queries_for(title: str, kind: str, copyable: bool = False) -> list[str]:
    if kind == "person":
        name, profession = title[:-1].rsplit(" (", 1)
        first = f"{profession} {name}" if copyable else f"{name} {profession}"
        return [first, f'"{name}" {profession} born studied', name]
    if kind == "city":
        if copyable:
            return [f"city of {title} province population", f"{title} city", title]
        return [f"{title} city province population", f"{title} city", title]
    return [f"the {title}" if copyable else title, f'"{title}"', f"{title} history"]


def expert_worker_policy(messages: Sequence[Message], *, read_snippets: bool = False) -> str:
    """The next worker turn for a toy-world task, using only the tool protocol.

    With `read_snippets` (the `expert-snippets` engine policy) the expert is one a small model can
    imitate: it takes a fact from a search hit's snippet when the snippet states it (opening the page
    only when it does not), and it writes every name as the question and the pages write it, after a
    space (queries like "chemist Tovax Meitrer", thoughts like "the page of Tovax Meitrer (chemist)"),
    and its first search is the question itself, so the tokens it writes are the tokens it read:
    copying is the whole skill.
    """
    question = None
    asked = ""
    for m in messages:
        if m.get("role") == "user":
            question = g.parse_question(m.get("content", ""))
            if question:
                asked = _question_sentence(m.get("content", ""))
                break
    if question is None:
        return _say(
            "The task is not a question I know how to research.",
            _call(
                "finish", answer="unknown", explanation="The task could not be understood.", confidence="0%"
            ),
        )
    know = _replay(messages)
    title, kind = question.start_title, question.template.start
    cited: list[tuple[str, str]] = []
    answer: g.Ref | None = None
    for step, relation in enumerate(question.template.chain):
        page = know.pages.get(title)
        if page is None and read_snippets and title in know.snippets:
            ref = g.read_relation(title, know.snippets[title], relation)
            if ref is not None:
                page = p.Page(know.hits[title], "", know.snippets[title])
        if page is None:
            if read_snippets and title in know.hits:
                return _say(
                    f"Step {step + 1}: the page of {title} is in the results; opening it.",
                    _call("open_page", docid=know.hits[title]),
                )
            if title in know.hits:
                return _say(
                    f"Step {step + 1}: the page '{title}' is in the results; opening it.",
                    _call("open_page", docid=know.hits[title]),
                )
            queries = _queries_for(title, kind, copyable=read_snippets)
            if read_snippets and step == 0 and asked:
                # The question itself first: its words are all in the context, so the query is a copy.
                queries = [asked, *queries]
            tried = [q for q in queries if q in know.queries]
            fresh = [q for q in queries if q not in know.queries]
            if not fresh or len(tried) >= MAX_QUERIES_PER_TITLE:
                return _say(
                    f"I could not find the page '{title}'.",
                    _call(
                        "finish",
                        answer="unknown",
                        explanation=f"No page for {title} was found. " + _cite(cited),
                        confidence="0%",
                    ),
                )
            if read_snippets and fresh[0] == asked:
                thought = "Step 1: searching for the question."
            elif read_snippets:
                thought = f"Step {step + 1}: I need the page of {title}; searching for it."
            else:
                thought = f"Step {step + 1}: I need the page '{title}'; searching for it."
            return _say(
                thought,
                _call("search", query=fresh[0], topk=str(EXPERT_TOPK)),
            )
        cited.append((title, page.docid))
        ref = g.read_relation(title, page.text, relation)
        if ref is None:
            return _say(
                f"The page '{title}' does not state the {relation}.",
                _call("finish", answer="unknown", explanation=_cite(cited), confidence="0%"),
            )
        answer, title = ref, ref.title
        kind = "person" if title.endswith(")") else _LEADS_TO.get(relation, "other")
    assert answer is not None
    if read_snippets:
        # Quote the sentence the answer comes from, and write the answer after a space: both put the
        # answer's tokens in the context exactly as they will be written (a tokenizer spells " Zequom"
        # and "Zequom" differently; the worker strips the space from a parameter value).
        last_title, last_docid = cited[-1]
        source = know.pages.get(last_title)
        text = source.text if source is not None else know.snippets.get(last_title, "")
        evidence = _sentence_with(text, answer.label)
        return _say(
            f"I have followed every step of the question. {evidence}".strip(),
            _call("finish", answer=f" {answer.label}", explanation=_cite(cited), confidence="95%"),
        )
    return _say(
        "I have followed every step of the question; finishing.",
        _call("finish", answer=answer.label, explanation=_cite(cited), confidence="95%"),
    )


def _sentence_with(text: str, value: str) -> str:
    """The first sentence of a page or snippet that states `value`."""
    body = g.normalize(text).split("---")[-1]
    for sentence in body.replace("\n", " ").split(". "):
        if value in sentence:
            return sentence.strip().rstrip(".") + "."
    return ""


def _cite(cited: list[tuple[str, str]]) -> str:
    if not cited:
        return "No evidence was found."
    return "Evidence: " + "; ".join(f"{title} [{docid}]" for title, docid in cited) + "."


# --- coordinator ---------------------------------------------------------------------------------

WORKER_TASK_TEMPLATE = (
    "Research the following question with the search and open_page tools, then call finish with "
    "the exact answer, an explanation citing [docid]s, and your confidence.\n\nQuestion: {question}"
)


def scripted_coordinator_policy(messages: Sequence[Message], *, fanout: int = 1, max_rounds: int = 2) -> str:
    """The next coordinator turn: branch the question to ``fanout`` workers, then finish.

    The answer is the most common answer among finished reports (ties: the first reported).
    Workers that did not finish are retried, at most ``max_rounds`` rounds of branching in all.
    """
    question_text = ""
    for m in messages:
        if m.get("role") == "user" and not m.get("content", "").lstrip().startswith(p.REPORT_HEADER):
            question_text = m.get("content", "")
            break
    parsed = g.parse_question(question_text)
    question = parsed and _question_sentence(question_text) or question_text.strip()
    rounds = sum(
        1
        for m in messages
        if m.get("role") == "assistant"
        and any(c.name == "branch" for c in p.parse_calls(m.get("content", "")))
    )
    reports = [
        r for m in messages if m.get("role") == "user" for r in p.parse_worker_reports(m.get("content", ""))
    ]
    answers = [r for r in reports if r.status == "finish" and r.answer and r.answer != "unknown"]
    if answers:
        counts: dict[str, int] = {}
        for r in answers:
            counts[r.answer] = counts.get(r.answer, 0) + 1
        best = max(counts, key=lambda a: (counts[a], -[r.answer for r in answers].index(a)))
        chosen = next(r for r in answers if r.answer == best)
        return _say(
            f"{counts[best]} of {len(reports)} worker report(s) agree on the answer.",
            _call(
                "finish",
                answer=best,
                explanation=f"A worker researched the question. {chosen.explanation}",
                confidence=chosen.confidence or "50%",
            ),
        )
    if rounds >= max_rounds:
        return _say(
            "No worker found an answer.",
            _call(
                "finish", answer="unknown", explanation="No worker report gave an answer.", confidence="0%"
            ),
        )
    task = WORKER_TASK_TEMPLATE.format(question=question)
    calls = "\n".join(
        _call("branch", description=f"Answer the question (worker {i + 1})", prompt=task)
        for i in range(fanout)
    )
    thought = "I will delegate the research to a worker." if fanout == 1 else f"I will ask {fanout} workers."
    return _say(thought, calls)


def _question_sentence(text: str) -> str:
    """The question itself when the user message wraps it in instructions."""
    for line in text.splitlines():
        if g.parse_question(line):
            return line.strip().removeprefix("Question:").strip()
    return text.strip()
