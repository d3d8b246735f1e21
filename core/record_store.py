"""Durable episode records (DESIGN.md §4): one SQLite file the gateway writes as soon as an
episode ends, so a killed evaluation or rollout resumes without redoing or losing finished ones.

    store = RecordStore(Path("coordinator-records.sqlite"))
    await asyncio.to_thread(store.put, {"episode_id": "e1", "status": "finished", ...})
    store.get("e1"); store.list(limit=20, question_id="q7")

The file is in WAL mode with synchronous=FULL, so `put()` returns only after its commit is on disk:
a process killed right after it loses nothing. A record body is zlib-compressed JSON (records carry
every worker token id, hundreds of KB as text); the fields used to find records are plain indexed
columns beside it. Finished records are immutable: a second `put()` of an episode id is an error,
not an overwrite.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
SUMMARY_FIELDS = ("episode_id", "question_id", "status", "endpoint", "created_at")
# Seconds a writer waits for another process holding the write lock (e.g. a second gateway replica
# sharing the file) before the put fails.
BUSY_TIMEOUT_SECONDS = 30.0
# zlib level 6 (the default) is ~3x faster than 9 on token-id JSON and only a few percent larger.
COMPRESSION_LEVEL = 6

_SCHEMA = """
CREATE TABLE episodes (
    episode_id  TEXT PRIMARY KEY NOT NULL,
    question_id TEXT,
    status      TEXT NOT NULL,
    endpoint    TEXT,
    created_at  REAL NOT NULL,
    body        BLOB NOT NULL
);
CREATE INDEX episodes_by_time ON episodes (created_at);
CREATE INDEX episodes_by_question ON episodes (question_id, created_at);
"""
_COLUMNS = ("episode_id", "question_id", "status", "endpoint", "created_at", "body")


class RecordStoreError(RuntimeError):
    """The record file cannot be opened or written, or a record is already there."""


class RecordStore:
    """Durable episode records in one SQLite file (WAL, synchronous=FULL: a commit is fsynced
    before put() returns).

    Thread-safe: one connection shared behind a lock, so `asyncio.to_thread` callers may overlap.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RecordStoreError(f"cannot create the directory of record file {self.path}: {exc}") from None
        try:
            # isolation_level=None: every statement commits on its own unless inside BEGIN/COMMIT.
            self._conn: sqlite3.Connection | None = sqlite3.connect(
                self.path, timeout=BUSY_TIMEOUT_SECONDS, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as exc:
            raise RecordStoreError(f"cannot open record file {self.path}: {exc}") from None
        try:
            self._prepare(self._conn)
        except RecordStoreError:
            self._conn.close()
            raise
        except sqlite3.Error as exc:
            self._conn.close()
            raise RecordStoreError(
                f"record file {self.path} is not a usable SQLite database: {exc}"
            ) from None

    def _prepare(self, conn: sqlite3.Connection) -> None:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        # BEGIN IMMEDIATE: two processes opening a new file at once create the schema only once.
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if version == 0 and not tables:
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            elif version != SCHEMA_VERSION or "episodes" not in tables:
                raise RecordStoreError(
                    f"{self.path} is a SQLite database but not a coordinator record file "
                    f"(schema version {version}, tables: {', '.join(sorted(tables)) or 'none'})"
                )
            else:
                columns = tuple(row[1] for row in conn.execute("PRAGMA table_info(episodes)"))
                if columns != _COLUMNS:
                    raise RecordStoreError(
                        f"{self.path}: table 'episodes' has columns {', '.join(columns)}; "
                        f"expected {', '.join(_COLUMNS)}"
                    )
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RecordStoreError(f"record file {self.path} is closed")
        return self._conn

    def put(self, record: dict[str, Any]) -> None:
        """Store a finished episode's record; returns once it is durably on disk.

        `created_at` (unix time) is filled with now when absent. A second put of the same
        `episode_id` raises RecordStoreError and leaves the first record as it was.
        """
        episode_id = record.get("episode_id")
        status = record.get("status")
        if not isinstance(episode_id, str) or not episode_id:
            raise ValueError("a record needs a non-empty string 'episode_id'")
        if not isinstance(status, str):
            raise ValueError(f"record {episode_id}: 'status' must be a string")
        if record.get("created_at") is None:
            record = {**record, "created_at": time.time()}
        created_at = float(record["created_at"])
        body = zlib.compress(json.dumps(record, separators=(",", ":")).encode(), COMPRESSION_LEVEL)
        row = (episode_id, record.get("question_id"), status, record.get("endpoint"), created_at, body)
        with self._lock:
            conn = self._connection()
            try:
                conn.execute(f"INSERT INTO episodes ({', '.join(_COLUMNS)}) VALUES (?, ?, ?, ?, ?, ?)", row)
            except sqlite3.IntegrityError:
                raise RecordStoreError(f"episode {episode_id} is already recorded") from None
            except sqlite3.Error as exc:
                raise RecordStoreError(f"cannot write episode {episode_id} to {self.path}: {exc}") from None

    def get(self, episode_id: str) -> dict[str, Any] | None:
        """The full record as put (plus `created_at` when it was filled in), or None."""
        with self._lock:
            row = self._query("SELECT body FROM episodes WHERE episode_id = ?", (episode_id,)).fetchone()
        if row is None:
            return None
        try:
            return json.loads(zlib.decompress(row[0]))
        except (zlib.error, ValueError) as exc:
            raise RecordStoreError(f"episode {episode_id} in {self.path} is damaged: {exc}") from None

    def list(self, *, limit: int = 100, question_id: str | None = None) -> list[dict[str, Any]]:
        """Summaries (SUMMARY_FIELDS only), newest first; at most `limit`."""
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        columns = ", ".join(SUMMARY_FIELDS)
        # rowid breaks created_at ties so records put in the same instant still list newest first.
        if question_id is None:
            sql = f"SELECT {columns} FROM episodes ORDER BY created_at DESC, rowid DESC LIMIT ?"
            params: tuple[Any, ...] = (limit,)
        else:
            sql = (
                f"SELECT {columns} FROM episodes WHERE question_id = ? "
                "ORDER BY created_at DESC, rowid DESC LIMIT ?"
            )
            params = (question_id, limit)
        with self._lock:
            rows = self._query(sql, params).fetchall()
        return [dict(zip(SUMMARY_FIELDS, row, strict=True)) for row in rows]

    def count(self) -> int:
        with self._lock:
            return self._query("SELECT count(*) FROM episodes", ()).fetchone()[0]

    def iter_records(self) -> Iterator[dict[str, Any]]:
        """Every record, oldest first (the order episodes finished), read in one snapshot."""
        with self._lock:
            rows = self._query(
                "SELECT episode_id, body FROM episodes ORDER BY created_at, rowid", ()
            ).fetchall()
        for episode_id, body in rows:
            try:
                yield json.loads(zlib.decompress(body))
            except (zlib.error, ValueError) as exc:
                raise RecordStoreError(f"episode {episode_id} in {self.path} is damaged: {exc}") from None

    def export(self, out: Path, *, fmt: str = "jsonl") -> int:
        """Write every record to `out` and return how many: "jsonl" (one record per line, oldest first)
        or "sqlite" (a consistent copy through SQLite's online backup API, WAL contents included: a
        plain `cp` of a live WAL database misses what is still in the -wal file).

        Written beside `out` and renamed into place, so `out` is whole or absent.
        """
        if fmt not in ("jsonl", "sqlite"):
            raise ValueError(f"export format must be jsonl or sqlite, not {fmt!r}")
        out = Path(out)
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        tmp.unlink(missing_ok=True)
        try:
            if fmt == "jsonl":
                n = 0
                with tmp.open("w", encoding="utf-8") as f:
                    for record in self.iter_records():
                        f.write(json.dumps(record, separators=(",", ":")) + "\n")
                        n += 1
                    f.flush()
                    os.fsync(f.fileno())
            else:
                target = sqlite3.connect(tmp)
                try:
                    with self._lock:
                        self._connection().backup(target)
                    n = target.execute("SELECT count(*) FROM episodes").fetchone()[0]
                    target.execute("PRAGMA journal_mode=DELETE")
                finally:
                    target.close()
            os.replace(tmp, out)
        except sqlite3.Error as exc:
            raise RecordStoreError(f"cannot export {self.path} to {out}: {exc}") from None
        finally:
            tmp.unlink(missing_ok=True)
        return n

    def _query(self, sql: str, params: tuple[Any, ...]) -> sqlite3.Cursor:
        try:
            return self._connection().execute(sql, params)
        except sqlite3.Error as exc:
            raise RecordStoreError(f"cannot read record file {self.path}: {exc}") from None

    def close(self) -> None:
        """Close the file; later calls raise RecordStoreError. Closing twice is fine."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> RecordStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
