"""Durable episode records (DESIGN.md §4): one SQLite file the gateway writes as soon as an
episode ends, so a killed evaluation or rollout resumes without redoing or losing finished ones.

    store = RecordStore(Path("coordinator-records.sqlite"))
    await asyncio.to_thread(store.put, {"episode_id": "e1", "status": "finished", ...})
    store.get("e1"); store.list(limit=20, question_id="q7")
    rows, total = store.search(RecordQuery(group_id="g3", graded="incorrect"), offset=0, limit=50)

The file is in WAL mode with synchronous=FULL, so `put()` returns only after its commit is on disk:
a process killed right after it loses nothing. A record body is zlib-compressed JSON (records carry
every worker token id, hundreds of KB as text); the fields used to find records are plain indexed
columns beside it. Finished records are immutable: a second `put()` of an episode id is an error,
not an overwrite.

Schema versions (`PRAGMA user_version`). 2 adds the columns the episode viewer filters on
(`group_id`, `weight_versions` as a JSON list, `correct` from the record's grades); a version-1 file
is migrated in place when it is opened (the columns added, then filled from each record's body, in
one transaction), so every file a gateway wrote stays readable. Columns are only ever added, at the
end: readers that select by name (`SELECT body FROM episodes`) read both versions.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

SCHEMA_VERSION = 2
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
    body        BLOB NOT NULL,
    group_id    TEXT,
    weight_versions TEXT,
    correct     INTEGER
);
CREATE INDEX episodes_by_time ON episodes (created_at);
CREATE INDEX episodes_by_question ON episodes (question_id, created_at);
"""
# Version 1 -> 2: the viewer's filter columns, appended (ALTER TABLE adds at the end), then indexed.
_V2_COLUMNS = ("group_id", "weight_versions", "correct")
_V2_INDEXES = """
CREATE INDEX episodes_by_group ON episodes (group_id, created_at);
CREATE INDEX episodes_by_status ON episodes (status, created_at);
"""
_V1_COLUMNS = ("episode_id", "question_id", "status", "endpoint", "created_at", "body")
_COLUMNS = (*_V1_COLUMNS, *_V2_COLUMNS)
# What `search()` returns per record.
ROW_FIELDS = (
    "episode_id",
    "question_id",
    "group_id",
    "status",
    "endpoint",
    "created_at",
    "weight_versions",
    "correct",
)
Graded = Literal["correct", "incorrect", "ungraded"]


@dataclass(frozen=True)
class RecordQuery:
    """Which records `RecordStore.search` returns; None matches anything. `created_from` is
    inclusive, `created_to` exclusive (unix seconds). `graded`: the judge's verdict in the record's
    grades ("ungraded": no grades, or a verdict the judge could not give)."""

    status: str | None = None
    question_id: str | None = None
    group_id: str | None = None
    endpoint: str | None = None
    weight_version: str | None = None
    graded: Graded | None = None
    created_from: float | None = None
    created_to: float | None = None

    def where(self) -> tuple[str, tuple[Any, ...]]:
        """The SQL condition and its parameters."""
        clauses: list[str] = []
        params: list[Any] = []
        for column in ("status", "question_id", "group_id", "endpoint"):
            value = getattr(self, column)
            if value is not None:
                clauses.append(f"{column} = ?")
                params.append(value)
        if self.weight_version is not None:
            clauses.append("EXISTS (SELECT 1 FROM json_each(episodes.weight_versions) WHERE value = ?)")
            params.append(self.weight_version)
        if self.graded is not None:
            clauses.append(
                {"correct": "correct = 1", "incorrect": "correct = 0", "ungraded": "correct IS NULL"}[
                    self.graded
                ]
            )
        if self.created_from is not None:
            clauses.append("created_at >= ?")
            params.append(self.created_from)
        if self.created_to is not None:
            clauses.append("created_at < ?")
            params.append(self.created_to)
        return (" WHERE " + " AND ".join(clauses)) if clauses else "", tuple(params)


def index_fields(record: Mapping[str, Any]) -> tuple[str | None, str, int | None]:
    """The version-2 columns of a record: group id, weight versions (JSON list), verdict (1/0/None)."""
    group_id = record.get("group_id")
    versions = record.get("weight_versions")
    versions = [str(v) for v in versions] if isinstance(versions, list) else []
    grades = record.get("grades")
    correct = grades.get("correct") if isinstance(grades, Mapping) else None
    return (
        group_id if isinstance(group_id, str) else None,
        json.dumps(versions, separators=(",", ":")),
        None if not isinstance(correct, bool) else int(correct),
    )


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
                for statement in (_SCHEMA + _V2_INDEXES).split(";"):
                    if statement.strip():
                        conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            elif version == 1 and "episodes" in tables and self._columns(conn) == _V1_COLUMNS:
                self._migrate_v1(conn)
            elif version != SCHEMA_VERSION or "episodes" not in tables:
                raise RecordStoreError(
                    f"{self.path} is a SQLite database but not a coordinator record file "
                    f"(schema version {version}, tables: {', '.join(sorted(tables)) or 'none'})"
                )
            else:
                columns = self._columns(conn)
                if columns != _COLUMNS:
                    raise RecordStoreError(
                        f"{self.path}: table 'episodes' has columns {', '.join(columns)}; "
                        f"expected {', '.join(_COLUMNS)}"
                    )
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    @staticmethod
    def _columns(conn: sqlite3.Connection) -> tuple[str, ...]:
        return tuple(row[1] for row in conn.execute("PRAGMA table_info(episodes)"))

    def _migrate_v1(self, conn: sqlite3.Connection) -> None:
        """Version 1 -> 2 inside the caller's transaction: add the filter columns, fill them from
        every body (a damaged body leaves them NULL; `get()` still reports it), index them."""
        for column, kind in zip(_V2_COLUMNS, ("TEXT", "TEXT", "INTEGER"), strict=True):
            conn.execute(f"ALTER TABLE episodes ADD COLUMN {column} {kind}")
        updates = []
        for rowid, body in conn.execute("SELECT rowid, body FROM episodes"):
            try:
                record = json.loads(zlib.decompress(body))
            except (zlib.error, ValueError):
                continue
            if isinstance(record, dict):
                updates.append((*index_fields(record), rowid))
        conn.executemany(
            "UPDATE episodes SET group_id = ?, weight_versions = ?, correct = ? WHERE rowid = ?", updates
        )
        for statement in _V2_INDEXES.split(";"):
            if statement.strip():
                conn.execute(statement)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

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
        row = (
            episode_id,
            record.get("question_id"),
            status,
            record.get("endpoint"),
            created_at,
            body,
            *index_fields(record),
        )
        placeholders = ", ".join("?" * len(_COLUMNS))
        with self._lock:
            conn = self._connection()
            try:
                conn.execute(f"INSERT INTO episodes ({', '.join(_COLUMNS)}) VALUES ({placeholders})", row)
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

    def search(
        self, query: RecordQuery = RecordQuery(), *, offset: int = 0, limit: int = 50
    ) -> tuple[list[dict[str, Any]], int]:
        """One page of the records `query` matches (ROW_FIELDS, newest first) and how many match."""
        if limit < 0 or offset < 0:
            raise ValueError(f"offset and limit must be >= 0, got {offset} and {limit}")
        where, params = query.where()
        sql = (
            f"SELECT {', '.join(ROW_FIELDS)} FROM episodes{where} "
            "ORDER BY created_at DESC, rowid DESC LIMIT ? OFFSET ?"
        )
        with self._lock:
            total = self._query(f"SELECT count(*) FROM episodes{where}", params).fetchone()[0]
            rows = self._query(sql, (*params, limit, offset)).fetchall()
        out = []
        for row in rows:
            item = dict(zip(ROW_FIELDS, row, strict=True))
            item["weight_versions"] = json.loads(item["weight_versions"] or "[]")
            item["correct"] = None if item["correct"] is None else bool(item["correct"])
            out.append(item)
        return out, total

    def facets(self) -> dict[str, list[str]]:
        """The distinct statuses, endpoints and weight versions on file (a filter form's choices)."""
        with self._lock:
            statuses = self._query("SELECT DISTINCT status FROM episodes ORDER BY status", ()).fetchall()
            endpoints = self._query(
                "SELECT DISTINCT endpoint FROM episodes WHERE endpoint IS NOT NULL ORDER BY endpoint", ()
            ).fetchall()
            versions = self._query(
                "SELECT DISTINCT j.value FROM episodes, json_each(episodes.weight_versions) AS j "
                "ORDER BY j.value",
                (),
            ).fetchall()
        return {
            "status": [r[0] for r in statuses],
            "endpoint": [r[0] for r in endpoints],
            "weight_version": [str(r[0]) for r in versions],
        }

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
