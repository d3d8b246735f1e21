"""The search core both transports share: validate, retrieve, fuse, fetch snippets, measure.

One hybrid search runs the lexical lookup and (embed the query → dense lookup) concurrently.
Index lookups run on a small thread pool so the event loop never blocks; query embeddings go
through a micro-batcher, because embedding dominates the cost of a hybrid search and
concurrent queries share one forward pass (as the FoldAgent search server does on GPU).

A retriever that fails or exceeds ``backend_timeout_seconds`` drops out of a hybrid search:
the other one's results are served, flagged ``degraded``, and counted. A single-retriever
search whose retriever fails, or a hybrid search that loses both, is :class:`Unavailable`.

A lexical-only index (built or served with dense ``none``) has one retriever. Mode hybrid then
serves the lexical ranking, as mode lexical does: RRF over a single ranking scores each document
1/(k + rank), which is strictly decreasing in rank, so fusion is the identity on that ranking's
order and only renames its scores; we keep the BM25 scores so that hybrid == lexical exactly
(and a client switching modes sees no difference). Such a search is not ``degraded``: nothing
failed. Mode dense is a client error (400 / INVALID_ARGUMENT) saying the index has no dense part.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.retrieval.backends import BackendUnavailable, Doc, Ranked
from services.retrieval.fusion import FusedHit, rrf_fuse, single_ranking
from services.retrieval.index import OpenedIndex
from services.retrieval.settings import RetrievalSettings

MODES = ("hybrid", "lexical", "dense")
T = TypeVar("T")

# Retrieval latencies sit between ~0.2 ms (an Edge lookup) and seconds (a slow remote backend).
STAGE_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0,
)  # fmt: skip


MAX_DOCID_CHARS = 512
MAX_URL_CHARS = 4096


class InvalidRequest(ValueError):
    """A request the caller got wrong: HTTP 400 / INVALID_ARGUMENT."""


class NotFound(LookupError):
    """No such document: HTTP 404 / NOT_FOUND."""


class Unavailable(RuntimeError):
    """No retriever could answer: HTTP 503 / UNAVAILABLE."""


@dataclass(frozen=True)
class SearchQuery:
    query: str
    k: int = 10
    mode: str = "hybrid"
    window: int | None = None
    snippet_words: int | None = None


@dataclass(frozen=True)
class Hit:
    docid: str
    url: str
    title: str
    text: str
    score: float
    ranks: dict[str, tuple[int, float]]  # retriever -> (1-based rank, its score)


@dataclass
class SearchResult:
    hits: list[Hit]
    degraded: bool = False
    failed_backends: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # stage -> seconds


class RetrievalMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.stage = Histogram(
            "bcstack_retrieval_stage_seconds",
            "Time spent per search stage (embed, lexical, dense, fuse, fetch, total).",
            ["stage"],
            buckets=STAGE_BUCKETS,
            registry=registry,
        )
        self.searches = Counter(
            "bcstack_retrieval_searches_total",
            "Searches by transport, mode and outcome (ok, degraded, invalid, unavailable, error).",
            ["transport", "mode", "outcome"],
            registry=registry,
        )
        self.opens = Counter(
            "bcstack_retrieval_opens_total",
            "open_page lookups by transport and outcome (ok, not_found, invalid, error).",
            ["transport", "outcome"],
            registry=registry,
        )
        self.backend_failures = Counter(
            "bcstack_retrieval_backend_failures_total",
            "Retriever calls that failed, by backend and kind (unavailable, timeout).",
            ["backend", "kind"],
            registry=registry,
        )
        self.embed_batch = Histogram(
            "bcstack_retrieval_embed_batch_queries",
            "Queries embedded together in one micro-batch.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=registry,
        )
        self.documents = Gauge(
            "bcstack_retrieval_documents", "Documents in the served index.", registry=registry
        )


class SearchCore:
    def __init__(self, index: OpenedIndex, settings: RetrievalSettings, metrics: RetrievalMetrics) -> None:
        self.index = index
        self.settings = settings
        self.metrics = metrics
        self.pool = ThreadPoolExecutor(settings.search_threads, thread_name_prefix="retrieval")
        self.embedder = None
        self.retrievers: tuple[str, ...] = ("lexical",)
        if index.dense is not None and index.embedder is not None:
            from services.retrieval.embedder import MicroBatchingEmbedder

            self.embedder = MicroBatchingEmbedder(
                index.embedder,
                max_batch=settings.embed_batch_size,
                max_wait_ms=settings.embed_max_wait_ms,
                on_batch=metrics.embed_batch.observe,
            )
            self.retrievers = ("lexical", "dense")
        metrics.documents.set(index.store.count())

    # -- helpers --------------------------------------------------------------------------------
    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def _timed(self, stage: str, timings: dict[str, float], work: Awaitable[T]) -> T:
        start = time.perf_counter()
        try:
            return await work
        finally:
            timings[stage] = time.perf_counter() - start
            self.metrics.stage.labels(stage).observe(timings[stage])

    async def _guarded(self, backend: str, work: Awaitable[T]) -> T:
        try:
            return await asyncio.wait_for(work, self.settings.backend_timeout_seconds)
        except TimeoutError:
            self.metrics.backend_failures.labels(backend, "timeout").inc()
            raise BackendUnavailable(
                f"{backend} did not answer within {self.settings.backend_timeout_seconds:g}s"
            ) from None
        except BackendUnavailable:
            self.metrics.backend_failures.labels(backend, "unavailable").inc()
            raise

    def validate(self, q: SearchQuery) -> SearchQuery:
        s = self.settings
        if not isinstance(q.query, str) or not q.query.strip():
            raise InvalidRequest("query must be a non-empty string")
        if len(q.query) > s.max_query_chars:
            raise InvalidRequest(f"query is {len(q.query)} characters; the limit is {s.max_query_chars}")
        if not 1 <= q.k <= s.max_k:
            raise InvalidRequest(f"k must be between 1 and {s.max_k}, got {q.k}")
        if q.mode not in MODES:
            raise InvalidRequest(f"mode must be one of {', '.join(MODES)}, got {q.mode!r}")
        if q.mode == "dense" and "dense" not in self.retrievers:
            raise InvalidRequest(
                "mode dense is not available: this index is lexical only (dense backend none); "
                "use mode lexical or hybrid"
            )
        if q.window is not None and not 1 <= q.window <= 1000:
            raise InvalidRequest(f"window must be between 1 and 1000, got {q.window}")
        if q.snippet_words is not None and q.snippet_words < 0:
            raise InvalidRequest("snippet_words must be >= 0")
        return q

    # -- search ---------------------------------------------------------------------------------
    async def _lexical(self, query: str, n: int, timings: dict[str, float]) -> Ranked:
        return await self._guarded(
            "lexical", self._timed("lexical", timings, self._in_thread(self.index.lexical.search, query, n))
        )

    async def _dense(self, query: str, n: int, timings: dict[str, float]) -> Ranked:
        async def run() -> Ranked:
            vector = await self._timed("embed", timings, self.embedder.embed_query(query))
            (ranked,) = await self._timed(
                "dense", timings, self._in_thread(self.index.dense.search, vector.reshape(1, -1), n)
            )
            return ranked

        return await self._guarded("dense", run())

    async def search(self, q: SearchQuery, transport: str = "http") -> SearchResult:
        try:
            q = self.validate(q)
        except InvalidRequest:
            self.metrics.searches.labels(transport, str(q.mode)[:16], "invalid").inc()
            raise
        start = time.perf_counter()
        timings: dict[str, float] = {}
        window = max(q.k, q.window or self.settings.rrf_window)
        wanted = self.retrievers if q.mode == "hybrid" else (q.mode,)
        calls = {"lexical": self._lexical, "dense": self._dense}
        results = await asyncio.gather(
            *(calls[name](q.query, window, timings) for name in wanted), return_exceptions=True
        )
        rankings: dict[str, Ranked] = {}
        failed: list[str] = []
        for name, result in zip(wanted, results, strict=True):
            if isinstance(result, BackendUnavailable):
                failed.append(name)
            elif isinstance(result, BaseException):
                self.metrics.searches.labels(transport, q.mode, "error").inc()
                raise result
            else:
                rankings[name] = result
        if not rankings:
            self.metrics.searches.labels(transport, q.mode, "unavailable").inc()
            reasons = "; ".join(f"{n}: {r}" for n, r in zip(wanted, results, strict=True))
            raise Unavailable(f"no retriever answered ({reasons})")
        fuse_start = time.perf_counter()
        if len(rankings) == 2:
            fused = rrf_fuse(rankings, k=self.settings.rrf_k, window=window, limit=q.k)
        else:
            ((name, ranked),) = rankings.items()
            fused = single_ranking(name, ranked, limit=q.k)
        timings["fuse"] = time.perf_counter() - fuse_start
        self.metrics.stage.labels("fuse").observe(timings["fuse"])
        hits = await self._timed("fetch", timings, self._in_thread(self._hits, fused, q.snippet_words))
        timings["total"] = time.perf_counter() - start
        self.metrics.stage.labels("total").observe(timings["total"])
        degraded = bool(failed)
        self.metrics.searches.labels(transport, q.mode, "degraded" if degraded else "ok").inc()
        return SearchResult(hits, degraded, failed, timings)

    def _hits(self, fused: list[FusedHit], snippet_words: int | None) -> list[Hit]:
        words = self.settings.snippet_words if snippet_words is None else snippet_words
        docs = self.index.pages.get_many([h.docid for h in fused])
        hits = []
        for h in fused:
            doc = docs.get(h.docid)
            if doc is None:  # in an index but not in the doc store: skip rather than show an empty page
                continue
            text = " ".join(doc.text.split()[:words]) if words else doc.text
            ranks = {name: (r.rank, r.score) for name, r in h.ranks.items()}
            hits.append(Hit(doc.docid, doc.url, doc.title, text, h.score, ranks))
        return hits

    async def search_many(self, queries: list[SearchQuery], transport: str = "grpc") -> list[SearchResult]:
        if len(queries) > self.settings.max_batch_queries:
            raise InvalidRequest(
                f"{len(queries)} queries in one batch; the limit is {self.settings.max_batch_queries}"
            )
        return list(await asyncio.gather(*(self.search(q, transport) for q in queries)))

    # -- open_page ------------------------------------------------------------------------------
    async def open(self, docid: str | None, url: str | None, transport: str = "http") -> Doc:
        # The lengths as sent (what the OpenAPI document's maxLength means), then the stripped values.
        if len(docid or "") > MAX_DOCID_CHARS or len(url or "") > MAX_URL_CHARS:
            self.metrics.opens.labels(transport, "invalid").inc()
            raise InvalidRequest("docid or url too long")
        docid = (docid or "").strip() or None
        url = (url or "").strip() or None
        if not docid and not url:
            self.metrics.opens.labels(transport, "invalid").inc()
            raise InvalidRequest("give a docid or a url")
        try:
            doc = await self._guarded(
                "docstore",
                self._in_thread(self.index.pages.get, docid)
                if docid
                else self._in_thread(self.index.pages.get_by_url, url),
            )
        except BackendUnavailable as e:
            self.metrics.opens.labels(transport, "error").inc()
            raise Unavailable(str(e)) from None
        if doc is None:
            self.metrics.opens.labels(transport, "not_found").inc()
            raise NotFound(f"no document with docid {docid!r}" if docid else f"no document with url {url!r}")
        self.metrics.opens.labels(transport, "ok").inc()
        return doc

    def health(self) -> dict[str, Any]:
        return {
            "documents": self.index.store.count(),
            "manifest": {k: self.index.manifest.get(k) for k in ("lexical", "dense", "embedder")},
            "retrievers": list(self.retrievers),
        }

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.index.close()
