"""Reciprocal rank fusion (Cormack, Clarke & Büttcher, SIGIR 2009).

    score(d) = Σ_r 1 / (k + rank_r(d))

over the retrievers r that returned d within their first ``window`` results, with 1-based
ranks. k = 60 is the paper's constant and the default of pyserini and Elasticsearch
(``retriever.rrf.rank_constant``); note that Qdrant's built-in ``Fusion.RRF`` uses k = 2, so
fusing there would not match BrowseComp-Plus' hybrid numbers. Ties break by docid so the order
is deterministic.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from services.retrieval.backends import Ranked

RRF_K = 60
RRF_WINDOW = 50


@dataclass(frozen=True)
class RetrieverRank:
    rank: int  # 1-based position in that retriever's list
    score: float  # the retriever's own score (BM25, cosine)


@dataclass(frozen=True)
class FusedHit:
    docid: str
    score: float
    ranks: dict[str, RetrieverRank] = field(default_factory=dict)


def rrf_fuse(
    rankings: Mapping[str, Ranked], *, k: int = RRF_K, window: int = RRF_WINDOW, limit: int | None = None
) -> list[FusedHit]:
    """Fuse best-first (docid, score) lists by RRF; at most ``limit`` hits."""
    if k < 0:
        raise ValueError("k must be >= 0")
    if window < 1:
        raise ValueError("window must be >= 1")
    scores: dict[str, float] = {}
    ranks: dict[str, dict[str, RetrieverRank]] = {}
    for name, ranked in rankings.items():
        seen: set[str] = set()
        rank = 0
        for docid, score in ranked:
            if docid in seen:  # a retriever listing a doc twice counts its best rank only
                continue
            seen.add(docid)
            rank += 1
            if rank > window:
                break
            scores[docid] = scores.get(docid, 0.0) + 1.0 / (k + rank)
            ranks.setdefault(docid, {})[name] = RetrieverRank(rank, score)
    order = sorted(scores, key=lambda d: (-scores[d], d))
    if limit is not None:
        order = order[:limit]
    return [FusedHit(d, scores[d], ranks[d]) for d in order]


def single_ranking(name: str, ranked: Ranked, *, limit: int) -> list[FusedHit]:
    """One retriever's list in the fused shape (mode lexical or dense): its own scores, its order."""
    return [FusedHit(d, s, {name: RetrieverRank(i, s)}) for i, (d, s) in enumerate(ranked[:limit], 1)]
