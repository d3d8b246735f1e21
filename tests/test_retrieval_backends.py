"""The retrieval backends against their contracts: bm25s, Elasticsearch (a real osmem-server
process), Qdrant Edge, qdrant-client local mode, the MiniLM embedder and the micro-batcher."""

from __future__ import annotations

import asyncio
import math
import re
import socket
import subprocess
import sys
import threading
import time
from collections import Counter

import numpy as np
import pytest
from conftest import LOOPBACK, find_free_port
from osmem_util import PlainJsonNode, osmem_server

from services.retrieval.backends import BackendUnavailable, DenseIndex, Doc, LexicalIndex
from services.retrieval.dense import EdgeDense, QdrantDense
from services.retrieval.embedder import (
    HashingEmbedder,
    MicroBatchingEmbedder,
    SentenceTransformerEmbedder,
    resolve_model_path,
    retrieval_recipe,
)
from services.retrieval.lexical import ElasticsearchLexical, EmbeddedBM25, analyze

SECRET_KEY = "bcstack-test-SECRET-api-key-0123456789"


def doc(docid: str, text: str, title: str = "") -> Doc:
    return Doc(docid=docid, text=text, url=f"https://example.org/{docid}", title=title or docid)


CORPUS = [
    doc("d1", "The red fox jumps over the lazy dog"),
    doc("d2", "A fox, a fox and another fox: the fox den in the forest"),
    doc("d3", "Dogs and cats living together in a small apartment in the city"),
    doc("d4", "Quantum chromodynamics describes the strong interaction between quarks and gluons"),
    doc("d5", "The history of the Roman empire, its emperors, legions and roads across Europe"),
]


def lucene_bm25(query: str, docs: list[Doc], k1: float, b: float) -> dict[str, float]:
    """Lucene's BM25 (no (k1 + 1) factor, idf = ln(1 + (N - n + 0.5) / (n + 0.5))), written out."""
    terms = {d.docid: Counter(analyze(d.text)) for d in docs}
    lengths = {docid: sum(tf.values()) for docid, tf in terms.items()}
    avgdl = sum(lengths.values()) / len(docs)
    scores = {}
    for docid, tf in terms.items():
        score = 0.0
        for term in analyze(query):
            df = sum(1 for other in terms.values() if term in other)
            if tf[term]:
                idf = math.log(1 + (len(docs) - df + 0.5) / (df + 0.5))
                score += idf * tf[term] / (tf[term] + k1 * (1 - b + b * lengths[docid] / avgdl))
        if score > 0:
            scores[docid] = score
    return scores


# --------------------------------------------------------------------------- EmbeddedBM25


def build_bm25(index_dir, docs=CORPUS, k1=0.9, b=0.4) -> EmbeddedBM25:
    index = EmbeddedBM25(index_dir, k1=k1, b=b)
    index.add(docs)
    index.finalize()
    return index


def test_bm25_ranks_and_scores_as_lucene_bm25(tmp_path):
    index = build_bm25(tmp_path)
    assert isinstance(index, LexicalIndex)
    hits = index.search("fox den", k=10)
    assert [docid for docid, _ in hits] == ["d2", "d1"]
    expected = lucene_bm25("fox den", CORPUS, k1=0.9, b=0.4)
    assert dict(hits) == pytest.approx(expected, rel=1e-5)
    assert index.count() == len(CORPUS)


def test_bm25_k1_and_b_reach_the_scorer(tmp_path):
    scores = {}
    for k1, b in [(0.9, 0.4), (0.9, 1.0), (2.0, 0.4)]:
        index = build_bm25(tmp_path / f"{k1}-{b}", k1=k1, b=b)
        scores[(k1, b)] = dict(index.search("fox dog", k=10))
        assert scores[(k1, b)] == pytest.approx(lucene_bm25("fox dog", CORPUS, k1=k1, b=b), rel=1e-5)
    assert scores[(0.9, 0.4)]["d1"] != pytest.approx(scores[(0.9, 1.0)]["d1"])
    assert scores[(0.9, 0.4)]["d2"] != pytest.approx(scores[(2.0, 0.4)]["d2"])


def test_bm25_persists_and_loads_memory_mapped(tmp_path):
    built = build_bm25(tmp_path)
    queries = ["fox", "roman roads", "quarks gluons strong", "cats"]
    before = [built.search(q, k=3) for q in queries]
    built.close()
    loaded = EmbeddedBM25.load(tmp_path)
    assert loaded.count() == len(CORPUS)
    assert [loaded.search(q, k=3) for q in queries] == before
    assert all(before)
    with pytest.raises(RuntimeError, match="serving"):
        loaded.add([doc("d9", "more")])


def test_bm25_re_added_docid_replaces_in_place(tmp_path):
    index = build_bm25(tmp_path)
    index.add([doc("d4", "a recipe for apple pie with cinnamon")])
    index.finalize()
    assert index.count() == len(CORPUS)
    assert index.search("quarks", k=5) == []
    assert index.search("apple cinnamon", k=5)[0][0] == "d4"
    assert EmbeddedBM25.load(tmp_path).search("apple", k=5)[0][0] == "d4"


def test_bm25_edge_cases(tmp_path):
    index = EmbeddedBM25(tmp_path)
    assert index.search("fox", k=5) == []  # nothing finalized yet
    index.add(CORPUS + [doc("d0", "the red fox jumps over the lazy dog")])  # same words as d1
    index.finalize()
    assert index.search("", k=5) == []
    assert index.search("the and of a", k=5) == []  # Lucene English stopwords only
    assert index.search("zzyzx", k=5) == []
    assert index.search("fox", k=0) == []
    everything = index.search("fox dog the roman quarks cats", k=1000)  # k beyond the corpus
    assert len(everything) == len(CORPUS) + 1
    ranks = [docid for docid, _ in index.search("red lazy", k=5)]
    assert ranks[:2] == ["d0", "d1"]  # equal scores: docid order


# --------------------------------------------------------------------------- Elasticsearch


@pytest.fixture(scope="module")
def es_url():
    with osmem_server() as url:
        yield url


@pytest.fixture
def es_index(es_url, request):
    name = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")
    index = ElasticsearchLexical(
        es_url, name, request_timeout=5.0, client_options={"node_class": PlainJsonNode}
    )
    yield index
    index.close()


def test_es_unmodified_client_is_refused_by_osmem(es_url):
    """The production adapter sends the compatibility mimetype; osmem rejects it (hence the node)."""
    index = ElasticsearchLexical(es_url, "compat-check")
    with pytest.raises(BackendUnavailable, match="406|compatible-with"):
        index.ensure_index()
    index.close()


def test_es_creates_index_with_bm25_similarity(es_index):
    es_index.ensure_index()
    settings = es_index.client.indices.get_settings(index=es_index.index).body
    similarity = settings[es_index.index]["settings"]["index"]["similarity"]["bcstack_bm25"]
    assert similarity["type"] == "BM25"
    assert float(similarity["k1"]) == 0.9
    assert float(similarity["b"]) == 0.4
    mapping = es_index.client.indices.get_mapping(index=es_index.index).body
    properties = mapping[es_index.index]["mappings"]["properties"]
    for field in ("text", "title"):
        assert properties[field]["similarity"] == "bcstack_bm25"
        assert properties[field]["analyzer"] == "english"
    assert properties["docid"]["type"] == properties["url"]["type"] == "keyword"
    # osmem stores the similarity but scores with its own BM25 whatever k1/b say, so the scorer
    # side of k1/b is pinned only for bm25s above; a real Elasticsearch applies them.


def test_es_bulk_search_get_and_reingest(es_index):
    assert es_index.count() == 0  # index not created yet
    es_index.add(CORPUS)
    es_index.finalize()
    assert es_index.count() == len(CORPUS)
    es_index.add(CORPUS)  # same docids: overwritten, not duplicated
    es_index.finalize()
    assert es_index.count() == len(CORPUS)

    hits = es_index.search("fox den", k=10)
    assert [docid for docid, _ in hits][:2] == ["d2", "d1"]
    assert all(score > 0 for _, score in hits)
    assert es_index.search("roman legions", k=10)[0][0] == "d5"
    assert len(es_index.search("fox", k=1)) == 1
    assert es_index.search("", k=10) == []
    assert es_index.search("the and of", k=10) == []  # english analyzer stopwords

    assert es_index.get("d3") == CORPUS[2]
    assert es_index.get("missing") is None
    assert es_index.get_by_url("https://example.org/d4") == CORPUS[3]
    assert es_index.get_by_url("https://example.org/nope") is None
    assert es_index.get_many(["d1", "d5", "missing"]) == {"d1": CORPUS[0], "d5": CORPUS[4]}


def test_es_server_down_is_backend_unavailable_quickly():
    index = ElasticsearchLexical(f"http://{LOOPBACK}:{find_free_port()}", "down", api_key=SECRET_KEY)
    start = time.monotonic()
    with pytest.raises(BackendUnavailable) as info:
        index.search("fox", k=5)
    assert time.monotonic() - start < 2.0
    assert SECRET_KEY not in str(info.value)
    with pytest.raises(BackendUnavailable):
        index.add(CORPUS[:1])
    index.close()


@pytest.fixture
def silent_server():
    """Accepts TCP connections and never answers: the shape of a hung backend."""
    listener = socket.socket()
    listener.bind((LOOPBACK, 0))
    listener.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept_forever():
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept_forever, daemon=True)
    thread.start()
    yield f"http://{LOOPBACK}:{listener.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in accepted:
        conn.close()
    listener.close()


def test_es_hung_server_times_out_within_request_timeout(silent_server):
    index = ElasticsearchLexical(silent_server, "hung", api_key=SECRET_KEY, request_timeout=0.5)
    start = time.monotonic()
    with pytest.raises(BackendUnavailable, match="search") as info:
        index.search("fox", k=5)
    assert 0.4 < time.monotonic() - start < 2.0
    assert SECRET_KEY not in str(info.value)
    index.close()


# --------------------------------------------------------------------------- dense indexes


def unit_vectors(n: int, dim: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


N_POINTS, DIM = 3000, 32
DOCIDS = [f"doc-{i:05d}" for i in range(N_POINTS)]


@pytest.fixture(scope="module")
def points():
    return unit_vectors(N_POINTS, DIM, seed=1)


def brute_force_top1(points: np.ndarray, queries: np.ndarray) -> list[str]:
    return [DOCIDS[i] for i in np.argmax(queries @ points.T, axis=1)]


def make_edge(index_dir) -> EdgeDense:
    # Thresholds of 1 KB force an HNSW index (and graph search) on this small test set.
    return EdgeDense(index_dir, DIM, indexing_threshold_kb=1, full_scan_threshold_kb=1, upsert_batch=500)


def test_edge_hnsw_agrees_with_brute_force(tmp_path, points):
    index = make_edge(tmp_path)
    assert isinstance(index, DenseIndex)
    index.upsert(DOCIDS, points)
    index.finalize()
    assert index.count() == N_POINTS
    assert index.indexed_count() == N_POINTS  # the HNSW graph exists, not only a scan
    queries = unit_vectors(300, DIM, seed=2)
    results = index.search(queries, k=10)
    assert len(results) == len(queries) and all(len(r) == 10 for r in results)
    agree = np.mean([r[0][0] == t for r, t in zip(results, brute_force_top1(points, queries), strict=True)])
    assert agree >= 0.99
    first = results[0]
    scores = [score for _, score in first]
    assert scores == sorted(scores, reverse=True)
    exact = {DOCIDS[i]: float(points[i] @ queries[0]) for i in range(N_POINTS)}
    assert [s for _, s in first] == pytest.approx([exact[d] for d, _ in first], abs=1e-4)
    index.close()


def test_edge_persists_and_replaces(tmp_path, points):
    index = make_edge(tmp_path)
    index.upsert(DOCIDS, points)
    index.finalize()
    queries = unit_vectors(20, DIM, seed=3)
    before = index.search(queries, k=5)
    index.close()

    reopened = make_edge(tmp_path)
    assert reopened.count() == N_POINTS
    assert reopened.search(queries, k=5) == before
    flipped = -points[7]
    reopened.upsert([DOCIDS[7]], flipped[None, :])
    assert reopened.count() == N_POINTS
    top = reopened.search(flipped, k=1)[0][0]
    assert top[0] == DOCIDS[7] and top[1] == pytest.approx(1.0, abs=1e-5)
    assert DOCIDS[7] not in [d for d, _ in reopened.search(points[7], k=10)[0]]
    assert reopened.search(queries, k=0) == [[] for _ in queries]
    with pytest.raises(ValueError):
        reopened.upsert(["x"], np.ones((1, DIM + 1), np.float32))
    reopened.close()


def test_edge_recovers_docids_of_points_never_finalized(tmp_path, points):
    index = make_edge(tmp_path)
    index.upsert(DOCIDS[:100], points[:100])
    index.finalize()
    index.upsert(DOCIDS[100:200], points[100:200])  # the process "dies" before finalize
    index.close()
    reopened = make_edge(tmp_path)
    assert reopened.count() == 200
    assert reopened.search(points[150], k=1)[0][0][0] == DOCIDS[150]
    reopened.upsert(["new-doc"], points[300:301])
    assert reopened.search(points[300], k=1)[0][0][0] == "new-doc"
    assert reopened.search(points[150], k=1)[0][0][0] == DOCIDS[150]
    reopened.close()


def test_qdrant_local_mode_contract(points):
    index = QdrantDense(":memory:", "docs", DIM, upsert_batch=700)
    assert isinstance(index, DenseIndex)
    assert index.count() == 0
    index.upsert(DOCIDS[:1000], points[:1000])
    index.finalize()
    assert index.count() == 1000
    queries = unit_vectors(50, DIM, seed=4)
    results = index.search(queries, k=5)
    assert [r[0][0] for r in results] == brute_force_top1(points[:1000], queries)
    assert results[0][0][1] == pytest.approx(float(np.max(points[:1000] @ queries[0])), abs=1e-4)
    index.upsert([DOCIDS[3]], -points[3][None, :])  # same docid: replaced, not added
    assert index.count() == 1000
    assert index.search(-points[3], k=1)[0][0][0] == DOCIDS[3]
    index.close()


def test_qdrant_local_path_persists(tmp_path, points):
    index = QdrantDense("local", "docs", DIM, path=tmp_path)
    index.upsert(DOCIDS[:200], points[:200])
    index.finalize()
    before = index.search(points[:5], k=3)
    index.close()
    reopened = QdrantDense("local", "docs", DIM, path=tmp_path)
    assert reopened.count() == 200
    after = reopened.search(points[:5], k=3)
    assert [[d for d, _ in r] for r in after] == [[d for d, _ in r] for r in before]
    scores = [s for r in after for _, s in r]
    assert scores == pytest.approx([s for r in before for _, s in r], abs=1e-6)
    reopened.close()
    wrong_dim = QdrantDense("local", "docs", DIM * 2, path=tmp_path)
    with pytest.raises(BackendUnavailable, match="32-dim"):
        wrong_dim.upsert(["x"], unit_vectors(1, DIM * 2, seed=5))
    wrong_dim.close()


@pytest.mark.filterwarnings("ignore:Api key is used with an insecure connection")
def test_qdrant_server_down_is_backend_unavailable(silent_server):
    down = QdrantDense(f"http://{LOOPBACK}:{find_free_port()}", "docs", DIM, api_key=SECRET_KEY, timeout=1)
    start = time.monotonic()
    with pytest.raises(BackendUnavailable) as info:
        down.search(unit_vectors(1, DIM, seed=6), k=3)
    assert time.monotonic() - start < 2.0
    assert SECRET_KEY not in str(info.value)
    down.close()
    hung = QdrantDense(silent_server, "docs", DIM, api_key=SECRET_KEY, timeout=1)
    start = time.monotonic()
    with pytest.raises(BackendUnavailable):
        hung.count()
    assert time.monotonic() - start < 3.0
    hung.close()


# --------------------------------------------------------------------------- embedders


@pytest.fixture(scope="module")
def minilm():
    real_connect = socket.socket.connect

    def no_network(sock, address):
        raise AssertionError(f"the embedder tried to open a connection to {address}")

    socket.socket.connect = no_network  # loading must not touch the network at all
    try:
        return SentenceTransformerEmbedder("all-MiniLM-L6-v2", max_length=256)
    finally:
        socket.socket.connect = real_connect


def test_minilm_offline_normalised_384(minilm):
    assert resolve_model_path("sentence-transformers/all-MiniLM-L6-v2") == resolve_model_path(
        "all-MiniLM-L6-v2"
    )
    assert minilm.dim == 384 and minilm.name == "all-MiniLM-L6-v2"
    assert minilm.query_instruction is None
    docs = minilm.embed_documents(["A cat sits on the mat.", "Stock markets fell sharply today."])
    queries = minilm.embed_queries(["where is the cat"])
    for matrix, rows in ((docs, 2), (queries, 1)):
        assert matrix.shape == (rows, 384) and matrix.dtype == np.float32
        assert np.linalg.norm(matrix, axis=1) == pytest.approx(1.0, abs=1e-5)
    assert minilm.embed_queries([]).shape == (0, 384)


def test_minilm_paraphrase_is_closer_than_unrelated(minilm):
    base, paraphrase, unrelated = minilm.embed_documents(
        [
            "The quick brown fox jumps over the lazy dog.",
            "A fast brown fox leaps over a sleepy dog.",
            "The central bank raised interest rates by half a percent.",
        ]
    )
    assert base @ paraphrase > base @ unrelated + 0.3


def test_query_instruction_is_prepended_to_queries_only(minilm):
    instructed = SentenceTransformerEmbedder("all-MiniLM-L6-v2", query_instruction="search query: ")
    query = instructed.embed_queries(["capital of France"])[0]
    assert query == pytest.approx(minilm.embed_documents(["search query: capital of France"])[0], abs=1e-5)
    assert query @ minilm.embed_queries(["capital of France"])[0] < 0.999
    page = ["Paris is the capital of France."]
    assert instructed.embed_documents(page)[0] == pytest.approx(minilm.embed_documents(page)[0], abs=1e-5)


@pytest.fixture(scope="module")
def onnx_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("onnx-cache")


def test_onnx_runtime_gives_the_torch_vectors_and_reuses_its_export(minilm, onnx_cache):
    from services.retrieval.onnx_embedder import OnnxEmbedder

    fast = OnnxEmbedder("all-MiniLM-L6-v2", max_length=256, cache_dir=onnx_cache)
    assert fast.dim == 384 and fast.graph_path.parent == onnx_cache
    queries = ["where is the cat", "capital of France", "x"]
    docs = ["A cat sits on the mat. " * 80, "Stock markets fell sharply today."]  # one cut at 256 tokens
    assert np.abs(fast.embed_queries(queries) - minilm.embed_queries(queries)).max() < 1e-5
    assert np.abs(fast.embed_documents(docs) - minilm.embed_documents(docs)).max() < 1e-5
    assert fast.embed_queries([]).shape == (0, 384)
    # a second start loads the cached graph instead of exporting again
    stamp = fast.graph_path.stat().st_mtime_ns
    again = OnnxEmbedder("all-MiniLM-L6-v2", cache_dir=onnx_cache, num_threads=1)
    assert again.graph_path == fast.graph_path and again.graph_path.stat().st_mtime_ns == stamp
    # the graph and its query side (tokenizer, dimension), no temp files left
    query_side = fast.graph_path.with_suffix(".query.json").name
    assert sorted(p.name for p in onnx_cache.iterdir()) == sorted([fast.graph_path.name, query_side])
    # the cached tokenizer cuts and pads as transformers' tokenizer call does, at any query length
    texts = ["where is the cat", "", "a cat sits on the mat " * 40, "1931, Zürich — and 12,000 more"]
    for length in (8, 256):
        cached = OnnxEmbedder("all-MiniLM-L6-v2", cache_dir=onnx_cache, max_length=length).tokenizer
        want = minilm._model.tokenizer(texts, padding=True, truncation=True, max_length=length)
        got = cached.encode_batch(texts)
        assert [e.ids for e in got] == want["input_ids"]
        assert [e.attention_mask for e in got] == want["attention_mask"]
        assert [e.type_ids for e in got] == want["token_type_ids"]
    instructed = OnnxEmbedder("all-MiniLM-L6-v2", query_instruction="search query: ", cache_dir=onnx_cache)
    assert instructed.embed_queries(["capital of France"])[0] == pytest.approx(
        minilm.embed_documents(["search query: capital of France"])[0], abs=1e-5
    )


def test_a_cached_export_serves_queries_without_loading_torch(onnx_cache):
    """A second start (a retrieval service's restart) reads the graph and the query side only:
    neither sentence-transformers nor torch is imported until a document is embedded."""
    from services.retrieval.onnx_embedder import OnnxEmbedder

    OnnxEmbedder("all-MiniLM-L6-v2", cache_dir=onnx_cache)  # exported (or already cached)
    script = (
        "import sys\n"
        "from services.retrieval.onnx_embedder import OnnxEmbedder\n"
        f"e = OnnxEmbedder('all-MiniLM-L6-v2', cache_dir={str(onnx_cache)!r})\n"
        "q = e.embed_queries(['capital of France'])\n"
        "print(sorted(m for m in ('torch', 'sentence_transformers') if m in sys.modules))\n"
        "d = e.embed_documents(['Paris is the capital of France.'])\n"
        "print(sorted(m for m in ('torch', 'sentence_transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[:2] == ["[]", "['sentence_transformers', 'torch']"]


def test_an_unfaithful_export_is_refused_not_served(minilm, onnx_cache, monkeypatch):
    from services.retrieval import onnx_embedder

    real_check = onnx_embedder._check_export
    monkeypatch.setattr(
        onnx_embedder, "_check_export", lambda st, names, graph: real_check(st, names, graph, tolerance=-1.0)
    )
    with pytest.raises(onnx_embedder.ExportMismatch, match="use embed_runtime=torch"):
        onnx_embedder.OnnxEmbedder("all-MiniLM-L6-v2", max_length=128, cache_dir=onnx_cache / "other")
    assert not list((onnx_cache / "other").glob("*.onnx"))  # nothing half-checked is cached


def test_embed_runtime_setting_picks_the_embedder(onnx_cache):
    from services.retrieval.index import make_embedder
    from services.retrieval.onnx_embedder import OnnxEmbedder
    from services.retrieval.settings import RetrievalSettings

    assert isinstance(
        make_embedder("all-MiniLM-L6-v2", RetrievalSettings(embed_cache_dir=onnx_cache)), OnnxEmbedder
    )
    torch_one = make_embedder("all-MiniLM-L6-v2", RetrievalSettings(embed_runtime="torch"))
    assert isinstance(torch_one, SentenceTransformerEmbedder)


def test_qwen3_embedding_gets_the_browsecomp_plus_recipe():
    instruction, doc_tokens = retrieval_recipe("Qwen/Qwen3-Embedding-8B")
    assert instruction == (
        "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
    )
    assert doc_tokens == 4096
    assert retrieval_recipe("/models/qwen3-embedding-0.6b") == (instruction, 4096)
    assert retrieval_recipe("all-MiniLM-L6-v2") == (None, None)


class RecordingEmbedder:
    """Wraps an embedder and records every batch it is asked for."""

    def __init__(self, inner, fail: bool = False):
        self.inner, self.fail = inner, fail
        self.name, self.dim = inner.name, inner.dim
        self.calls: list[int] = []

    def embed_queries(self, texts):
        self.calls.append(len(texts))
        if self.fail:
            raise RuntimeError("model crashed")
        return self.inner.embed_queries(texts)

    def embed_documents(self, texts):
        return self.inner.embed_documents(texts)


def test_micro_batching_folds_concurrent_queries(minilm):
    texts = [f"question number {i} about topic {i % 7}" for i in range(50)]
    single = np.stack([minilm.embed_queries([t])[0] for t in texts])
    recorder = RecordingEmbedder(minilm)
    sizes: list[int] = []
    batcher = MicroBatchingEmbedder(recorder, max_batch=32, max_wait_ms=5.0, on_batch=sizes.append)

    async def scenario():
        return await asyncio.gather(*(batcher.embed_query(t) for t in texts))

    vectors = np.stack(asyncio.run(scenario()))
    batcher.close()
    assert np.allclose(vectors, single, atol=1e-5)
    assert 2 <= batcher.batches <= 5 and sum(recorder.calls) == batcher.items == 50
    assert max(recorder.calls) <= 32 and sizes == recorder.calls


def test_micro_batching_error_reaches_every_waiter():
    recorder = RecordingEmbedder(HashingEmbedder(16), fail=True)
    batcher = MicroBatchingEmbedder(recorder, max_batch=8, max_wait_ms=2.0)

    async def scenario():
        return await asyncio.gather(*(batcher.embed_query(f"q{i}") for i in range(5)), return_exceptions=True)

    outcomes = asyncio.run(scenario())
    batcher.close()
    assert all(isinstance(o, RuntimeError) and "model crashed" in str(o) for o in outcomes)
    assert recorder.calls == [5] and batcher.batches == 0


def test_micro_batching_keeps_the_loop_free():
    class SlowEmbedder(HashingEmbedder):
        def embed_queries(self, texts):
            time.sleep(0.3)
            return super().embed_queries(texts)

    batcher = MicroBatchingEmbedder(SlowEmbedder(16), max_wait_ms=1.0)

    async def scenario():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        await batcher.embed_query("hello")
        task.cancel()
        return ticks

    assert asyncio.run(scenario()) >= 10  # the loop ran while the model worked
    batcher.close()


def test_hashing_embedder_is_deterministic_and_normalised():
    embedder = HashingEmbedder(dim=64)
    a = embedder.embed_documents(
        ["red fox in the forest", "red fox in the forest", "bank interest rates", ""]
    )
    assert a.shape == (4, 64) and a.dtype == np.float32
    assert np.linalg.norm(a, axis=1) == pytest.approx(1.0, abs=1e-6)
    assert np.array_equal(a[0], a[1])
    assert np.array_equal(a[0], HashingEmbedder(dim=64).embed_queries(["Red fox in the forest"])[0])
    near = embedder.embed_queries(["red fox"])[0]
    assert near @ a[0] > near @ a[2]
