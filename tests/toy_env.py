"""An in-memory tool environment for testing scripted policies before the real services exist.

``ToyRetrieval`` is a test double for the retrieval service (plain BM25 over the toy corpus, k1
0.9, b 0.4); ``run_worker_episode`` plays a worker policy through the real protocol module:
parse calls, validate, run the tools, render observations. The production episode runner
(worker service) replaces this loop; the observation strings are the same functions.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from core import protocol as p

_TOKEN = re.compile(r"[a-z0-9]+")


def tokenize(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


class ToyRetrieval:
    def __init__(self, corpus: Sequence[dict], k1: float = 0.9, b: float = 0.4) -> None:
        self.docs = {d["docid"]: p.Page(d["docid"], d["url"], d["text"]) for d in corpus}
        self.by_url = {d["url"]: d["docid"] for d in corpus}
        self.k1, self.b = k1, b
        self.postings: dict[str, list[tuple[str, int]]] = defaultdict(list)
        self.lengths: dict[str, int] = {}
        for d in corpus:
            toks = tokenize(d["text"])
            self.lengths[d["docid"]] = len(toks)
            for term, tf in Counter(toks).items():
                self.postings[term].append((d["docid"], tf))
        self.avgdl = sum(self.lengths.values()) / max(1, len(self.lengths))

    def search(self, query: str, k: int = 50) -> list[p.Page]:
        n = len(self.lengths)
        scores: dict[str, float] = defaultdict(float)
        for term in set(tokenize(query)):
            plist = self.postings.get(term, [])
            idf = math.log(1 + (n - len(plist) + 0.5) / (len(plist) + 0.5))
            for docid, tf in plist:
                norm = tf + self.k1 * (1 - self.b + self.b * self.lengths[docid] / self.avgdl)
                scores[docid] += idf * tf * (self.k1 + 1) / norm
        ranked = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
        return [self.docs[d] for d, _ in ranked]

    def open(self, docid: str | None, url: str | None) -> list[p.Page]:
        if docid and docid in self.docs:
            return [self.docs[docid]]
        if url and url in self.by_url:
            return [self.docs[self.by_url[url]]]
        return []


@dataclass
class Episode:
    messages: list[dict]
    finish: p.FinishAction | None = None
    turns: int = 0
    tool_calls: Counter = field(default_factory=Counter)


def run_worker_episode(
    policy: Callable[[list[dict]], str], task: str, env: ToyRetrieval, max_turns: int = 40
) -> Episode:
    ep = Episode(
        [{"role": "system", "content": "You are a research worker."}, {"role": "user", "content": task}]
    )
    seen: set[str] = set()
    while ep.turns < max_turns:
        reply = policy(ep.messages)
        ep.turns += 1
        ep.messages.append({"role": "assistant", "content": reply})
        calls = p.parse_calls(reply)
        if not calls:
            ep.messages.append({"role": "user", "content": p.NO_CALL_ERROR})
            continue
        parts = []
        for call in calls:
            action = p.validate_call(call)
            ep.tool_calls[call.name] += 1
            if isinstance(action, p.FinishAction):
                ep.finish = action
                return ep
            if isinstance(action, p.SearchAction):
                parts.append(
                    p.render_search_results(action.query, env.search(action.query), seen, action.topk)
                )
            elif isinstance(action, p.OpenPageAction):
                pages = env.open(action.docid, action.url)
                parts.append(
                    p.render_open_page(pages) if pages else p.page_not_found_error(action.docid, action.url)
                )
            elif isinstance(action, p.CallError):
                parts.append(action.message)
        ep.messages.append({"role": "user", "content": p.finish_observation(parts)})
    return ep
