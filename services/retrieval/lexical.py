"""Lexical (BM25) indexes: in-process ``bm25s`` and Elasticsearch.

Both follow BrowseComp-Plus, whose BM25 baseline is pyserini with its defaults: k1 = 0.9,
b = 0.4, Lucene's English analyzer (standard tokenizer, possessive filter, lowercase, the 33
Lucene English stopwords, Porter stemming), one field holding the whole document (the title is
already in the text's front matter).

- :class:`EmbeddedBM25` scores with bm25s ``method="lucene"``: Lucene's BM25 since 8.0,
  idf = ln(1 + (N - n + 0.5) / (n + 0.5)) and tf / (tf + k1 (1 - b + b dl / avgdl)), the same
  ranking as ``(k1 + 1)``-scaled Robertson BM25 but never a negative idf. It removes Lucene's
  stopwords and stems with Porter only when PyStemmer is installed (it is optional); scores
  then differ from pyserini's by the stemming and by Lucene's lossy one-byte length norms.
- :class:`ElasticsearchLexical` declares the same BM25 as a named similarity with the
  ``english`` analyzer, so an Elasticsearch index matches pyserini's analysis as well.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import bm25s
import numpy as np
from bm25s.stopwords import STOPWORDS_EN
from elastic_transport import TransportError
from elasticsearch import ApiError, BadRequestError, Elasticsearch, NotFoundError, helpers

from core.kit.logging import redact, register_secret
from services.retrieval.backends import BackendUnavailable, Doc, Ranked

log = logging.getLogger(__name__)

# bm25s's STOPWORDS_EN is exactly Lucene's EnglishAnalyzer.ENGLISH_STOP_WORDS_SET (33 words).
LUCENE_ENGLISH_STOPWORDS = frozenset(STOPWORDS_EN)
# Unicode words, apostrophes inside a word kept (Lucene's StandardTokenizer keeps "don't" whole).
_WORD = re.compile(r"\w+(?:['\u2019]\w+)*")
_FORMAT = 1


def _porter_stemmer():
    """PyStemmer's English (Porter) stemmer, or None when PyStemmer is not installed."""
    try:
        import Stemmer  # PyStemmer
    except ImportError:
        return None
    return Stemmer.Stemmer("porter")


def analyze(text: str, stemmer=None) -> list[str]:
    """Lucene-English-like analysis: lowercase words, possessive 's dropped, stopwords removed."""
    tokens = []
    for token in _WORD.findall(text.lower()):
        if token.endswith(("'s", "\u2019s")):
            token = token[:-2]
        if token and token not in LUCENE_ENGLISH_STOPWORDS:
            tokens.append(token)
    return stemmer.stemWords(tokens) if stemmer is not None and tokens else tokens


def _top_k(scores: np.ndarray, docids: Sequence[str], k: int) -> Ranked:
    """Positive scores, best first, ties by docid; every tie at the k-th score is considered."""
    hits = np.flatnonzero(scores > 0)
    if hits.size > k:
        kth = np.partition(scores[hits], hits.size - k)[hits.size - k]
        hits = hits[scores[hits] >= kth]
    ranked = sorted(((docids[i], float(scores[i])) for i in hits), key=lambda pair: (-pair[1], pair[0]))
    return ranked[:k]


class EmbeddedBM25:
    """In-process BM25 over bm25s, persisted under ``index_dir/lexical/``.

    Build: ``add()`` batches (docid order kept; a re-added docid replaces its text in place),
    then ``finalize()`` indexes and saves. Serve: :meth:`load` loads a saved index with its
    score matrix memory-mapped. The index searches what the last ``finalize()`` (or ``load``)
    saw; an index opened for serving is read-only.
    """

    name = "bm25s"

    def __init__(self, index_dir: Path, k1: float = 0.9, b: float = 0.4) -> None:
        self.index_dir = Path(index_dir)
        self.k1 = k1
        self.b = b
        self._stemmer = _porter_stemmer()
        self._read_only = False
        # Pending corpus: per document its term ids into _vocab (int32; texts are not kept).
        self._vocab: dict[str, int] = {}
        self._slots: dict[str, int] = {}
        self._docids: list[str] = []
        self._terms: list[np.ndarray] = []
        # What search() answers from, swapped as one tuple: (retriever, vocab, docids).
        self._searchable: tuple[bm25s.BM25 | None, Mapping[str, int], list[str]] = (None, {}, [])

    @property
    def path(self) -> Path:
        return self.index_dir / "lexical"

    @classmethod
    def load(cls, index_dir: Path, *, mmap: bool = True) -> EmbeddedBM25:
        """Load the index saved under ``index_dir/lexical/`` for serving (read-only)."""
        path = Path(index_dir) / "lexical"
        manifest_path = path / "manifest.json"
        if not manifest_path.exists():
            raise FileNotFoundError(f"no lexical index at {path} (run the ingest first)")
        manifest = json.loads(manifest_path.read_text())
        index = cls(index_dir, k1=manifest["k1"], b=manifest["b"])
        # Queries must be analysed exactly as the documents were, whatever is installed now.
        if manifest["stemmer"] == "porter" and index._stemmer is None:
            raise RuntimeError(f"{path} was built with Porter stemming; install PyStemmer to serve it")
        if manifest["stemmer"] is None:
            index._stemmer = None
        docids = json.loads((path / "docids.json").read_text())
        retriever = bm25s.BM25.load(path, mmap=mmap, show_progress=False) if manifest["vocab_size"] else None
        index._searchable = (retriever, retriever.vocab_dict if retriever else {}, docids)
        index._read_only = True
        return index

    def add(self, docs: Sequence[Doc]) -> None:
        if self._read_only:
            raise RuntimeError("this index was opened for serving; build a new EmbeddedBM25 to re-index")
        for doc in docs:
            terms = analyze(doc.text, self._stemmer)
            vocab = self._vocab
            ids = np.fromiter((vocab.setdefault(t, len(vocab)) for t in terms), np.int32, len(terms))
            slot = self._slots.get(doc.docid)
            if slot is None:
                self._slots[doc.docid] = len(self._docids)
                self._docids.append(doc.docid)
                self._terms.append(ids)
            else:
                self._terms[slot] = ids

    def finalize(self) -> None:
        """Index everything added and save it, replacing any index saved before."""
        if self._read_only:
            return
        vocab, corpus_ids = self._compact_vocab()
        retriever = None
        if vocab:
            retriever = bm25s.BM25(k1=self.k1, b=self.b, method="lucene")
            retriever.index((corpus_ids, vocab), create_empty_token=False, show_progress=False)
        staging = self.index_dir / ".lexical.staging"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        if retriever is not None:
            retriever.save(staging, show_progress=False)
        (staging / "docids.json").write_text(json.dumps(self._docids))
        manifest = {
            "format": _FORMAT,
            "scorer": "bm25s",
            "method": "lucene",
            "k1": self.k1,
            "b": self.b,
            "stopwords": "lucene-english",
            "stemmer": "porter" if self._stemmer is not None else None,
            "count": len(self._docids),
            "vocab_size": len(vocab),
        }
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=2))
        # Swap directories so a reader never sees a half-written index.
        retired = self.index_dir / ".lexical.retired"
        shutil.rmtree(retired, ignore_errors=True)
        if self.path.exists():
            os.replace(self.path, retired)
        os.replace(staging, self.path)
        shutil.rmtree(retired, ignore_errors=True)
        self._searchable = (retriever, vocab, list(self._docids))

    def _compact_vocab(self) -> tuple[dict[str, int], list[np.ndarray]]:
        """Dense term ids over the terms still in use (replaced texts may have orphaned some).

        Documents stay int32 arrays: bm25s accepts them, and Python int lists would take about
        4.5x the memory (tens of GB for BrowseComp-Plus's ~500M tokens).
        """
        used = np.unique(np.concatenate(self._terms)) if self._terms else np.zeros(0, np.int32)
        remap = np.full(len(self._vocab), -1, dtype=np.int32)
        remap[used] = np.arange(used.size, dtype=np.int32)
        vocab = {term: int(remap[old]) for term, old in self._vocab.items() if remap[old] >= 0}
        return vocab, [remap[ids] for ids in self._terms]

    def search(self, query: str, k: int) -> Ranked:
        retriever, vocab, docids = self._searchable
        if k <= 0 or retriever is None:
            return []
        ids = [vocab[t] for t in analyze(query, self._stemmer) if t in vocab]
        if not ids:
            return []
        return _top_k(retriever.get_scores_from_ids(ids), docids, k)

    def count(self) -> int:
        return len(self._searchable[2])

    def close(self) -> None:
        self._searchable = (None, {}, [])


# --------------------------------------------------------------------------- Elasticsearch

SIMILARITY = "bcstack_bm25"


class BulkIngestError(BackendUnavailable):
    """Some documents of a bulk request were rejected; ``failures`` holds the first few."""

    def __init__(self, message: str, failures: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.failures = failures


def _secrets_of(
    url: str, api_key: str | tuple[str, str] | None, basic_auth: tuple[str, str] | None
) -> list[str]:
    secrets = []
    if isinstance(api_key, str):
        secrets.append(api_key)
    elif api_key is not None:
        key_id, key = api_key
        secrets += [key, base64.b64encode(f"{key_id}:{key}".encode()).decode()]
    if basic_auth is not None:
        secrets.append(basic_auth[1])
    password = urlsplit(url).password
    if password:
        secrets.append(password)
    return secrets


class ElasticsearchLexical:
    """Elasticsearch BM25 and doc store over the official client.

    The index (created when missing, on first ``add`` or ``ensure_index``) declares
    ``index.similarity.bcstack_bm25 = {type: BM25, k1, b}``; ``text`` and ``title`` use it with
    the ``english`` analyzer; ``docid``/``url`` are keywords and ``_id`` is the docid, so a
    re-ingest overwrites instead of duplicating. Search is a ``match`` on ``text`` alone: the
    BrowseComp-Plus baseline indexed one field holding the whole page, title included, so
    boosting ``title`` again would rank differently from the benchmark's BM25.

    ``client`` injects a prebuilt ``Elasticsearch`` (tests, custom transports) and
    ``client_options`` adds keyword arguments to the one built here. Any transport error,
    timeout or error status becomes :class:`BackendUnavailable`, with secrets redacted.
    """

    name = "elasticsearch"

    def __init__(
        self,
        url: str,
        index: str,
        *,
        api_key: str | tuple[str, str] | None = None,
        basic_auth: tuple[str, str] | None = None,
        verify_certs: bool = True,
        ca_certs: str | None = None,
        request_timeout: float = 5.0,
        k1: float = 0.9,
        b: float = 0.4,
        analyzer: str = "english",
        max_retries: int = 1,
        bulk_chunk_docs: int = 500,
        client: Elasticsearch | None = None,
        client_options: Mapping[str, Any] | None = None,
    ) -> None:
        for secret in _secrets_of(url, api_key, basic_auth):
            register_secret(secret)
        self.url = url
        self.index = index
        self.k1 = k1
        self.b = b
        self.analyzer = analyzer
        self.bulk_chunk_docs = bulk_chunk_docs
        self._index_ready = False
        self._own_client = client is None
        self._client = client or Elasticsearch(
            url,
            api_key=api_key,
            basic_auth=basic_auth,
            verify_certs=verify_certs,
            ca_certs=ca_certs,
            request_timeout=request_timeout,
            max_retries=max_retries,
            retry_on_timeout=False,
            **dict(client_options or {}),
        )

    @property
    def client(self) -> Elasticsearch:
        return self._client

    @contextmanager
    def _errors(self, action: str) -> Iterator[None]:
        """Client errors (connection, timeout, error status) as BackendUnavailable, secrets redacted."""
        try:
            yield
        except (ApiError, TransportError) as exc:
            raise BackendUnavailable(
                redact(f"elasticsearch {action} on index {self.index!r} failed: {exc}")
            ) from None

    def index_body(self) -> dict[str, Any]:
        """Settings and mappings the index is created with."""
        field = {"type": "text", "similarity": SIMILARITY, "analyzer": self.analyzer}
        return {
            "settings": {"index": {"similarity": {SIMILARITY: {"type": "BM25", "k1": self.k1, "b": self.b}}}},
            "mappings": {
                "properties": {
                    "docid": {"type": "keyword"},
                    "url": {"type": "keyword"},
                    "title": field,
                    "text": field,
                }
            },
        }

    def ensure_index(self) -> None:
        """Create the index when missing; warn when an existing one has other BM25 parameters."""
        if self._index_ready:
            return
        indices = self._client.indices
        with self._errors("create"):
            if not indices.exists(index=self.index):
                try:
                    indices.create(index=self.index, **self.index_body())
                except BadRequestError as exc:
                    if exc.error != "resource_already_exists_exception":  # another ingest won the race
                        raise
            settings = indices.get_settings(index=self.index).body
        index_settings = next(iter(settings.values()), {}).get("settings", {}).get("index", {})
        bm25 = index_settings.get("similarity", {}).get(SIMILARITY, {})
        if (str(bm25.get("k1")), str(bm25.get("b"))) != (str(self.k1), str(self.b)):
            log.warning(
                "index %s has BM25 %s, not k1=%s b=%s; a similarity changes only by reindexing",
                self.index,
                bm25 or "defaults",
                self.k1,
                self.b,
            )
        self._index_ready = True

    def _actions(self, docs: Sequence[Doc]) -> Iterator[dict[str, Any]]:
        for doc in docs:
            yield {
                "_index": self.index,
                "_id": doc.docid,
                "_source": {"docid": doc.docid, "url": doc.url, "title": doc.title, "text": doc.text},
            }

    def add(self, docs: Sequence[Doc]) -> None:
        if not docs:
            return
        self.ensure_index()
        with self._errors("bulk"):
            _, errors = helpers.bulk(
                self._client,
                self._actions(docs),
                chunk_size=self.bulk_chunk_docs,
                max_chunk_bytes=20 * 1024 * 1024,
                raise_on_error=False,
                max_retries=3,  # retries 429 rejections only; other failures are reported below
            )
        if errors:
            failures = [next(iter(item.values())) for item in errors[:5]]
            summary = "; ".join(
                f"{f.get('_id')}: {f.get('status')} {(f.get('error') or {}).get('type')} "
                f"({(f.get('error') or {}).get('reason')})"
                for f in failures
            )
            message = f"elasticsearch bulk: {len(errors)} of {len(docs)} documents failed; first: {summary}"
            raise BulkIngestError(redact(message), failures)

    def finalize(self) -> None:
        self.ensure_index()
        with self._errors("refresh"):
            self._client.indices.refresh(index=self.index)

    def search(self, query: str, k: int) -> Ranked:
        if k <= 0 or not query.strip():
            return []
        with self._errors("search"):
            response = self._client.search(
                index=self.index,
                query={"match": {"text": {"query": query}}},
                size=min(k, 10_000),  # index.max_result_window
                source=False,
                track_total_hits=False,
                # Equal scores in docid order, as the embedded index does; an explicit sort leaves
                # hit scores unset unless track_scores asks for them.
                sort=[{"_score": "desc"}, {"docid": "asc"}],
                track_scores=True,
            )
        hits = response["hits"]["hits"]
        return [
            (hit["_id"], float(hit["_score"] if hit.get("_score") is not None else hit["sort"][0]))
            for hit in hits
        ]

    def count(self) -> int:
        with self._errors("count"):
            try:
                return int(self._client.count(index=self.index)["count"])
            except NotFoundError:
                return 0

    def get(self, docid: str) -> Doc | None:
        with self._errors("get"):
            try:
                response = self._client.get(index=self.index, id=docid)
            except NotFoundError:
                return None
        return _doc_from_source(response["_source"])

    def get_by_url(self, url: str) -> Doc | None:
        with self._errors("get_by_url"):
            response = self._client.search(index=self.index, query={"term": {"url": url}}, size=1)
        hits = response["hits"]["hits"]
        return _doc_from_source(hits[0]["_source"]) if hits else None

    def get_many(self, docids: Sequence[str]) -> dict[str, Doc]:
        """The documents found among ``docids`` (one ``_mget``), keyed by docid."""
        if not docids:
            return {}
        with self._errors("mget"):
            try:
                response = self._client.mget(index=self.index, ids=list(docids))
            except NotFoundError:
                return {}
        docs = (_doc_from_source(d["_source"]) for d in response["docs"] if d.get("found"))
        return {doc.docid: doc for doc in docs}

    def close(self) -> None:
        if self._own_client:
            self._client.close()


def _doc_from_source(source: Mapping[str, Any]) -> Doc:
    return Doc(
        docid=source["docid"],
        text=source.get("text", ""),
        url=source.get("url", ""),
        title=source.get("title", ""),
    )
