"""Backends failing under a running search core: the Elasticsearch mode against a real
osmem-server that is killed mid-test, a dense backend that hangs, and both at once.

The core and the HTTP app run in-process (the ASGI app over httpx) so the test can hold the
backends; the same code serves `bcstack serve retrieval`.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from osmem_util import CLIENT_OPTIONS, osmem_server

from core.kit.metrics import new_registry
from devkit.toyworld.generator import generate_world
from services.retrieval.core import RetrievalMetrics, SearchCore, SearchQuery, Unavailable
from services.retrieval.embedder import HashingEmbedder
from services.retrieval.index import ingest, open_index
from services.retrieval.lexical import ElasticsearchLexical
from services.retrieval.service import build_http_app
from services.retrieval.settings import RetrievalSettings

N_DOCS = 300


class SlowDense:
    """Wraps a dense index; ``delay`` seconds before each search (a hung backend)."""

    def __init__(self, inner, delay: float) -> None:
        self.inner, self.delay = inner, delay
        self.name, self.dim = inner.name, inner.dim

    def search(self, vectors, k):
        time.sleep(self.delay)
        return self.inner.search(vectors, k)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def es_world(tmp_path_factory):
    """A toy corpus indexed in Elasticsearch mode (texts in osmem, vectors in Qdrant Edge)."""
    world = generate_world(1500, 3, questions_per_tier=5, train_medium=0, train_hard=0)
    tmp = tmp_path_factory.mktemp("es")
    corpus = tmp / "corpus.jsonl"
    import json

    corpus.write_text("".join(json.dumps(d) + "\n" for d in world.corpus[:N_DOCS]))
    handle: list = []
    with osmem_server(handle) as url:
        settings = RetrievalSettings(
            index_dir=tmp / "idx",
            lexical="elasticsearch",
            elasticsearch_url=url,
            elasticsearch_index="degraded",
            backend_timeout_seconds=1.0,
        )
        es = ElasticsearchLexical(url, "degraded", request_timeout=1.0, client_options=CLIENT_OPTIONS)
        report = ingest(corpus, settings.index_dir, settings, embedder=HashingEmbedder(64), lexical=es)
        assert report.total == N_DOCS
        yield {"settings": settings, "url": url, "server": handle[0], "docs": world.corpus[:N_DOCS]}


def _core(settings: RetrievalSettings, dense_delay: float = 0.0) -> SearchCore:
    es = ElasticsearchLexical(
        settings.elasticsearch_url,
        settings.elasticsearch_index,
        request_timeout=1.0,
        client_options=CLIENT_OPTIONS,
    )
    index = open_index(settings, embedder=HashingEmbedder(64), lexical=es)
    if dense_delay:
        index.dense = SlowDense(index.dense, dense_delay)
    return SearchCore(index, settings, RetrievalMetrics(new_registry()))


async def _post(app, path: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        return await client.post(path, json=body)


def test_elasticsearch_mode_then_lexical_down_then_both_down(es_world):
    settings = es_world["settings"]
    core = _core(settings)
    app = build_http_app(core, settings, new_registry())
    doc = es_world["docs"][7]
    title = doc["text"].split("\n")[1].removeprefix("title: ")

    async def scenario() -> None:
        # Healthy: hybrid, pages come from Elasticsearch's _source.
        ok = (await _post(app, "/v1/search", {"query": title, "k": 5})).json()
        assert ok["degraded"] is False and any(set(h["ranks"]) == {"lexical", "dense"} for h in ok["results"])
        lexical = (await _post(app, "/v1/search", {"query": title, "k": 5, "mode": "lexical"})).json()
        assert lexical["results"][0]["docid"] == doc["docid"]  # BM25 from Elasticsearch
        page = (await _post(app, "/open", {"docid": doc["docid"]})).json()
        assert page["results"][0]["text"] == doc["text"]

        es_world["server"].close()  # Elasticsearch goes away

        down = await _post(app, "/v1/search", {"query": title, "k": 5})
        body = down.json()
        assert down.status_code == 200 and body["degraded"] is True and body["failed_backends"] == ["lexical"]
        assert body["results"] and all(set(h["ranks"]) == {"dense"} for h in body["results"])
        only_lexical = await _post(app, "/v1/search", {"query": title, "k": 5, "mode": "lexical"})
        assert only_lexical.status_code == 503 and "lexical" in only_lexical.json()["detail"]
        page = await _post(app, "/open", {"docid": doc["docid"]})  # from the local doc store now
        assert page.status_code == 200 and page.json()["results"][0]["text"] == doc["text"]

    asyncio.run(scenario())
    failures = core.metrics.backend_failures.labels("lexical", "unavailable")._value.get()
    assert failures >= 2
    assert core.metrics.searches.labels("http", "hybrid", "degraded")._value.get() == 1
    core.close()

    # Both down: lexical is dead and dense hangs past the timeout.
    slow = _core(settings, dense_delay=3.0)

    async def both() -> None:
        t0 = time.perf_counter()
        with pytest.raises(Unavailable, match="no retriever answered"):
            await slow.search(SearchQuery(title, 5))
        assert time.perf_counter() - t0 < 2.5  # the 1 s backend timeout, not the 3 s hang

    asyncio.run(both())
    assert slow.metrics.backend_failures.labels("dense", "timeout")._value.get() == 1
    slow.close()


def test_hung_dense_backend_degrades_to_lexical(tmp_path):
    world = generate_world(1500, 4, questions_per_tier=5, train_medium=0, train_hard=0)
    corpus = tmp_path / "corpus.jsonl"
    import json

    corpus.write_text("".join(json.dumps(d) + "\n" for d in world.corpus[:N_DOCS]))
    settings = RetrievalSettings(index_dir=tmp_path / "idx", backend_timeout_seconds=0.5)
    ingest(corpus, settings.index_dir, settings, embedder=HashingEmbedder(64))
    index = open_index(settings, embedder=HashingEmbedder(64))
    index.dense = SlowDense(index.dense, 2.0)
    core = SearchCore(index, settings, RetrievalMetrics(new_registry()))
    app = build_http_app(core, settings, new_registry())

    async def run() -> None:
        t0 = time.perf_counter()
        resp = await _post(app, "/v1/search", {"query": "engine inventor", "k": 5})
        elapsed = time.perf_counter() - t0
        body = resp.json()
        assert resp.status_code == 200 and body["degraded"] and body["failed_backends"] == ["dense"]
        assert elapsed < 1.5
        # The service keeps serving: a lexical-only search is unaffected.
        lex = await _post(app, "/v1/search", {"query": "engine inventor", "k": 5, "mode": "lexical"})
        assert lex.status_code == 200 and lex.json()["degraded"] is False

    asyncio.run(run())
    core.close()
