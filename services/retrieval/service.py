"""`bcstack serve retrieval`: the search core behind HTTP (FastAPI) and gRPC.

HTTP, FoldAgent-compatible (DESIGN.md §8):
    POST /search {"query", "k"}            -> {"results": [{"docid", "url", "text", "score"}]}
    POST /open   {"docid" | "url"}         -> {"results": [{"docid", "url", "text"}]}
and the richer
    POST /v1/search {"query", "k", "mode", "window", "snippet_words"}
        -> {"results": [{"docid", "url", "title", "text", "score", "ranks"}], "degraded", ...}
gRPC: bcstack.v1.RetrievalService (Search, BatchSearch, Open), with health and reflection.

Errors: a bad request is 400 / INVALID_ARGUMENT, an unknown page 404 / NOT_FOUND, no retriever
able to answer 503 / UNAVAILABLE, each with a message. Both transports call the same core.

On a lexical-only index (dense none) the embedder is never loaded; hybrid searches serve the
lexical ranking and mode dense is a 400 / INVALID_ARGUMENT (see core.py for why hybrid == lexical).
"""

from __future__ import annotations

from typing import Annotated, Any

import grpc
from annotated_types import Interval
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, ConfigDict, Field

from core.kit.grpc_server import GrpcServer
from core.kit.http import JSON_INTEGER, JsonInt, create_app
from core.kit.metrics import new_registry
from core.v1 import retrieval_pb2, retrieval_pb2_grpc
from services.retrieval.core import (
    MAX_DOCID_CHARS,
    MAX_URL_CHARS,
    MODES,
    Hit,
    InvalidRequest,
    NotFound,
    RetrievalMetrics,
    SearchCore,
    SearchQuery,
    SearchResult,
    Unavailable,
)
from services.retrieval.settings import RetrievalSettings

SERVICE = "retrieval"
_MODES = {
    retrieval_pb2.SEARCH_MODE_HYBRID: "hybrid",
    retrieval_pb2.SEARCH_MODE_LEXICAL: "lexical",
    retrieval_pb2.SEARCH_MODE_DENSE: "dense",
}


# --- HTTP ----------------------------------------------------------------------------------------


# The limits below are documented (`json_schema_extra`), not enforced by validation: the core
# checks them against its settings and answers 400 with its own message, on HTTP and gRPC alike.
# `k` and the query's length are the settings' (`document_settings_limits` writes them in).
def _limits(**schema: Any) -> dict[str, Any]:
    return {"json_schema_extra": schema}


NON_BLANK = r"\S"  # the core strips a query, docid or url: whitespace alone is none


class SearchBody(BaseModel):
    query: str = Field(
        description="a non-blank query of at most max_query_chars", **_limits(minLength=1, pattern=NON_BLANK)
    )
    k: JsonInt = Field(10, description="at most max_k", **_limits(minimum=1, maximum=1000))


# An integer docid is looked up as its decimal text. Its range is I-JSON's interoperable integers
# (RFC 7493 section 2.2: at most 2**53 - 1): past that a client's JSON parser may round it to a
# double, and schema tools do (schemathesis sent 2**63 + 190 as "below 2**63"). The bounds go before
# JSON_INTEGER (core/kit/http.py): after it, the schema carried `ge`/`le`, which are not JSON Schema,
# so the OpenAPI document allowed the negative docids the server refuses.
IntDocid = Annotated[int, Interval(ge=0, le=2**53 - 1), JSON_INTEGER]


class OpenBody(BaseModel):
    """A docid, or else a url: the first that is not blank names the page; each within its length."""

    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {
                    "required": ["docid"],
                    "properties": {
                        "docid": {"anyOf": [{"type": "string", "pattern": NON_BLANK}, {"type": "integer"}]}
                    },
                },
                {"required": ["url"], "properties": {"url": {"type": "string", "pattern": NON_BLANK}}},
            ]
        }
    )

    docid: Annotated[str, Field(max_length=MAX_DOCID_CHARS)] | IntDocid | None = Field(
        None, description="a docid or a url: one of the two"
    )
    url: str | None = Field(None, max_length=MAX_URL_CHARS)


class SearchV1Body(SearchBody):
    mode: str = Field("hybrid", **_limits(enum=list(MODES)))
    window: JsonInt | None = Field(
        None, description="candidates per retriever", **_limits(minimum=1, maximum=1000)
    )
    snippet_words: JsonInt | None = Field(
        None, description="words of text per hit; 0 = full text", **_limits(minimum=0)
    )


def document_settings_limits(schema: dict[str, Any], settings: RetrievalSettings) -> None:
    """The limits of these settings in the OpenAPI document: `k` up to max_k, a query of at most
    max_query_chars characters."""
    for name in ("SearchBody", "SearchV1Body"):
        props = schema["components"]["schemas"][name]["properties"]
        props["k"]["maximum"] = settings.max_k
        props["query"]["maxLength"] = settings.max_query_chars


class Detail(BaseModel):
    detail: str


class FoldAgentHit(BaseModel):
    docid: str
    url: str
    text: str
    score: float


class FoldAgentHits(BaseModel):
    results: list[FoldAgentHit]


class Rank(BaseModel):
    rank: int
    score: float


class HitV1(FoldAgentHit):
    title: str
    ranks: dict[str, Rank]


class SearchV1Response(BaseModel):
    results: list[HitV1]
    degraded: bool
    failed_backends: list[str]
    timings: dict[str, float]


class Page(BaseModel):
    docid: str
    url: str
    text: str


class Pages(BaseModel):
    results: list[Page]


_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "a request the core refuses (empty query, k out of range, ...)", "model": Detail},
    503: {"description": "no retriever (or the doc store) can answer right now", "model": Detail},
}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status)


def _hit_v1(h: Hit) -> dict[str, Any]:
    return {
        "docid": h.docid,
        "url": h.url,
        "title": h.title,
        "text": h.text,
        "score": h.score,
        "ranks": {name: {"rank": r, "score": s} for name, (r, s) in h.ranks.items()},
    }


def build_http_app(core: SearchCore, settings: RetrievalSettings, registry: CollectorRegistry) -> FastAPI:
    app = create_app(SERVICE, settings, registry, health_check=core.health)
    kit_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        schema = kit_openapi()
        document_settings_limits(schema, settings)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]

    async def run_search(q: SearchQuery) -> SearchResult | JSONResponse:
        try:
            return await core.search(q, "http")
        except InvalidRequest as e:
            return _error(400, str(e))
        except Unavailable as e:
            return _error(503, str(e))

    @app.post("/search", responses={200: {"model": FoldAgentHits}, **_ERRORS})
    async def search(body: SearchBody) -> Any:
        result = await run_search(SearchQuery(body.query, body.k))
        if isinstance(result, JSONResponse):
            return result
        return {
            "results": [
                {"docid": h.docid, "url": h.url, "text": h.text, "score": h.score} for h in result.hits
            ]
        }

    @app.post("/v1/search", responses={200: {"model": SearchV1Response}, **_ERRORS})
    async def search_v1(body: SearchV1Body) -> Any:
        result = await run_search(SearchQuery(body.query, body.k, body.mode, body.window, body.snippet_words))
        if isinstance(result, JSONResponse):
            return result
        return {
            "results": [_hit_v1(h) for h in result.hits],
            "degraded": result.degraded,
            "failed_backends": result.failed_backends,
            "timings": result.timings,
        }

    @app.post(
        "/open",
        responses={200: {"model": Pages}, 404: {"description": "no such page", "model": Detail}, **_ERRORS},
    )
    async def open_page(body: OpenBody) -> Any:
        try:
            doc = await core.open(None if body.docid is None else str(body.docid), body.url, "http")
        except InvalidRequest as e:
            return _error(400, str(e))
        except NotFound as e:
            return _error(404, str(e))
        except Unavailable as e:
            return _error(503, str(e))
        return {"results": [{"docid": doc.docid, "url": doc.url, "text": doc.text}]}

    return app


# --- gRPC ----------------------------------------------------------------------------------------


def _response(result: SearchResult) -> retrieval_pb2.SearchResponse:
    hits = []
    for h in result.hits:
        lex = h.ranks.get("lexical", (0, 0.0))
        dense = h.ranks.get("dense", (0, 0.0))
        hits.append(
            retrieval_pb2.SearchHit(
                docid=h.docid,
                url=h.url,
                title=h.title,
                text=h.text,
                score=h.score,
                lexical_rank=lex[0],
                lexical_score=lex[1],
                dense_rank=dense[0],
                dense_score=dense[1],
            )
        )
    t = result.timings
    timings = retrieval_pb2.SearchTimings(
        lexical_seconds=t.get("lexical", 0.0),
        embed_seconds=t.get("embed", 0.0),
        dense_seconds=t.get("dense", 0.0),
        fuse_seconds=t.get("fuse", 0.0),
        fetch_seconds=t.get("fetch", 0.0),
        total_seconds=t.get("total", 0.0),
    )
    return retrieval_pb2.SearchResponse(
        hits=hits,
        degraded=result.degraded,
        degraded_backend=",".join(result.failed_backends),
        timings=timings,
    )


def _query(req: retrieval_pb2.SearchRequest) -> SearchQuery:
    return SearchQuery(
        query=req.query,
        k=req.k or 10,
        mode=_MODES.get(req.mode, f"unknown({req.mode})"),
        window=req.window if req.HasField("window") else None,
        snippet_words=req.snippet_words if req.HasField("snippet_words") else None,
    )


class RetrievalServicer(retrieval_pb2_grpc.RetrievalServiceServicer):
    def __init__(self, core: SearchCore) -> None:
        self.core = core

    async def _guard(self, context: grpc.aio.ServicerContext, coro: Any) -> Any:
        try:
            return await coro
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except NotFound as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except Unavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    async def Search(self, request, context):  # noqa: N802 - gRPC method name
        result = await self._guard(context, self.core.search(_query(request), "grpc"))
        return _response(result)

    async def BatchSearch(self, request, context):  # noqa: N802
        results = await self._guard(
            context, self.core.search_many([_query(r) for r in request.requests], "grpc")
        )
        return retrieval_pb2.BatchSearchResponse(responses=[_response(r) for r in results])

    async def Open(self, request, context):  # noqa: N802
        target = request.WhichOneof("target")
        doc = await self._guard(
            context,
            self.core.open(
                request.docid if target == "docid" else None, request.url if target == "url" else None, "grpc"
            ),
        )
        return retrieval_pb2.OpenResponse(docid=doc.docid, url=doc.url, text=doc.text, title=doc.title)


# --- process -------------------------------------------------------------------------------------


def build(settings: RetrievalSettings) -> tuple[FastAPI, GrpcServer | None, SearchCore]:
    """Open the index and build both transports on one registry (what `bcstack serve retrieval` runs)."""
    from services.retrieval.index import open_index

    registry = new_registry()
    core = SearchCore(open_index(settings), settings, RetrievalMetrics(registry))
    app = build_http_app(core, settings, registry)
    server = None
    if settings.grpc_port is not None:
        server = GrpcServer(SERVICE, settings, registry)
        server.add(retrieval_pb2_grpc.add_RetrievalServiceServicer_to_server, RetrievalServicer(core))
    return app, server, core
