"""The retrieval service end to end on the toy world with the embedded backends.

Index with `bcstack index`, serve with `bcstack serve retrieval` (real processes), query over
HTTP and gRPC, measure recall@10 per mode, and check bad input and the error codes.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest
from conftest import find_free_port, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc
from stack_util import ForkedBcstack, bcstack_forked

from core.v1 import retrieval_pb2, retrieval_pb2_grpc

N_DOCS = 500  # the session's toy kit (conftest.toy_kit): its world and index are shared


def _bcstack(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`bcstack ARGS` forked from the forkserver (stack_util): a process of its own that skips the
    seconds of imports; the service, and the resumed ingest, run as `python -m bcstack` instead."""
    return bcstack_forked(args, env=env)


@pytest.fixture(scope="module")
def world_dir(toy_kit):
    return toy_kit["dir"] / "world"


@pytest.fixture(scope="module")
def index_dir(toy_kit):
    """The kit's index, built by `bcstack index` (read-only here: the rerun below is a no-op)."""
    index = toy_kit["dir"] / "idx"
    assert json.loads((index / "manifest.json").read_text())["complete"] is True
    return index


@pytest.fixture(scope="module")
def service(index_dir):
    http_port, grpc_port = find_free_port(), find_free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bcstack",
            "serve",
            "retrieval",
            "--index-dir",
            str(index_dir),
            "--port",
            str(http_port),
            "--grpc-port",
            str(grpc_port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{http_port}"

    def healthy() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"service exited: {proc.stdout.read()}")
        try:
            return httpx.get(base + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(healthy, timeout=90, message="retrieval service did not become healthy")
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    yield {"http": base, "channel": channel, "proc": proc}
    channel.close()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def _questions(world_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (world_dir / "questions.jsonl").read_text().splitlines()]


# --- HTTP --------------------------------------------------------------------------------------


def test_foldagent_search_and_open(service, world_dir):
    q = _questions(world_dir)[0]  # easy: the gold page names the entity of the question
    body = httpx.post(service["http"] + "/search", json={"query": q["query"], "k": 5}, timeout=30).json()
    assert len(body["results"]) == 5
    assert set(body["results"][0]) == {"docid", "url", "text", "score"}
    gold = q["gold_docs"][0]["docid"]
    assert gold in [r["docid"] for r in body["results"]]
    opened = httpx.post(service["http"] + "/open", json={"docid": gold, "url": None}, timeout=30).json()
    assert opened["results"][0]["text"] == q["gold_docs"][0]["text"]
    by_url = httpx.post(
        service["http"] + "/open", json={"docid": None, "url": q["gold_docs"][0]["url"]}
    ).json()
    assert by_url["results"][0]["docid"] == gold


def test_v1_search_modes_and_detail(service, world_dir):
    q = _questions(world_dir)[1]["query"]
    for mode in ("hybrid", "lexical", "dense"):
        body = httpx.post(
            service["http"] + "/v1/search",
            json={"query": q, "k": 10, "mode": mode, "snippet_words": 20},
            timeout=30,
        ).json()
        assert len(body["results"]) == 10 and body["degraded"] is False
        hit = body["results"][0]
        assert len(hit["text"].split()) <= 20 and hit["title"]
        retrievers = {"hybrid": {"lexical", "dense"}, "lexical": {"lexical"}, "dense": {"dense"}}[mode]
        assert set().union(*(h["ranks"].keys() for h in body["results"])) <= retrievers
        assert {"total", "fuse"} <= set(body["timings"])
    hybrid = httpx.post(service["http"] + "/v1/search", json={"query": q, "k": 10}).json()["results"]
    both = [h for h in hybrid if len(h["ranks"]) == 2]
    assert both, "hybrid results carry both retrievers' ranks"
    r = both[0]["ranks"]
    assert both[0]["score"] == pytest.approx(1 / (60 + r["lexical"]["rank"]) + 1 / (60 + r["dense"]["rank"]))


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        ("/search", {"query": "", "k": 5}, 400, "non-empty"),
        ("/search", {"query": "   ", "k": 5}, 400, "non-empty"),
        ("/search", {"query": "x" * 5000, "k": 5}, 400, "limit"),
        ("/search", {"query": "engine", "k": 0}, 400, "between 1 and"),
        ("/search", {"query": "engine", "k": 1000}, 400, "between 1 and"),
        ("/v1/search", {"query": "engine", "mode": "fuzzy"}, 400, "mode"),
        ("/open", {"docid": "no-such-doc"}, 404, "no document"),
        ("/open", {"url": "https://nowhere.example/x"}, 404, "no document"),
        ("/open", {"docid": None, "url": None}, 400, "docid or a url"),
        ("/search", {"k": 5}, 422, ""),
    ],
)
def test_bad_http_input_is_a_clear_4xx(service, path, body, status, words):
    resp = httpx.post(service["http"] + path, json=body, timeout=30)
    assert resp.status_code == status
    assert words in json.dumps(resp.json())


def test_oversized_body_is_413(service):
    resp = httpx.post(service["http"] + "/search", content=b"{" + b" " * (17 * 2**20) + b"}", timeout=60)
    assert resp.status_code == 413


# --- gRPC --------------------------------------------------------------------------------------


def test_grpc_search_batch_open_and_health(service, world_dir):
    stub = retrieval_pb2_grpc.RetrievalServiceStub(service["channel"])
    questions = _questions(world_dir)
    resp = stub.Search(retrieval_pb2.SearchRequest(query=questions[0]["query"], k=5), timeout=30)
    assert len(resp.hits) == 5 and resp.timings.total_seconds > 0
    http = httpx.post(service["http"] + "/search", json={"query": questions[0]["query"], "k": 5}).json()
    assert [h.docid for h in resp.hits] == [r["docid"] for r in http["results"]]  # one core, two transports
    batch = stub.BatchSearch(
        retrieval_pb2.BatchSearchRequest(
            requests=[retrieval_pb2.SearchRequest(query=q["query"], k=3) for q in questions[:4]]
        ),
        timeout=30,
    )
    assert [len(r.hits) for r in batch.responses] == [3, 3, 3, 3]
    page = stub.Open(retrieval_pb2.OpenRequest(docid=resp.hits[0].docid), timeout=30)
    assert page.docid == resp.hits[0].docid and page.title
    health = health_pb2_grpc.HealthStub(service["channel"]).Check(
        health_pb2.HealthCheckRequest(service="bcstack.v1.RetrievalService"), timeout=5
    )
    assert health.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize(
    ("call", "request_", "code"),
    [
        ("Search", retrieval_pb2.SearchRequest(query=""), grpc.StatusCode.INVALID_ARGUMENT),
        ("Search", retrieval_pb2.SearchRequest(query="engine", k=5000), grpc.StatusCode.INVALID_ARGUMENT),
        ("Search", retrieval_pb2.SearchRequest(query="engine", mode=7), grpc.StatusCode.INVALID_ARGUMENT),
        ("Open", retrieval_pb2.OpenRequest(docid="missing"), grpc.StatusCode.NOT_FOUND),
        ("Open", retrieval_pb2.OpenRequest(), grpc.StatusCode.INVALID_ARGUMENT),
        (
            "BatchSearch",
            retrieval_pb2.BatchSearchRequest(requests=[retrieval_pb2.SearchRequest(query="a")] * 65),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
    ],
)
def test_bad_grpc_input_has_the_right_status(service, call, request_, code):
    stub = retrieval_pb2_grpc.RetrievalServiceStub(service["channel"])
    with pytest.raises(grpc.RpcError) as err:
        getattr(stub, call)(request_, timeout=30)
    assert err.value.code() == code and err.value.details()


def test_metrics_count_searches_per_stage(service):
    httpx.post(service["http"] + "/search", json={"query": "lantern", "k": 3})
    text = httpx.get(service["http"] + "/metrics").text
    for stage in ("embed", "lexical", "dense", "fuse", "total"):
        assert f'bcstack_retrieval_stage_seconds_count{{stage="{stage}"}}' in text
    assert 'bcstack_retrieval_searches_total{mode="hybrid",outcome="ok",transport="http"}' in text
    assert 'bcstack_retrieval_searches_total{mode="hybrid",outcome="invalid",transport="http"}' in text
    assert f"bcstack_retrieval_documents {float(N_DOCS)}" in text
    assert (
        "bcstack_retrieval_embed_batch_queries_count" in text
        and "_count 0.0" not in text.split("bcstack_retrieval_embed_batch_queries_count")[1][:8]
    )


# --- quality -----------------------------------------------------------------------------------


def test_recall_at_10_hybrid_at_least_the_better_retriever(service, world_dir):
    """Recall@10 over the toy test questions, per mode: of the gold documents (the issue's
    measure; on medium and hard questions the gold page is hops away from the question's words)
    and of all evidence documents."""
    questions = _questions(world_dir)
    gold, evidence = {}, {}
    for mode in ("lexical", "dense", "hybrid"):
        gold_found = evidence_found = evidence_total = 0
        for q in questions:
            hits = httpx.post(
                service["http"] + "/v1/search",
                json={"query": q["query"], "k": 10, "mode": mode, "snippet_words": 1},
            ).json()["results"]
            ids = {h["docid"] for h in hits}
            gold_found += all(d["docid"] in ids for d in q["gold_docs"])
            evidence_found += sum(d["docid"] in ids for d in q["evidence_docs"])
            evidence_total += len(q["evidence_docs"])
        gold[mode] = gold_found / len(questions)
        evidence[mode] = evidence_found / evidence_total
    print(f"recall@10 over {len(questions)} toy test questions: gold {gold}, evidence {evidence}")
    # RRF does not guarantee dominance question by question: on a world where the better retriever
    # finds one gold page the fused list ranks 11th, hybrid is one question behind. Allow that one.
    # The same slack for the evidence documents: one document.
    one_question, one_doc = 1 / len(questions) + 1e-9, 1 / evidence_total + 1e-9
    assert gold["hybrid"] >= max(gold["lexical"], gold["dense"]) - one_question
    assert evidence["hybrid"] >= max(evidence["lexical"], evidence["dense"]) - one_doc
    assert gold["lexical"] > 0.3 and gold["dense"] > 0.1  # each retriever does real work


# --- ingest ------------------------------------------------------------------------------------


def test_index_rerun_is_a_no_op(index_dir, world_dir):
    result = _bcstack("index", "--corpus", str(world_dir / "corpus.jsonl"), "--index-dir", str(index_dir))
    assert result.returncode == 0 and "already complete" in result.stderr


def test_killed_ingest_resumes_without_duplicates(world_dir, tmp_path):
    n = 160  # a slice of the toy corpus (five batches) keeps the two ingests short
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join((world_dir / "corpus.jsonl").read_text().splitlines(keepends=True)[:n]))
    index = tmp_path / "idx"
    cmd = [
        sys.executable,
        "-m",
        "bcstack",
        "index",
        "--corpus",
        str(corpus),
        "--index-dir",
        str(index),
        "--batch-size",
        "32",
    ]
    # Pages embedded to 64 tokens: the subject is resuming, and the two ingests take a third of the CPU.
    short = {"BCSTACK_RETRIEVAL_EMBED_MAX_LENGTH": "64"}
    proc = ForkedBcstack(cmd[3:], short)

    def committed() -> int:
        try:
            with sqlite3.connect(index / "docstore.sqlite") as conn:
                return conn.execute("SELECT COUNT(*) FROM docs").fetchone()[0]
        except sqlite3.Error:
            return 0

    try:
        wait_until(lambda: committed() >= 64, timeout=120, interval=0.05, message="ingest made no progress")
    finally:
        os.kill(proc.proc.pid, signal.SIGKILL)
        proc.proc.join(10)
    partial = committed()
    assert 0 < partial < n
    manifest = json.loads((index / "manifest.json").read_text())
    assert manifest["complete"] is False
    result = bcstack_forked(cmd[3:], env=short)  # the resumed ingest, forked as the killed one was
    assert result.returncode == 0, result.stderr
    assert f"{n - partial:,} added, {partial:,} resumed" in result.stderr
    with sqlite3.connect(index / "docstore.sqlite") as conn:
        assert conn.execute("SELECT COUNT(*), COUNT(DISTINCT docid) FROM docs").fetchone() == (n, n)
    assert json.loads((index / "manifest.json").read_text())["complete"] is True


def _corpus(tmp_path: Path, lines: list[bytes]) -> Path:
    path = tmp_path / "c.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (
            [b'{"docid": "1", "text": "a", "url": "u"}', b'{"text": "b", "url": "u"}'],
            "c.jsonl:2: missing 'docid'",
        ),
        ([b'{"docid": "1", "text": "", "url": "u"}'], "c.jsonl:1: missing or empty 'text'"),
        (
            [b'{"docid": "1", "text": "a"}', b'{"docid": "2", "text": "caf\xe9"}'],
            "c.jsonl:2: not valid UTF-8",
        ),
        ([b'{"docid": "1", "text": "a"', b""], "c.jsonl:1: invalid JSON"),
        ([b'{"docid": "1", "text": "a"}', b'{"docid": "1", "text": "b"}'], "c.jsonl:2: duplicate docid '1'"),
    ],
)
def test_bad_corpus_is_named_by_line(tmp_path, lines, message):
    # Lexical only: the corpus reader is the same, and no embedder is loaded to read five lines.
    result = _bcstack(
        "index",
        "--corpus",
        str(_corpus(tmp_path, lines)),
        "--index-dir",
        str(tmp_path / "i"),
        "--dense",
        "none",
    )
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_duplicates_can_be_skipped_and_are_reported(tmp_path):
    lines = [
        b'{"docid": "1", "text": "alpha page", "url": "u1"}',
        b'{"docid": "1", "text": "other", "url": "u2"}',
    ]
    corpus = _corpus(tmp_path, lines + [b'{"docid": "2", "text": "beta page", "url": "u3"}'])
    result = _bcstack(
        "index", "--corpus", str(corpus), "--index-dir", str(tmp_path / "i"), "--on-duplicate", "skip"
    )
    assert result.returncode == 0, result.stderr
    assert "skipped" in result.stderr and "c.jsonl:2: duplicate docid '1' (first at" in result.stderr
    assert "2 documents" in result.stderr


def test_parquet_corpus(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "docid": ["10", "11"],
            "text": ["---\ntitle: Ten\n---\n\nten page", "eleven page"],
            "url": ["a", "b"],
        }
    )
    pq.write_table(table, tmp_path / "c.parquet")
    result = _bcstack("index", "--corpus", str(tmp_path / "c.parquet"), "--index-dir", str(tmp_path / "i"))
    assert result.returncode == 0, result.stderr
    with sqlite3.connect(tmp_path / "i" / "docstore.sqlite") as conn:
        assert conn.execute("SELECT docid, title FROM docs ORDER BY docid").fetchall() == [
            ("10", "Ten"),
            ("11", "eleven page"),
        ]


def test_serving_an_unfinished_or_missing_index_is_a_clear_error(tmp_path):
    result = _bcstack("serve", "retrieval", "--index-dir", str(tmp_path / "none"), "--port", "0")
    assert result.returncode == 2 and "holds no index" in result.stderr and "Traceback" not in result.stderr
