"""Dense (vector) indexes: Qdrant Edge in-process and a Qdrant server over qdrant-client.

Both store one cosine-distance vector per docid and answer batched top-k queries with cosine
similarity scores.

- :class:`EdgeDense` is the embedded default (DESIGN.md §6). Edge never indexes in the
  background: points land in an appendable segment searched by brute force, and only
  ``optimize()`` (called by ``finalize()``) builds HNSW, for segments larger than the indexing
  threshold (Qdrant's default, about 10 MB of vectors; smaller ones are scanned, which is
  faster there anyway). Measured on 100K x 384 random vectors, 2 CPU cores: optimize ~50 s,
  a top-10 query ~1 ms with HNSW against ~13 ms scanning.
- :class:`QdrantDense` is the production adapter. ``location`` is a server URL, ``":memory:"``
  or, with ``path``, qdrant-client's local mode (pure Python, for tests only).
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import qdrant_edge as edge

from core.kit.logging import redact, register_secret
from services.retrieval.backends import BackendUnavailable, Ranked

# Qdrant's own default for HnswConfig.full_scan_threshold (KB of vectors).
QDRANT_FULL_SCAN_THRESHOLD_KB = 10_000
# Point ids for the Qdrant server: uuid5 of the docid, stable across runs and machines.
DOCID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://github.com/browsecomp-stack/docid")


def _as_matrix(vectors: np.ndarray, dim: int) -> np.ndarray:
    matrix = np.asarray(vectors, dtype=np.float32)
    if matrix.ndim == 1:
        matrix = matrix[None, :]
    if matrix.ndim != 2 or matrix.shape[1] != dim:
        raise ValueError(f"expected vectors of shape (n, {dim}), got {np.shape(vectors)}")
    return matrix


class EdgeDense:
    """Qdrant Edge shard under ``index_dir/dense/`` (opened when present, created otherwise).

    Docids map to integer point ids by position in ``dense/docids.json``, kept in memory, so a
    search never reads payloads (reading them doubles query time); each point also carries
    ``{"docid": ...}`` as payload, from which the mapping is rebuilt if the process died
    between an upsert and ``finalize()``.
    """

    name = "qdrant-edge"

    def __init__(
        self,
        index_dir: Path,
        dim: int,
        *,
        hnsw_m: int = 16,
        ef_construct: int = 100,
        ef_search: int = 128,
        indexing_threshold_kb: int | None = None,
        full_scan_threshold_kb: int = QDRANT_FULL_SCAN_THRESHOLD_KB,
        upsert_batch: int = 1024,
    ) -> None:
        self.path = Path(index_dir) / "dense"
        self.dim = dim
        self.ef_search = ef_search
        self.upsert_batch = upsert_batch
        vector_params = edge.EdgeVectorParams(size=dim, distance=edge.Distance.Cosine)
        has_segments = (self.path / "segments").is_dir() and any((self.path / "segments").iterdir())
        if has_segments:
            # Vector params only: the shard's persisted HNSW and optimizer settings stay as built.
            self._shard = edge.EdgeShard.load(str(self.path), edge.EdgeConfig(vectors=vector_params))
        else:
            self.path.mkdir(parents=True, exist_ok=True)
            config = edge.EdgeConfig(
                vectors=vector_params,
                hnsw_config=edge.HnswIndexConfig(
                    m=hnsw_m, ef_construct=ef_construct, full_scan_threshold=full_scan_threshold_kb
                ),
                optimizers=edge.EdgeOptimizersConfig(indexing_threshold=indexing_threshold_kb),
            )
            self._shard = edge.EdgeShard.create(str(self.path), config)
        self._params = edge.SearchParams(hnsw_ef=ef_search)
        self._lock = threading.Lock()
        self._docids: list[str] = []
        self._ids: dict[str, int] = {}
        self._load_docids()

    @property
    def _docids_path(self) -> Path:
        return self.path / "docids.json"

    def _load_docids(self) -> None:
        if self._docids_path.exists():
            self._docids = json.loads(self._docids_path.read_text())
        self._ids = {docid: i for i, docid in enumerate(self._docids)}
        if self.count() > len(self._docids):
            self._recover_docids()

    def _recover_docids(self) -> None:
        """Rebuild the id -> docid list from the payloads (points upserted but never finalized)."""
        docids: dict[int, str] = {}
        offset = None
        while True:
            records, offset = self._shard.scroll(
                edge.ScrollRequest(offset=offset, limit=10_000, with_payload=True, with_vector=False)
            )
            docids.update((int(r.id), r.payload["docid"]) for r in records)
            if offset is None:
                break
        self._docids = [docids.get(i, "") for i in range(max(docids, default=-1) + 1)]
        self._ids = {docid: i for i, docid in enumerate(self._docids) if docid}

    def upsert(self, docids: Sequence[str], vectors: np.ndarray) -> None:
        matrix = _as_matrix(vectors, self.dim)
        if len(docids) != len(matrix):
            raise ValueError(f"{len(docids)} docids for {len(matrix)} vectors")
        with self._lock:
            ids = []
            for docid in docids:
                point_id = self._ids.get(docid)
                if point_id is None:
                    point_id = self._ids[docid] = len(self._docids)
                    self._docids.append(docid)
                ids.append(point_id)
        for start in range(0, len(ids), self.upsert_batch):
            points = [
                edge.Point(ids[i], matrix[i].tolist(), {"docid": docids[i]})
                for i in range(start, min(start + self.upsert_batch, len(ids)))
            ]
            self._shard.update(edge.UpdateOperation.upsert_points(points))

    def finalize(self) -> None:
        """Build HNSW for every segment over the indexing threshold, then persist shard and ids."""
        self._shard.optimize()
        self._shard.flush()
        tmp = self._docids_path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(self._docids))
        os.replace(tmp, self._docids_path)

    def search(self, vectors: np.ndarray, k: int) -> list[Ranked]:
        matrix = _as_matrix(vectors, self.dim)
        if k <= 0 or len(matrix) == 0:
            return [[] for _ in range(len(matrix))]
        requests = [
            edge.QueryRequest(
                limit=k, query=edge.Query.Nearest(row.tolist()), params=self._params, with_payload=False
            )
            for row in matrix
        ]
        results = self._shard.query_batch(edge.QueryBatchRequest(requests))
        docids = self._docids
        return [
            [(docids[p.id], float(p.score)) for p in points if p.id < len(docids) and docids[p.id]]
            for points in results
        ]

    def count(self) -> int:
        return int(self._shard.count(edge.CountRequest(exact=True)))

    def indexed_count(self) -> int:
        """Vectors inside an HNSW index (the rest are scanned); for checks and metrics."""
        return int(self._shard.info().indexed_vectors_count)

    def close(self) -> None:
        self._shard.close()


class QdrantDense:
    """A Qdrant collection over qdrant-client: cosine distance, created when missing.

    Point ids are uuid5(docid) and the docid rides in the payload, so re-ingesting overwrites.
    Client errors, timeouts and error statuses become :class:`BackendUnavailable` with the API
    key redacted.
    """

    name = "qdrant"

    def __init__(
        self,
        location: str,
        collection: str,
        dim: int,
        *,
        api_key: str | None = None,
        timeout: float = 5.0,
        prefer_grpc: bool = False,
        path: str | Path | None = None,
        hnsw_m: int = 16,
        ef_construct: int = 100,
        ef_search: int | None = 128,
        upsert_batch: int = 256,
        finalize_timeout_s: float = 600.0,
    ) -> None:
        from qdrant_client import QdrantClient, models

        register_secret(api_key)
        self.collection = collection
        self.dim = dim
        self.upsert_batch = upsert_batch
        self.finalize_timeout_s = finalize_timeout_s
        self._models = models
        self._hnsw = models.HnswConfigDiff(m=hnsw_m, ef_construct=ef_construct)
        local = path is not None or location == ":memory:"
        # Local mode is an exact scan and warns about search params; a server gets hnsw_ef.
        self._params = models.SearchParams(hnsw_ef=ef_search) if ef_search and not local else None
        self._collection_ready = False
        if path is not None:
            self._client = QdrantClient(path=str(path))
        else:
            # No version probe in the constructor: a server that is down shows at the first call.
            self._client = QdrantClient(
                location=location,
                api_key=api_key,
                timeout=timeout,
                prefer_grpc=prefer_grpc,
                check_compatibility=False,
            )

    @contextmanager
    def _errors(self, action: str) -> Iterator[None]:
        """Transport, timeout and status errors as BackendUnavailable, the key redacted."""
        import grpc
        import httpx
        from qdrant_client.http.exceptions import ApiException

        try:
            yield
        except (ApiException, httpx.HTTPError, grpc.RpcError, OSError) as exc:
            raise BackendUnavailable(
                redact(f"qdrant {action} on collection {self.collection!r} failed: {exc}")
            ) from None

    def ensure_collection(self) -> None:
        """Create the collection when missing; an existing one must have this vector size."""
        if self._collection_ready:
            return
        models = self._models
        with self._errors("create"):
            if not self._client.collection_exists(self.collection):
                self._client.create_collection(
                    self.collection,
                    vectors_config=models.VectorParams(size=self.dim, distance=models.Distance.COSINE),
                    hnsw_config=self._hnsw,
                )
            params = self._client.get_collection(self.collection).config.params.vectors
        size = getattr(params, "size", None)
        if size != self.dim:
            raise BackendUnavailable(
                f"qdrant collection {self.collection!r} holds {size}-dim vectors, not {self.dim}"
            )
        self._collection_ready = True

    def upsert(self, docids: Sequence[str], vectors: np.ndarray) -> None:
        matrix = _as_matrix(vectors, self.dim)
        if len(docids) != len(matrix):
            raise ValueError(f"{len(docids)} docids for {len(matrix)} vectors")
        self.ensure_collection()
        models = self._models
        for start in range(0, len(docids), self.upsert_batch):
            chunk = list(docids[start : start + self.upsert_batch])
            batch = models.Batch(
                ids=[str(uuid.uuid5(DOCID_NAMESPACE, d)) for d in chunk],
                vectors=matrix[start : start + len(chunk)].tolist(),
                payloads=[{"docid": d} for d in chunk],
            )
            with self._errors("upsert"):
                self._client.upsert(self.collection, points=batch, wait=True)

    def finalize(self) -> None:
        """Wait (up to ``finalize_timeout_s``) until the server's optimizers have indexed everything."""
        self.ensure_collection()
        deadline = time.monotonic() + self.finalize_timeout_s
        while True:
            with self._errors("status"):
                status = self._client.get_collection(self.collection).status
            if status == self._models.CollectionStatus.GREEN or time.monotonic() > deadline:
                return
            time.sleep(1.0)

    def search(self, vectors: np.ndarray, k: int) -> list[Ranked]:
        matrix = _as_matrix(vectors, self.dim)
        if k <= 0 or len(matrix) == 0:
            return [[] for _ in range(len(matrix))]
        models = self._models
        requests = [
            models.QueryRequest(query=row.tolist(), limit=k, params=self._params, with_payload=["docid"])
            for row in matrix
        ]
        with self._errors("search"):
            responses = self._client.query_batch_points(self.collection, requests=requests)
        return [[(p.payload["docid"], float(p.score)) for p in r.points] for r in responses]

    def count(self) -> int:
        with self._errors("count"):
            if not self._client.collection_exists(self.collection):
                return 0
            return int(self._client.count(self.collection, exact=True).count)

    def close(self) -> None:
        self._client.close()
