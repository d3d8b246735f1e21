"""A lexical-only index (`bcstack index --dense none`): built and served without the embedder.

The build and the service run with the embedder's model set to a path that does not exist
(BCSTACK_RETRIEVAL_EMBEDDER_MODEL): had either loaded the embedder it would have failed, as the
same build with `--dense edge` does. Search, open_page, /health and /metrics go through a real
`bcstack serve retrieval` process; the resume and refusal cases run `ingest` in-process.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
from pathlib import Path

import grpc
import httpx
import pytest
from conftest import find_free_port
from stack_util import bcstack_process
from test_retrieval_service import _bcstack, _questions

from core.kit.metrics import new_registry
from core.v1 import retrieval_pb2, retrieval_pb2_grpc
from devkit.toyworld.generator import generate_world, write_world
from services.retrieval.core import InvalidRequest, RetrievalMetrics, SearchCore, SearchQuery
from services.retrieval.embedder import HashingEmbedder
from services.retrieval.index import RetrievalIndexError, ingest, open_index
from services.retrieval.settings import RetrievalSettings

N_DOCS = 500
MISSING_MODEL = "/nonexistent/embedder-model"
NO_MODEL = {"BCSTACK_RETRIEVAL_EMBEDDER_MODEL": MISSING_MODEL}


@pytest.fixture(scope="module")
def world_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("world") / "w"
    write_world(generate_world(N_DOCS, 5, questions_per_tier=5, train_medium=0, train_hard=0), out)
    return out


@pytest.fixture(scope="module")
def index_dir(world_dir, tmp_path_factory):
    index = tmp_path_factory.mktemp("index") / "idx"
    result = _bcstack(
        "index",
        "--corpus",
        str(world_dir / "corpus.jsonl"),
        "--index-dir",
        str(index),
        "--dense",
        "none",
        env={**os.environ, **NO_MODEL},
    )
    assert result.returncode == 0, result.stderr
    assert f"{N_DOCS:,} documents" in result.stderr
    return index


@pytest.fixture(scope="module")
def service(index_dir):
    http_port, grpc_port = find_free_port(), find_free_port()
    args = ["serve", "retrieval", "--index-dir", str(index_dir), "--port", str(http_port)]
    args += ["--grpc-port", str(grpc_port)]
    base = f"http://127.0.0.1:{http_port}"
    with bcstack_process(args, base + "/health", timeout=90, env=NO_MODEL) as proc:
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        yield {"http": base, "channel": channel, "proc": proc}
        channel.close()


def _slice(world_dir: Path, tmp_path: Path, n: int) -> Path:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join((world_dir / "corpus.jsonl").read_text().splitlines(keepends=True)[:n]))
    return corpus


def _title(doc: dict) -> str:
    return doc["text"].split("\n")[1].removeprefix("title: ")


# --- build -------------------------------------------------------------------------------------


def test_lexical_only_build_embeds_nothing(index_dir, world_dir, tmp_path):
    manifest = json.loads((index_dir / "manifest.json").read_text())
    assert manifest["dense"] == "none" and manifest["embedder"] is None
    assert manifest["complete"] is True and manifest["documents"] == N_DOCS
    assert (index_dir / "lexical").is_dir() and not (index_dir / "dense").exists()
    with sqlite3.connect(index_dir / "docstore.sqlite") as conn:
        assert conn.execute("SELECT COUNT(*), COUNT(vector) FROM docs").fetchone() == (N_DOCS, 0)
    # The control: the same build with a dense index does load the (missing) model, and says so.
    corpus = _slice(world_dir, tmp_path, 5)
    edge = _bcstack(
        "index", "--corpus", str(corpus), "--index-dir", str(tmp_path / "edge"), "--dense", "edge",
        env={**os.environ, **NO_MODEL},
    )  # fmt: skip
    assert edge.returncode == 2 and "cannot load embedder" in edge.stderr


def test_changing_the_dense_kind_of_a_lexical_only_index_is_refused(index_dir, world_dir):
    result = _bcstack(
        "index", "--corpus", str(world_dir / "corpus.jsonl"), "--index-dir", str(index_dir), "--dense", "edge"
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "dense backend 'none', not 'edge'" in result.stderr
    again = _bcstack("index", "--corpus", str(world_dir / "corpus.jsonl"), "--index-dir", str(index_dir))
    assert again.returncode == 0 and "already complete" in again.stderr  # unset --dense: the manifest's


class Interrupted(Exception):
    """Raised from the progress callback: the ingest stops between two committed batches."""


def test_interrupted_lexical_only_ingest_resumes(world_dir, tmp_path):
    n = 300
    corpus = _slice(world_dir, tmp_path, n)
    settings = RetrievalSettings(dense="none", ingest_batch_size=32, embedder_model=MISSING_MODEL)

    def stop_after_two_batches(done: int, total: int | None) -> None:
        if done >= 64:
            raise Interrupted

    with pytest.raises(Interrupted):
        ingest(corpus, tmp_path / "idx", settings, progress=stop_after_two_batches)
    assert json.loads((tmp_path / "idx" / "manifest.json").read_text())["complete"] is False
    report = ingest(corpus, tmp_path / "idx", RetrievalSettings())  # dense unset: the manifest's none
    assert (report.resumed, report.added, report.total) == (64, n - 64, n)
    with sqlite3.connect(tmp_path / "idx" / "docstore.sqlite") as conn:
        assert conn.execute("SELECT COUNT(DISTINCT docid), COUNT(vector) FROM docs").fetchone() == (n, 0)
    assert json.loads((tmp_path / "idx" / "manifest.json").read_text())["complete"] is True
    assert not (tmp_path / "idx" / "dense").exists()


def test_a_hybrid_index_refuses_a_lexical_only_resume_and_serves_lexical_only(world_dir, tmp_path):
    corpus = _slice(world_dir, tmp_path, 200)
    index = tmp_path / "idx"
    ingest(corpus, index, RetrievalSettings(), embedder=HashingEmbedder(64))
    with pytest.raises(RetrievalIndexError, match="dense backend 'edge', not 'none'"):
        ingest(corpus, index, RetrievalSettings(dense="none"))

    # Served with dense none (BCSTACK_RETRIEVAL_DENSE=none), the same index answers lexically.
    opened = open_index(RetrievalSettings(index_dir=index, dense="none"))
    assert opened.embedder is None and opened.dense is None
    core = SearchCore(opened, RetrievalSettings(), RetrievalMetrics(new_registry()))
    query = _title(json.loads(corpus.read_text().splitlines()[17]))

    async def both_modes():
        return [await core.search(SearchQuery(query, 5, mode)) for mode in ("hybrid", "lexical")]

    hybrid, lexical = asyncio.run(both_modes())
    assert hybrid.hits == lexical.hits and not hybrid.degraded
    with pytest.raises(InvalidRequest, match="lexical only"):
        asyncio.run(core.search(SearchQuery(query, 5, "dense")))
    core.close()


def test_a_lexical_only_index_cannot_be_served_with_a_dense_backend(index_dir):
    with pytest.raises(RetrievalIndexError, match="lexical only"):
        open_index(RetrievalSettings(index_dir=index_dir, dense="edge"))


# --- service -----------------------------------------------------------------------------------


def test_search_finds_the_easy_gold_page(service, world_dir):
    easy = [q for q in _questions(world_dir) if q["data_source"] == "bc_test_easy"]
    assert easy
    for q in easy:
        gold = q["gold_docs"][0]
        by_title = httpx.post(service["http"] + "/search", json={"query": _title(gold), "k": 5}, timeout=30)
        assert by_title.status_code == 200
        results = by_title.json()["results"]
        # Top 5, not top 1: a shorter page that mentions the same name can outscore it under BM25.
        assert gold["docid"] in [r["docid"] for r in results]
        assert set(results[0]) == {"docid", "url", "text", "score"}
        by_question = httpx.post(service["http"] + "/search", json={"query": q["query"], "k": 5}).json()
        assert gold["docid"] in [r["docid"] for r in by_question["results"]]


def test_hybrid_results_are_the_lexical_results(service, world_dir):
    for q in _questions(world_dir):
        bodies = {
            mode: httpx.post(
                service["http"] + "/v1/search", json={"query": q["query"], "k": 10, "mode": mode}, timeout=30
            ).json()
            for mode in ("hybrid", "lexical")
        }
        hybrid, lexical = bodies["hybrid"], bodies["lexical"]
        assert hybrid["results"] and hybrid["results"] == lexical["results"]
        assert hybrid["degraded"] is False and hybrid["failed_backends"] == []
        assert all(set(h["ranks"]) == {"lexical"} for h in hybrid["results"])


def test_mode_dense_is_a_clear_client_error(service):
    resp = httpx.post(service["http"] + "/v1/search", json={"query": "academy", "mode": "dense"}, timeout=30)
    assert resp.status_code == 400
    detail = resp.json()["detail"]
    assert "lexical only" in detail and "\n" not in detail
    stub = retrieval_pb2_grpc.RetrievalServiceStub(service["channel"])
    dense = retrieval_pb2.SearchRequest(query="academy", k=3, mode=retrieval_pb2.SEARCH_MODE_DENSE)
    with pytest.raises(grpc.RpcError) as err:
        stub.Search(dense, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details() == detail
    with pytest.raises(grpc.RpcError) as err:
        stub.BatchSearch(retrieval_pb2.BatchSearchRequest(requests=[dense]), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    ok = stub.Search(retrieval_pb2.SearchRequest(query="academy", k=3), timeout=30)
    assert len(ok.hits) == 3 and ok.hits[0].dense_rank == 0  # hybrid over gRPC: lexical ranks only
    assert "Traceback" not in service["proc"].log()


def test_health_metrics_and_open_page(service, world_dir):
    health = httpx.get(service["http"] + "/health", timeout=10).json()
    assert health["status"] == "ok" and health["retrievers"] == ["lexical"]
    assert health["manifest"]["dense"] == "none" and health["documents"] == N_DOCS
    httpx.post(service["http"] + "/search", json={"query": "harbor", "k": 3})
    httpx.post(service["http"] + "/v1/search", json={"query": "harbor", "mode": "dense"})
    metrics = httpx.get(service["http"] + "/metrics", timeout=10).text
    assert 'bcstack_retrieval_searches_total{mode="hybrid",outcome="ok",transport="http"}' in metrics
    assert 'bcstack_retrieval_searches_total{mode="dense",outcome="invalid",transport="http"}' in metrics
    assert f"bcstack_retrieval_documents {float(N_DOCS)}" in metrics
    assert 'bcstack_retrieval_stage_seconds_count{stage="embed"}' not in metrics
    doc = json.loads((world_dir / "corpus.jsonl").read_text().splitlines()[3])
    by_id = httpx.post(service["http"] + "/open", json={"docid": doc["docid"]}).json()
    by_url = httpx.post(service["http"] + "/open", json={"url": doc["url"]}).json()
    assert by_id["results"][0]["text"] == doc["text"] and by_url["results"][0]["docid"] == doc["docid"]
