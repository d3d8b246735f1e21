"""The embedded doc store: one SQLite file under the index dir.

It holds every ingested document (for ``open_page`` by docid or url, and for snippets) and
its dense vector, and it is the ingest ledger: a batch of documents and their vectors is
committed in one transaction, so an interrupted ingest resumes after the last committed batch
and never stores a document twice (docid is the primary key).

Serving opens it read-only with one connection per thread (SQLite connections are not shared
across threads); WAL mode lets a reader run beside a writer.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from services.retrieval.backends import Doc

FILENAME = "docstore.sqlite"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS docs (
    seq    INTEGER PRIMARY KEY AUTOINCREMENT,
    docid  TEXT NOT NULL UNIQUE,
    url    TEXT NOT NULL,
    title  TEXT NOT NULL,
    text   TEXT NOT NULL,
    vector BLOB
);
CREATE INDEX IF NOT EXISTS docs_url ON docs(url);
"""


class DocStore:
    def __init__(self, index_dir: str | Path, *, readonly: bool = False) -> None:
        self.path = Path(index_dir) / FILENAME
        self.readonly = readonly
        if readonly and not self.path.exists():
            raise FileNotFoundError(f"{self.path}: no doc store; build the index with `bcstack index` first")
        self._local = threading.local()
        if not readonly:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = self._conn()
            conn.execute("PRAGMA journal_mode=WAL")
            conn.executescript(_SCHEMA)
            conn.commit()

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            if self.readonly:
                conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, check_same_thread=False)
            else:
                conn = sqlite3.connect(self.path, check_same_thread=False)
                conn.execute("PRAGMA synchronous=NORMAL")
            self._local.conn = conn
        return conn

    # -- ingest ---------------------------------------------------------------------------------
    def known(self, docids: Sequence[str]) -> set[str]:
        """Which of ``docids`` are already stored."""
        found: set[str] = set()
        conn = self._conn()
        for i in range(0, len(docids), 500):
            chunk = list(docids[i : i + 500])
            marks = ",".join("?" * len(chunk))
            found.update(
                r[0] for r in conn.execute(f"SELECT docid FROM docs WHERE docid IN ({marks})", chunk)
            )
        return found

    def add(self, docs: Sequence[Doc], vectors: np.ndarray | None) -> None:
        """Store a batch (and its vectors) in one transaction."""
        if vectors is not None and len(vectors) != len(docs):
            raise ValueError("one vector per document")
        rows = [
            (
                d.docid,
                d.url,
                d.title,
                d.text,
                None if vectors is None else np.asarray(vectors[i], dtype=np.float32).tobytes(),
            )
            for i, d in enumerate(docs)
        ]
        conn = self._conn()
        with conn:
            conn.executemany("INSERT INTO docs(docid, url, title, text, vector) VALUES (?,?,?,?,?)", rows)

    # -- reading --------------------------------------------------------------------------------
    def count(self) -> int:
        return self._conn().execute("SELECT COUNT(*) FROM docs").fetchone()[0]

    def get(self, docid: str) -> Doc | None:
        row = (
            self._conn()
            .execute("SELECT docid, text, url, title FROM docs WHERE docid = ?", (docid,))
            .fetchone()
        )
        return Doc(*row) if row else None

    def get_by_url(self, url: str) -> Doc | None:
        row = (
            self._conn()
            .execute("SELECT docid, text, url, title FROM docs WHERE url = ? ORDER BY seq LIMIT 1", (url,))
            .fetchone()
        )
        return Doc(*row) if row else None

    def get_many(self, docids: Sequence[str]) -> dict[str, Doc]:
        if not docids:
            return {}
        marks = ",".join("?" * len(docids))
        rows = self._conn().execute(
            f"SELECT docid, text, url, title FROM docs WHERE docid IN ({marks})", list(docids)
        )
        return {r[0]: Doc(*r) for r in rows}

    def iter_docs(self, batch: int = 1000) -> Iterator[list[Doc]]:
        """All documents in ingest order, in batches."""
        last = 0
        conn = self._conn()
        while True:
            rows = conn.execute(
                "SELECT seq, docid, text, url, title FROM docs WHERE seq > ? ORDER BY seq LIMIT ?",
                (last, batch),
            ).fetchall()
            if not rows:
                return
            last = rows[-1][0]
            yield [Doc(*r[1:]) for r in rows]

    def iter_vectors(self, dim: int, batch: int = 4096) -> Iterator[tuple[list[str], np.ndarray]]:
        """(docids, vectors) in ingest order, in batches; documents without a vector are skipped."""
        last = 0
        conn = self._conn()
        while True:
            rows = conn.execute(
                "SELECT seq, docid, vector FROM docs "
                "WHERE seq > ? AND vector IS NOT NULL ORDER BY seq LIMIT ?",
                (last, batch),
            ).fetchall()
            if not rows:
                return
            last = rows[-1][0]
            vecs = np.frombuffer(b"".join(r[2] for r in rows), dtype=np.float32).reshape(len(rows), dim)
            yield [r[1] for r in rows], vecs

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
