"""Build and open a retrieval index: the manifest, the backends, and the one-pass ingest.

An index directory holds:

    manifest.json      what it was built with (backends, embedder, BM25 k1/b, counts, complete)
    docstore.sqlite    documents + vectors; the ingest ledger (see docstore.py)
    lexical/           the bm25s index (embedded lexical backend only)
    dense/             the Qdrant Edge shard (edge dense backend only)

With ``dense: none`` (``bcstack index --dense none``) an index is lexical only: the embedder is
never loaded, documents are stored without vectors, no dense/ folder is written, and the
manifest records ``"dense": "none"`` and ``"embedder": null``. Embedding dominates the cost of
an ingest, so a world built only to collect training data indexes far faster this way (2,000
toy documents on 2 busy CPU cores: 167 s with all-MiniLM-L6-v2 on ONNX, 0.8 s without).

Ingest reads the corpus once, in batches: new documents are embedded, sent to the remote
backends when those are used (Elasticsearch bulk, Qdrant upsert — both keyed by docid, so a
retry never duplicates) and committed with their vectors to the doc store. Killed at any point
and re-run, it skips the documents already committed. The in-process indexes (bm25s, Edge) are
then built from the doc store in a final step, which is cheap next to embedding.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from services.retrieval.backends import BackendUnavailable, DenseIndex, Doc, Embedder, LexicalIndex
from services.retrieval.corpus import CorpusError, count_rows, read_corpus
from services.retrieval.docstore import DocStore
from services.retrieval.settings import RetrievalSettings, secret

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"


class RetrievalIndexError(RuntimeError):
    """The index directory cannot be built or opened as asked; the message says why."""


def read_manifest(index_dir: Path) -> dict[str, Any] | None:
    path = Path(index_dir) / MANIFEST
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RetrievalIndexError(f"{path}: unreadable manifest ({e})") from None


def write_manifest(index_dir: Path, manifest: dict[str, Any]) -> None:
    path = Path(index_dir) / MANIFEST
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


# --- backends ------------------------------------------------------------------------------------


def make_embedder(model: str, settings: RetrievalSettings) -> Embedder:
    options: dict[str, Any] = {
        "batch_size": settings.embed_doc_batch_size,
        "num_threads": settings.embed_threads,
    }
    if settings.embed_max_length is not None:
        options.update(max_length=settings.embed_max_length, doc_max_length=settings.embed_max_length)
    try:
        if settings.embed_runtime == "onnx":
            from services.retrieval.onnx_embedder import OnnxEmbedder

            return OnnxEmbedder(model, cache_dir=settings.embed_cache_dir, **options)
        from services.retrieval.embedder import SentenceTransformerEmbedder

        return SentenceTransformerEmbedder(model, **options)
    except Exception as e:  # a wrong name or path: say which, never a traceback
        raise RetrievalIndexError(f"cannot load embedder {model!r}: {e}") from None


def make_lexical(
    kind: str, index_dir: Path, settings: RetrievalSettings, *, for_serving: bool
) -> LexicalIndex:
    if kind == "embedded":
        from services.retrieval.lexical import EmbeddedBM25

        if for_serving:
            return EmbeddedBM25.load(index_dir)
        return EmbeddedBM25(index_dir, k1=settings.bm25_k1, b=settings.bm25_b)
    if kind == "elasticsearch":
        from services.retrieval.lexical import ElasticsearchLexical

        if not settings.elasticsearch_url:
            raise RetrievalIndexError(
                "lexical backend elasticsearch needs BCSTACK_RETRIEVAL_ELASTICSEARCH_URL"
            )
        basic = None
        if settings.elasticsearch_username:
            basic = (settings.elasticsearch_username, secret(settings.elasticsearch_password) or "")
        return ElasticsearchLexical(
            settings.elasticsearch_url,
            settings.elasticsearch_index,
            api_key=secret(settings.elasticsearch_api_key),
            basic_auth=basic,
            verify_certs=settings.elasticsearch_verify_certs,
            ca_certs=str(settings.elasticsearch_ca_certs) if settings.elasticsearch_ca_certs else None,
            request_timeout=settings.backend_timeout_seconds,
            k1=settings.bm25_k1,
            b=settings.bm25_b,
        )
    raise RetrievalIndexError(f"unknown lexical backend {kind!r}")


def make_dense(kind: str, index_dir: Path, dim: int, settings: RetrievalSettings) -> DenseIndex:
    if kind == "edge":
        from services.retrieval.dense import EdgeDense

        return EdgeDense(index_dir, dim)
    if kind == "qdrant":
        from services.retrieval.dense import QdrantDense

        if not settings.qdrant_url:
            raise RetrievalIndexError("dense backend qdrant needs BCSTACK_RETRIEVAL_QDRANT_URL")
        return QdrantDense(
            settings.qdrant_url,
            settings.qdrant_collection,
            dim,
            api_key=secret(settings.qdrant_api_key),
            timeout=settings.backend_timeout_seconds,
        )
    raise RetrievalIndexError(f"unknown dense backend {kind!r}")


# --- ingest --------------------------------------------------------------------------------------


@dataclass
class IngestReport:
    index_dir: Path
    added: int = 0
    resumed: int = 0  # already committed by an earlier, interrupted run
    duplicates: list[str] = field(default_factory=list)  # "where: docid X (first at ...)"
    total: int = 0  # documents in the index at the end
    seconds: float = 0.0
    up_to_date: bool = False


ProgressFn = Callable[[int, int | None], None]  # (rows done, rows total or None)


def ingest(
    corpus: str | Path,
    index_dir: str | Path,
    settings: RetrievalSettings,
    *,
    on_duplicate: str = "error",
    progress: ProgressFn | None = None,
    embedder: Embedder | None = None,
    lexical: LexicalIndex | None = None,
) -> IngestReport:
    """Index ``corpus`` into ``index_dir`` (resuming an interrupted run); see the module docstring.

    ``embedder`` and ``lexical`` replace the ones the settings would build (tests, or a client
    configured in code); a given lexical backend must be the remote kind the settings name.
    With dense kind ``none`` no embedder is used, a given one included.
    """
    if on_duplicate not in ("error", "skip"):
        raise ValueError("on_duplicate is 'error' or 'skip'")
    start = time.perf_counter()
    index_dir = Path(index_dir)
    corpus = Path(corpus)
    if not corpus.is_file():
        raise CorpusError(f"{corpus}: no such file")
    index_dir.mkdir(parents=True, exist_ok=True)
    old = read_manifest(index_dir)
    lexical_kind = settings.lexical or (old or {}).get("lexical") or "embedded"
    dense_kind = settings.dense or (old or {}).get("dense") or "edge"
    old_model = ((old or {}).get("embedder") or {}).get("model")
    model = None
    if dense_kind != "none":
        model = (
            (embedder.name if embedder is not None else None)
            or settings.embedder_model
            or old_model
            or DEFAULT_EMBEDDER
        )
    if old is not None:
        for key, now in (("lexical", lexical_kind), ("dense", dense_kind)):
            if old.get(key) != now:
                raise RetrievalIndexError(
                    f"{index_dir} was built with {key} backend {old.get(key)!r}, not {now!r}; "
                    "use a new --index-dir"
                )
        if old_model != model:
            raise RetrievalIndexError(
                f"{index_dir} was built with embedder {old_model!r}, not {model!r}; use a new --index-dir"
            )
    # Lexical only (dense none): no model, so the embedder is never loaded (a given one is unused).
    embedder = None if model is None else (embedder or make_embedder(model, settings))
    manifest: dict[str, Any] = {
        "version": MANIFEST_VERSION,
        "lexical": lexical_kind,
        "dense": dense_kind,
        "embedder": None
        if embedder is None
        else {"model": model, "dim": embedder.dim, "max_length": settings.embed_max_length},
        "bm25": {"k1": settings.bm25_k1, "b": settings.bm25_b},
        "elasticsearch_index": settings.elasticsearch_index if lexical_kind == "elasticsearch" else None,
        "qdrant_collection": settings.qdrant_collection if dense_kind == "qdrant" else None,
        "corpus": {"path": str(corpus.resolve()), "bytes": corpus.stat().st_size},
        "complete": False,
        "documents": 0,
    }
    store = DocStore(index_dir)
    report = IngestReport(index_dir)
    total_rows = count_rows(corpus)
    same_corpus = old and old.get("complete") and old.get("corpus", {}).get("bytes") == corpus.stat().st_size
    if same_corpus and total_rows is not None and store.count() == total_rows:
        report.up_to_date, report.total = True, store.count()
        report.seconds = time.perf_counter() - start
        store.close()
        return report
    write_manifest(index_dir, manifest)

    remote_lexical = None
    if lexical_kind == "elasticsearch":
        remote_lexical = lexical or make_lexical(lexical_kind, index_dir, settings, for_serving=False)
    remote_dense = None
    if dense_kind == "qdrant" and embedder is not None:
        remote_dense = make_dense(dense_kind, index_dir, embedder.dim, settings)
    seen_at: dict[str, str] = {}
    done = 0
    batch: list[Doc] = []

    def flush() -> None:
        nonlocal batch
        if not batch:
            return
        new = [d for d in batch if d.docid not in store.known([d.docid for d in batch])]
        report.resumed += len(batch) - len(new)
        if new:
            vectors = None if embedder is None else embedder.embed_documents([d.text for d in new])
            if remote_lexical is not None:
                remote_lexical.add(new)
            if remote_dense is not None and vectors is not None:
                remote_dense.upsert([d.docid for d in new], vectors)
            store.add(new, vectors)
            report.added += len(new)
        batch = []

    try:
        for row in read_corpus(corpus):
            done += 1
            first = seen_at.get(row.doc.docid)
            if first is not None:
                message = f"{row.where}: duplicate docid {row.doc.docid!r} (first at {first})"
                if on_duplicate == "error":
                    flush()
                    raise CorpusError(message + "; fix the file or pass --on-duplicate skip")
                report.duplicates.append(message)
                continue
            seen_at[row.doc.docid] = row.where
            batch.append(row.doc)
            if len(batch) >= settings.ingest_batch_size:
                flush()
                if progress:
                    progress(done, total_rows)
        flush()
        if progress:
            progress(done, total_rows)
        dim = None if embedder is None else embedder.dim
        _finalize(index_dir, store, dim, lexical_kind, dense_kind, settings, remote_lexical, remote_dense)
    finally:
        for backend in (remote_lexical, remote_dense):
            if backend is not None and backend is not lexical:  # an injected backend is the caller's
                backend.close()
    report.total = store.count()
    store.close()
    manifest.update(complete=True, documents=report.total)
    write_manifest(index_dir, manifest)
    report.seconds = time.perf_counter() - start
    return report


def _finalize(
    index_dir: Path,
    store: DocStore,
    dim: int | None,
    lexical_kind: str,
    dense_kind: str,
    settings: RetrievalSettings,
    remote_lexical: LexicalIndex | None,
    remote_dense: DenseIndex | None,
) -> None:
    """Build the in-process indexes from the doc store; refresh the remote ones."""
    if remote_lexical is not None:
        remote_lexical.finalize()
    else:
        lexical = make_lexical(lexical_kind, index_dir, settings, for_serving=False)
        for docs in store.iter_docs():  # embedded lexical: the doc store holds the texts
            lexical.add(docs)
        lexical.finalize()
        lexical.close()
    if remote_dense is not None:
        remote_dense.finalize()
    elif dim is not None:  # None: a lexical-only index has no dense part
        dense = make_dense(dense_kind, index_dir, dim, settings)
        for docids, vectors in store.iter_vectors(dim):
            dense.upsert(docids, vectors)
        dense.finalize()
        dense.close()


class PageLookup(Protocol):
    """Where full documents come from: the doc store, or Elasticsearch's _source in that mode."""

    def get(self, docid: str) -> Doc | None: ...

    def get_by_url(self, url: str) -> Doc | None: ...

    def get_many(self, docids: Sequence[str]) -> dict[str, Doc]: ...


class FallbackPages:
    """Pages from Elasticsearch's ``_source`` in that mode, from the local doc store while it is down.

    The doc store keeps every text in every mode, so a search that lost its lexical backend
    can still show the dense retriever's pages (and open_page keeps working).
    """

    def __init__(self, primary: PageLookup, fallback: PageLookup) -> None:
        self.primary, self.fallback = primary, fallback

    def _either(self, method: str, arg: Any) -> Any:
        try:
            return getattr(self.primary, method)(arg)
        except BackendUnavailable:
            return getattr(self.fallback, method)(arg)

    def get(self, docid: str) -> Doc | None:
        return self._either("get", docid)

    def get_by_url(self, url: str) -> Doc | None:
        return self._either("get_by_url", url)

    def get_many(self, docids: Sequence[str]) -> dict[str, Doc]:
        return self._either("get_many", docids)


@dataclass
class OpenedIndex:
    manifest: dict[str, Any]
    store: DocStore
    lexical: LexicalIndex
    dense: DenseIndex | None  # None, and no embedder, for a lexical-only index (dense kind none)
    embedder: Embedder | None
    pages: PageLookup

    def close(self) -> None:
        for part in (self.lexical, self.dense):
            if part is not None:
                part.close()
        self.store.close()


def open_index(
    settings: RetrievalSettings, *, embedder: Embedder | None = None, lexical: LexicalIndex | None = None
) -> OpenedIndex:
    """Open a complete index for serving, with the backends its manifest names (or the settings').

    ``embedder`` and ``lexical`` replace the ones the settings would build (see :func:`ingest`).
    Dense kind ``none`` (the manifest's or the settings') opens it lexical only, without loading
    the embedder; an index built lexical only cannot be served with a dense backend.
    """
    if settings.index_dir is None:
        raise RetrievalIndexError("no index directory: pass --index-dir or set BCSTACK_RETRIEVAL_INDEX_DIR")
    index_dir = Path(settings.index_dir)
    manifest = read_manifest(index_dir)
    if manifest is None:
        raise RetrievalIndexError(
            f"{index_dir} holds no index; build one with `bcstack index --corpus FILE --index-dir DIR`"
        )
    if not manifest.get("complete"):
        raise RetrievalIndexError(
            f"{index_dir}: the ingest did not finish; re-run `bcstack index` to resume it"
        )
    lexical_kind = settings.lexical or manifest["lexical"]
    dense_kind = settings.dense or manifest["dense"]
    if manifest["dense"] == "none" and dense_kind != "none":
        raise RetrievalIndexError(
            f"{index_dir} was built lexical only (--dense none) and has no vectors for dense backend "
            f"{dense_kind!r}; serve it with dense none or build a new index"
        )
    dense: DenseIndex | None = None
    if dense_kind != "none":
        model = (
            (embedder.name if embedder is not None else None)
            or settings.embedder_model
            or manifest["embedder"]["model"]
        )
        if model != manifest["embedder"]["model"]:
            raise RetrievalIndexError(
                f"{index_dir} was embedded with {manifest['embedder']['model']!r}; "
                "queries must use the same model"
            )
        embedder = embedder or make_embedder(model, settings)
    else:
        embedder = None
    store = DocStore(index_dir, readonly=True)
    lexical = lexical or make_lexical(lexical_kind, index_dir, settings, for_serving=True)
    if embedder is not None:
        dense = make_dense(dense_kind, index_dir, manifest["embedder"]["dim"], settings)
    pages: PageLookup = store
    if lexical_kind == "elasticsearch":
        pages = FallbackPages(lexical, store)  # type: ignore[arg-type]
    return OpenedIndex(manifest, store, lexical, dense, embedder, pages)
