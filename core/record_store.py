"""Durable episode records (DESIGN.md §4): the store a gateway writes as soon as an episode ends, so
a killed evaluation or rollout resumes without redoing or losing finished ones.

One interface, `RecordStore`, and two adapters with the same contract (tests/test_record_store.py
runs one suite on both):

- `SqliteRecordStore` — one SQLite file, the embedded default (one gateway);
- `core.record_store_pg.PostgresRecordStore` — PostgreSQL, shared by every gateway replica.

    store = open_record_store("coordinator-records.sqlite")        # or "postgresql://user@host/db"
    store.put({"episode_id": "e1", "status": "finished", ...})      # durable when it returns
    await store.put_async(record)                                   # the same, from an event loop
    store.get("e1"); store.list(limit=20, question_id="q7")
    rows, total = store.search(RecordQuery(group_id="g3", graded="incorrect"), offset=0, limit=50)

**Group commit.** Writes go through one writer thread per store that takes every put waiting and
commits them in one transaction (one fsync for many episodes); each `put()` returns only once its
transaction is durable, so a process killed right after it loses nothing. `group_commit=False`
commits each episode on its own (the benchmark's baseline, bench/gateway_scale.py).

**Bodies and columns.** A record body is zlib-compressed JSON (records carry every worker token
id, hundreds of KB as text); the fields used to find records are indexed columns beside it.
Finished records are immutable: a second `put()` of an episode id is an error, not an overwrite.

**Claims.** An episode id means one episode across every replica sharing a store: a replica
`claim()`s an id before it runs it (a row with its name and a lease), `renew()`s its leases while
it runs, and the `put()` of the record removes the claim in the same transaction. A claim whose
lease lapsed (its replica died) may be taken by another replica, which runs the episode again under
the same id. `claim()` answers who holds the id when it is not the caller.

**Settings.** A few small JSON documents that must outlive a restart and be the same on every
replica (the coordinator's endpoints and which one is active): `write_setting(key, value)` stores
one and bumps its version, `read_setting(key)` returns (version, value) or None. Last writer wins.

SQLite schema versions (`PRAGMA user_version`): 2 added the columns the episode viewer filters on
(`group_id`, `weight_versions` as a JSON list, `correct` from the record's grades), 3 the claims
table, 4 the settings table. Older files are migrated in place when opened (one transaction); a
newer one is refused.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
import json
import os
import queue
import re
import socket
import sqlite3
import threading
import time
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

SCHEMA_VERSION = 4
SUMMARY_FIELDS = ("episode_id", "question_id", "status", "endpoint", "created_at")
# Seconds a writer waits for another process holding the write lock before the put fails.
BUSY_TIMEOUT_SECONDS = 30.0
# zlib level 6 (the default) is ~3x faster than 9 on token-id JSON and only a few percent larger.
COMPRESSION_LEVEL = 6
# The most episodes one group commit writes (bounds one transaction's size and latency).
MAX_BATCH = 512
# SQLite: a background checkpoint starts once this much has been written since the last one, and
# writers wait for it once four times as much is pending (the WAL's bound on disk).
CHECKPOINT_BYTES = 16 << 20

# The largest settings document (`write_setting`): settings are small; records go to `put`.
MAX_SETTING_BYTES = 64 << 10

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

    def where(self, *, mark: str = "?", weight_clause: str | None = None) -> tuple[str, tuple[Any, ...]]:
        """The SQL condition and its parameters, with `mark` as the placeholder. `weight_clause`
        tests one weight version against the column (default: SQLite's json_each)."""
        clauses: list[str] = []
        params: list[Any] = []
        for column in ("status", "question_id", "group_id", "endpoint"):
            value = getattr(self, column)
            if value is not None:
                clauses.append(f"{column} = {mark}")
                params.append(value)
        if self.weight_version is not None:
            clauses.append(
                weight_clause
                or f"EXISTS (SELECT 1 FROM json_each(episodes.weight_versions) WHERE value = {mark})"
            )
            params.append(self.weight_version)
        if self.graded is not None:
            true, false = ("1", "0") if mark == "?" else ("TRUE", "FALSE")
            clauses.append(
                {
                    "correct": f"correct = {true}",
                    "incorrect": f"correct = {false}",
                    "ungraded": "correct IS NULL",
                }[self.graded]
            )
        if self.created_from is not None:
            clauses.append(f"created_at >= {mark}")
            params.append(self.created_from)
        if self.created_to is not None:
            clauses.append(f"created_at < {mark}")
            params.append(self.created_to)
        return (" WHERE " + " AND ".join(clauses)) if clauses else "", tuple(params)


def index_fields(record: Mapping[str, Any]) -> tuple[str | None, str, bool | None]:
    """The filter columns of a record: group id, weight versions (JSON list), verdict."""
    group_id = record.get("group_id")
    versions = record.get("weight_versions")
    versions = [str(v) for v in versions] if isinstance(versions, list) else []
    grades = record.get("grades")
    correct = grades.get("correct") if isinstance(grades, Mapping) else None
    return (
        group_id if isinstance(group_id, str) else None,
        json.dumps(versions, separators=(",", ":")),
        correct if isinstance(correct, bool) else None,
    )


@dataclass(frozen=True)
class Row:
    """A record as stored: its columns and compressed body (`RecordStore.encode`)."""

    episode_id: str
    question_id: str | None
    status: str
    endpoint: str | None
    created_at: float
    body: bytes
    group_id: str | None
    weight_versions: str
    correct: bool | None


class RecordStoreError(RuntimeError):
    """The store cannot be opened, read or written, or a record is already there."""


class SchemaTooNew(RecordStoreError):
    """The store was written by a newer bcstack (its schema version is above this code's)."""


class RecordExists(RecordStoreError):
    """A `put()` of an episode id already recorded (the first record stays as it was)."""


_URL_PASSWORD = re.compile(r"(?P<head>[a-z][a-z0-9+.-]*://[^:/@\s]*:)(?P<password>[^@\s]*)(?P<tail>@)", re.I)
_KEYWORD_PASSWORD = re.compile(r"(?P<head>password\s*=\s*)(?P<password>'(?:[^'\\]|\\.)*'|\S+)", re.I)


def redact(text: str) -> str:
    """`text` with the password of any connection URL or `password=` keyword masked."""
    text = _URL_PASSWORD.sub(lambda m: f"{m['head']}***{m['tail']}", text)
    return _KEYWORD_PASSWORD.sub(lambda m: f"{m['head']}***", text)


def is_database_url(target: str | os.PathLike[str]) -> bool:
    return isinstance(target, str) and target.split("://", 1)[0].lower() in ("postgresql", "postgres")


def default_replica() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def open_record_store(target: str | os.PathLike[str], **options: Any) -> RecordStore:
    """The store at `target`: a `postgresql://` (or `postgres://`) URL, else a SQLite file path.
    `options` go to the adapter (e.g. group_commit=False)."""
    if is_database_url(target):
        from core.record_store_pg import PostgresRecordStore

        return PostgresRecordStore(str(target), **options)
    return SqliteRecordStore(Path(target), **options)


class RecordStore(abc.ABC):
    """The record-store interface; see the module docstring for the contract."""

    #: where the records are, for messages (a URL with its password masked, or a path)
    location: str

    def __init__(self, *, group_commit: bool = True, max_batch: int = MAX_BATCH) -> None:
        self.group_commit = group_commit
        self.max_batch = max_batch if group_commit else 1
        self._queue: queue.SimpleQueue[tuple[Row, concurrent.futures.Future[None]] | None] = (
            queue.SimpleQueue()
        )
        self._writer: threading.Thread | None = None
        self._writer_lock = threading.Lock()
        self._closed = False
        #: commits and episodes written, for the benchmark (batches = transactions)
        self.batches = 0
        self.written = 0

    # --- writing ---------------------------------------------------------------------------------

    @staticmethod
    def encode(record: Mapping[str, Any]) -> Row:
        """Check a finished record and compress it (CPU: callers on an event loop use put_async).

        `created_at` (unix time) is filled with now when absent."""
        episode_id = record.get("episode_id")
        status = record.get("status")
        if not isinstance(episode_id, str) or not episode_id:
            raise ValueError("a record needs a non-empty string 'episode_id'")
        if not isinstance(status, str):
            raise ValueError(f"record {episode_id}: 'status' must be a string")
        if record.get("created_at") is None:
            record = {**record, "created_at": time.time()}
        body = zlib.compress(json.dumps(record, separators=(",", ":")).encode(), COMPRESSION_LEVEL)
        return Row(
            episode_id,
            record.get("question_id"),
            status,
            record.get("endpoint"),
            float(record["created_at"]),
            body,
            *index_fields(record),
        )

    def submit(self, row: Row) -> concurrent.futures.Future[None]:
        """Queue an encoded record for the next group commit; the future resolves once it is
        durable (or with RecordStoreError / RecordExists)."""
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        if self._closed:
            future.set_exception(RecordStoreError(f"record store {self.location} is closed"))
            return future
        self._start_writer()
        self._queue.put((row, future))
        return future

    def put(self, record: Mapping[str, Any]) -> None:
        """Store a finished episode's record; returns once it is durably stored. A second put of the
        same `episode_id` raises RecordExists and leaves the first record as it was."""
        self.submit(self.encode(record)).result()

    async def put_async(self, record: Mapping[str, Any]) -> None:
        """`put()` for an event loop: encodes in a thread, then waits for the group commit without
        holding one (thousands of episodes may wait on one commit)."""
        row = await asyncio.to_thread(self.encode, record)
        await asyncio.wrap_future(self.submit(row))

    def _start_writer(self) -> None:
        if self._writer is not None:
            return
        with self._writer_lock:
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="record-writer", daemon=True)
                self._writer.start()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            while len(batch) < self.max_batch:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)  # stop after this batch
                    break
                batch.append(more)
            rows = [row for row, _ in batch]
            try:
                outcomes = self._write_batch(rows)
            except RecordStoreError as exc:
                outcomes = [exc] * len(rows)
            except Exception as exc:  # noqa: BLE001 - every waiter must hear of it
                outcomes = [RecordStoreError(redact(f"cannot write to {self.location}: {exc}"))] * len(rows)
            self.batches += 1
            for (_, future), outcome in zip(batch, outcomes, strict=True):
                if outcome is None:
                    self.written += 1
                    future.set_result(None)
                else:
                    future.set_exception(outcome)

    @staticmethod
    def _first_of_each(rows: Sequence[Row]) -> tuple[list[int], dict[int, Exception]]:
        """Indexes of the rows to insert, and a RecordExists for each repeat within the batch."""
        seen: set[str] = set()
        keep: list[int] = []
        repeats: dict[int, Exception] = {}
        for i, row in enumerate(rows):
            if row.episode_id in seen:
                repeats[i] = RecordExists(f"episode {row.episode_id} is already recorded")
            else:
                seen.add(row.episode_id)
                keep.append(i)
        return keep, repeats

    @abc.abstractmethod
    def _write_batch(self, rows: Sequence[Row]) -> list[Exception | None]:
        """Insert `rows` (and drop their claims) in one durable transaction; per row None (stored)
        or RecordExists. Raises RecordStoreError when nothing could be written."""

    # --- claims ----------------------------------------------------------------------------------

    @abc.abstractmethod
    def claim(self, episode_id: str, replica: str, lease_seconds: float) -> str | None:
        """Claim `episode_id` for `replica` for `lease_seconds`: None when the caller now holds it
        (a new claim, its own, or one whose lease lapsed), else the replica holding it."""

    @abc.abstractmethod
    def claim_or_record(
        self, episode_id: str, replica: str, lease_seconds: float
    ) -> tuple[dict[str, Any] | None, str | None]:
        """What a gateway asks of a named id, in one round trip: (its record, None) when recorded;
        else `claim()`'s answer as (None, None: the caller holds it now | the replica holding it)."""

    @abc.abstractmethod
    def renew(self, episode_ids: Sequence[str], replica: str, lease_seconds: float) -> int:
        """Extend `replica`'s leases on `episode_ids`; how many it still held."""

    @abc.abstractmethod
    def release(self, episode_id: str, replica: str) -> None:
        """Drop `replica`'s claim on `episode_id` (an episode that ended unrecorded)."""

    # --- settings --------------------------------------------------------------------------------

    @abc.abstractmethod
    def read_setting(self, key: str) -> tuple[int, dict[str, Any]] | None:
        """(version, value) of the setting `key`, or None when it was never written."""

    @abc.abstractmethod
    def write_setting(self, key: str, value: Mapping[str, Any]) -> int:
        """Store `value` (a JSON object of at most MAX_SETTING_BYTES) under `key`, durably; returns
        its new version (1 for the first write, then one more on each write, whoever writes)."""

    @staticmethod
    def _setting_json(key: str, value: Mapping[str, Any]) -> str:
        if not isinstance(value, Mapping):
            raise ValueError(f"setting {key!r} must be a JSON object")
        text = json.dumps(dict(value), separators=(",", ":"), sort_keys=True)
        if len(text) > MAX_SETTING_BYTES:
            raise ValueError(f"setting {key!r} is {len(text):,} bytes; at most {MAX_SETTING_BYTES:,}")
        return text

    # --- reading ---------------------------------------------------------------------------------

    @abc.abstractmethod
    def get(self, episode_id: str) -> dict[str, Any] | None:
        """The full record as put (plus `created_at` when it was filled in), or None."""

    @abc.abstractmethod
    def list(self, *, limit: int = 100, question_id: str | None = None) -> list[dict[str, Any]]:
        """Summaries (SUMMARY_FIELDS only), newest first; at most `limit`."""

    @abc.abstractmethod
    def search(
        self, query: RecordQuery = RecordQuery(), *, offset: int = 0, limit: int = 50
    ) -> tuple[list[dict[str, Any]], int]:
        """One page of the records `query` matches (ROW_FIELDS, newest first) and how many match."""

    @abc.abstractmethod
    def facets(self) -> dict[str, list[str]]:
        """The distinct statuses, endpoints and weight versions on file (a filter form's choices)."""

    @abc.abstractmethod
    def count(self) -> int: ...

    @abc.abstractmethod
    def iter_records(self) -> Iterator[dict[str, Any]]:
        """Every record, oldest first (the order episodes finished)."""

    def export(self, out: Path, *, fmt: str = "jsonl") -> int:
        """Write every record to `out` and return how many: "jsonl" (one record per line, oldest
        first) or "sqlite" (a record file `SqliteRecordStore` and `bcstack train grpo` read).

        Written beside `out` and renamed into place, so `out` is whole or absent."""
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
                n = self._export_sqlite(tmp)
            os.replace(tmp, out)
        except sqlite3.Error as exc:
            raise RecordStoreError(f"cannot export {self.location} to {out}: {exc}") from None
        finally:
            for leftover in (tmp, tmp.with_name(tmp.name + "-wal"), tmp.with_name(tmp.name + "-shm")):
                leftover.unlink(missing_ok=True)
        return n

    def _export_sqlite(self, tmp: Path) -> int:
        with SqliteRecordStore(tmp) as target:
            n = target.insert_rows(self.encode(record) for record in self.iter_records())
        conn = sqlite3.connect(tmp)  # closed above: its WAL is folded in; now a one-file database
        try:
            conn.execute("PRAGMA journal_mode=DELETE")
        finally:
            conn.close()
        return n

    # --- life ------------------------------------------------------------------------------------

    def close(self) -> None:
        """Finish the queued writes and close; later calls raise RecordStoreError. Twice is fine."""
        self._closed = True
        writer = self._writer
        if writer is not None and writer.is_alive():
            self._queue.put(None)
            writer.join()
        self._close()

    @abc.abstractmethod
    def _close(self) -> None: ...

    def __enter__(self) -> RecordStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- SQLite ----------------------------------------------------------------------------------------

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
# Version 2 -> 3: episode claims (lease_until in unix seconds).
_V3_CLAIMS = """
CREATE TABLE episode_claims (
    episode_id  TEXT PRIMARY KEY NOT NULL,
    replica     TEXT NOT NULL,
    lease_until REAL NOT NULL
);
"""
# Version 3 -> 4: settings (`write_setting`), value as JSON text.
_V4_SETTINGS = """
CREATE TABLE store_settings (
    key        TEXT PRIMARY KEY NOT NULL,
    version    INTEGER NOT NULL,
    value      TEXT NOT NULL,
    updated_at REAL NOT NULL
);
"""
_V1_COLUMNS = ("episode_id", "question_id", "status", "endpoint", "created_at", "body")
_COLUMNS = (*_V1_COLUMNS, *_V2_COLUMNS)


def _statements(script: str) -> list[str]:
    return [s for s in script.split(";") if s.strip()]


def _busy(exc: sqlite3.OperationalError) -> bool:
    """SQLITE_BUSY or SQLITE_LOCKED ("database is locked", "database table is locked")."""
    code = getattr(exc, "sqlite_errorcode", None) or 0  # an extended code: its low byte is the primary
    return code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED) or "locked" in str(exc)


@contextlib.contextmanager
def _immediate(conn: sqlite3.Connection) -> Iterator[None]:
    """BEGIN IMMEDIATE (the write lock) ... COMMIT, or ROLLBACK on any error."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


class SqliteRecordStore(RecordStore):
    """Durable episode records in one SQLite file (WAL, synchronous=FULL: a commit is fsynced before
    put() returns). Thread-safe. Writes (group commits, claims) share one connection behind a lock;
    reads use another, so a reader never waits for a commit (WAL).

    Checkpoints (copying the WAL into the database file) run in a thread of their own on a third
    connection (`PRAGMA wal_checkpoint(PASSIVE)`, which takes no write lock), started once
    `checkpoint_bytes` have been written, instead of SQLite's automatic checkpoint inside the commit
    that crosses 1,000 pages: that one holds the write lock while it writes the pages back, and on a
    disk with few write operations per second (a network volume) the commits queue behind it
    (bench/gateway_scale.py measures both). Writers wait once four times `checkpoint_bytes` are
    pending, so the WAL stays bounded. `checkpoint_bytes=0` (and group_commit=False, the store as it
    was before group commit, the benchmark's baseline) leaves checkpoints to SQLite."""

    def __init__(
        self,
        path: Path,
        *,
        group_commit: bool = True,
        max_batch: int = MAX_BATCH,
        checkpoint_bytes: int = CHECKPOINT_BYTES,
    ) -> None:
        super().__init__(group_commit=group_commit, max_batch=max_batch)
        self.path = Path(path)
        self.location = str(self.path)
        self._lock = threading.Lock()  # the read connection
        self._wlock = threading.Lock()  # the write connection
        self._conn: sqlite3.Connection | None = None
        self._wconn: sqlite3.Connection | None = None
        self.checkpoint_bytes = checkpoint_bytes if group_commit else 0
        self.checkpoints = 0  # background checkpoints run
        self._pending = 0  # bytes written since the last background checkpoint began
        self._wal_full = False  # a checkpoint found the WAL past its bound: the writer parks
        self._parked = False  # the writer is parked, between transactions
        self._ckpt = threading.Condition()
        self._ckpt_thread: threading.Thread | None = None
        self._ckpt_stop = False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RecordStoreError(f"cannot create the directory of record file {self.path}: {exc}") from None
        deadline = time.monotonic() + BUSY_TIMEOUT_SECONDS
        while True:
            try:
                # isolation_level=None: every statement commits on its own unless inside BEGIN/COMMIT.
                self._wconn = self._connect()
                self._prepare(self._wconn)
                self._conn = self._connect()
                break
            except RecordStoreError:
                self._close()
                raise
            except sqlite3.OperationalError as exc:
                # Connections racing to put a new file into WAL mode can get SQLITE_BUSY at once,
                # without the busy timeout (seen 3 times in 300 four-way opens on a loaded machine):
                # open again until the timeout has passed.
                if _busy(exc) and time.monotonic() < deadline:
                    for conn in (self._wconn, self._conn):
                        if conn is not None:
                            conn.close()
                    self._wconn = self._conn = None
                    time.sleep(0.02)
                    continue
                self._close()
                raise RecordStoreError(
                    f"record file {self.path} is not a usable SQLite database: {exc}"
                ) from None
            except sqlite3.Error as exc:
                self._close()
                raise RecordStoreError(
                    f"record file {self.path} is not a usable SQLite database: {exc}"
                ) from None

    def _connect(self) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(
                self.path, timeout=BUSY_TIMEOUT_SECONDS, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as exc:
            raise RecordStoreError(f"cannot open record file {self.path}: {exc}") from None
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            if self.checkpoint_bytes:
                conn.execute("PRAGMA wal_autocheckpoint=0")  # the checkpointer thread's job (class docstring)
        except sqlite3.Error:
            conn.close()
            raise
        return conn

    def _written(self, nbytes: int) -> None:
        """The writer thread, after a commit of about `nbytes`: wake the checkpointer once
        `checkpoint_bytes` are pending; park while it has found the WAL past four times that."""
        if not self.checkpoint_bytes:
            return
        with self._ckpt:
            self._pending += nbytes
            if self._pending >= self.checkpoint_bytes:
                if self._ckpt_thread is None:
                    self._ckpt_thread = threading.Thread(
                        target=self._checkpoint_loop, name="record-checkpointer", daemon=True
                    )
                    self._ckpt_thread.start()
                self._ckpt.notify_all()
            while self._wal_full and not self._ckpt_stop:
                self._parked = True
                self._ckpt.notify_all()
                self._ckpt.wait()
            self._parked = False

    def _checkpoint_loop(self) -> None:
        # A PASSIVE checkpoint copies the frames committed before it began while commits go on adding
        # more. SQLite rewinds the WAL (its file is kept and written over) only at a transaction that
        # begins with every frame copied, which a busy writer, always inside one, never does. So once
        # a checkpoint finds the WAL past four times the threshold, the writer parks after its next
        # commit, a checkpoint runs with no transaction open, and its next one rewinds the WAL. Should
        # a reader's snapshot keep the checkpoint from finishing for a second, the writer goes on.
        conn = self._connect()
        page = conn.execute("PRAGMA page_size").fetchone()[0]
        tries = 0
        try:
            while True:
                with self._ckpt:
                    while (
                        self._pending < self.checkpoint_bytes and not self._wal_full and not self._ckpt_stop
                    ):
                        self._ckpt.wait()
                    while self._wal_full and not self._parked and not self._ckpt_stop:
                        self._ckpt.wait()
                    if self._ckpt_stop:
                        return
                    self._pending = 0
                try:
                    _, frames, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                except sqlite3.Error:
                    frames, copied = 1, 0  # busy or failing: as if a reader held it
                self.checkpoints += 1
                with self._ckpt:
                    if not self._wal_full:
                        self._wal_full = frames * page >= 4 * self.checkpoint_bytes
                        tries = 0
                    elif frames == copied or tries >= 100:
                        self._wal_full = False
                        self._ckpt.notify_all()
                    else:
                        tries += 1
                if tries:
                    time.sleep(0.01)
        finally:
            conn.close()

    def _stop_checkpointer(self) -> None:
        with self._ckpt:
            self._ckpt_stop = True
            self._ckpt.notify_all()
        if self._ckpt_thread is not None:
            self._ckpt_thread.join()

    def _prepare(self, conn: sqlite3.Connection) -> None:
        # BEGIN IMMEDIATE: two processes opening a new file at once create the schema only once.
        with _immediate(conn):
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if version == 0 and not tables:
                for statement in _statements(_SCHEMA + _V2_INDEXES + _V3_CLAIMS + _V4_SETTINGS):
                    conn.execute(statement)
            elif version == 1 and "episodes" in tables and self._columns(conn) == _V1_COLUMNS:
                self._migrate_v1(conn)
                self._migrate_v2(conn)
                self._migrate_v3(conn)
            elif version == 2 and "episodes" in tables and self._columns(conn) == _COLUMNS:
                self._migrate_v2(conn)
                self._migrate_v3(conn)
            elif version == 3 and "episodes" in tables and self._columns(conn) == _COLUMNS:
                self._migrate_v3(conn)
            elif version > SCHEMA_VERSION and "episodes" in tables:
                raise SchemaTooNew(
                    f"record file {self.path} has schema version {version}, newer than this bcstack's "
                    f"{SCHEMA_VERSION}: upgrade bcstack to read it"
                )
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
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

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
        for statement in _statements(_V2_INDEXES):
            conn.execute(statement)

    def _migrate_v2(self, conn: sqlite3.Connection) -> None:
        """Version 2 -> 3: the claims table."""
        for statement in _statements(_V3_CLAIMS):
            conn.execute(statement)

    def _migrate_v3(self, conn: sqlite3.Connection) -> None:
        """Version 3 -> 4: the settings table."""
        for statement in _statements(_V4_SETTINGS):
            conn.execute(statement)

    def _read(self) -> sqlite3.Connection:
        if self._conn is None or self._closed:
            raise RecordStoreError(f"record file {self.path} is closed")
        return self._conn

    def _write(self) -> sqlite3.Connection:
        if self._wconn is None or self._closed:
            raise RecordStoreError(f"record file {self.path} is closed")
        return self._wconn

    _INSERT = (
        f"INSERT OR IGNORE INTO episodes ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})"
    )

    @staticmethod
    def _params(row: Row) -> tuple[Any, ...]:
        correct = None if row.correct is None else int(row.correct)
        return (*(getattr(row, c) for c in _COLUMNS[:-1]), correct)

    def _write_batch(self, rows: Sequence[Row]) -> list[Exception | None]:
        keep, outcomes = self._first_of_each(rows)
        result: list[Exception | None] = [outcomes.get(i) for i in range(len(rows))]
        with self._wlock:
            conn = self._wconn
            if conn is None:
                raise RecordStoreError(f"record file {self.path} is closed")
            try:
                # The write lock: nobody records an id between the look and the insert.
                with _immediate(conn):
                    recorded = self._recorded(conn, [rows[i].episode_id for i in keep])
                    fresh = []
                    for i in keep:
                        if rows[i].episode_id in recorded:
                            result[i] = RecordExists(f"episode {rows[i].episode_id} is already recorded")
                        else:
                            fresh.append(rows[i])
                    conn.executemany(self._INSERT, [self._params(row) for row in fresh])
                    conn.executemany(
                        "DELETE FROM episode_claims WHERE episode_id = ?",
                        [(row.episode_id,) for row in fresh],
                    )
            except sqlite3.Error as exc:
                raise RecordStoreError(f"cannot write {len(rows)} episode(s) to {self.path}: {exc}") from None
        self._written(sum(len(row.body) for row in fresh))
        return result

    @staticmethod
    def _recorded(conn: sqlite3.Connection, episode_ids: list[str]) -> set[str]:
        """Which of `episode_ids` are recorded already (in chunks under SQLite's variable limit)."""
        found: set[str] = set()
        for at in range(0, len(episode_ids), 500):
            chunk = episode_ids[at : at + 500]
            marks = ", ".join("?" * len(chunk))
            found.update(
                row[0]
                for row in conn.execute(
                    f"SELECT episode_id FROM episodes WHERE episode_id IN ({marks})", chunk
                )
            )
        return found

    def insert_rows(self, rows: Iterator[Row]) -> int:
        """Insert encoded rows in one transaction (an export's target); how many."""
        n = 0
        with self._wlock:
            conn = self._write()
            with _immediate(conn):
                for row in rows:
                    n += conn.execute(self._INSERT, self._params(row)).rowcount
        return n

    def checkpoint(self) -> None:
        """Fold the WAL into the file and leave it a plain one-file database (a copy to hand on)."""
        with self._wlock:
            conn = self._write()
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            conn.execute("PRAGMA journal_mode=DELETE")

    # Take an id when it is free, the caller's own, or its lease lapsed.
    _CLAIM = (
        "INSERT INTO episode_claims (episode_id, replica, lease_until) VALUES (?, ?, ?) "
        "ON CONFLICT (episode_id) DO UPDATE SET replica = excluded.replica, "
        "lease_until = excluded.lease_until "
        "WHERE episode_claims.replica = excluded.replica OR episode_claims.lease_until < ?"
    )

    def claim(self, episode_id: str, replica: str, lease_seconds: float) -> str | None:
        return self._claim(episode_id, replica, lease_seconds, look_first=False)[1]

    def claim_or_record(
        self, episode_id: str, replica: str, lease_seconds: float
    ) -> tuple[dict[str, Any] | None, str | None]:
        return self._claim(episode_id, replica, lease_seconds, look_first=True)

    def _claim(
        self, episode_id: str, replica: str, lease_seconds: float, *, look_first: bool
    ) -> tuple[dict[str, Any] | None, str | None]:
        """One transaction: with `look_first` the record when there is one; else the claim's
        upsert and who holds the id (None: the caller)."""
        now = time.time()
        row = None
        with self._wlock:
            conn = self._write()
            try:
                with _immediate(conn):
                    if look_first:
                        found = conn.execute("SELECT body FROM episodes WHERE episode_id = ?", (episode_id,))
                        row = found.fetchone()
                    if row is None:
                        conn.execute(self._CLAIM, (episode_id, replica, now + lease_seconds, now))
                        holder = conn.execute(
                            "SELECT replica FROM episode_claims WHERE episode_id = ?", (episode_id,)
                        ).fetchone()[0]
            except sqlite3.Error as exc:
                raise RecordStoreError(f"cannot claim episode {episode_id} in {self.path}: {exc}") from None
        if row is not None:
            return self._decode(episode_id, row[0]), None
        return None, (None if holder == replica else holder)

    def renew(self, episode_ids: Sequence[str], replica: str, lease_seconds: float) -> int:
        if not episode_ids:
            return 0
        until = time.time() + lease_seconds
        with self._wlock:
            conn = self._write()
            try:
                cur = conn.executemany(
                    "UPDATE episode_claims SET lease_until = ? WHERE episode_id = ? AND replica = ?",
                    [(until, e, replica) for e in episode_ids],
                )
                return cur.rowcount
            except sqlite3.Error as exc:
                raise RecordStoreError(f"cannot renew claims in {self.path}: {exc}") from None

    def release(self, episode_id: str, replica: str) -> None:
        with self._wlock:
            conn = self._write()
            try:
                conn.execute(
                    "DELETE FROM episode_claims WHERE episode_id = ? AND replica = ?", (episode_id, replica)
                )
            except sqlite3.Error as exc:
                raise RecordStoreError(f"cannot release episode {episode_id} in {self.path}: {exc}") from None

    def read_setting(self, key: str) -> tuple[int, dict[str, Any]] | None:
        with self._lock:
            row = self._query("SELECT version, value FROM store_settings WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        try:
            return row[0], json.loads(row[1])
        except ValueError as exc:
            raise RecordStoreError(f"setting {key!r} in {self.location} is damaged: {exc}") from None

    def write_setting(self, key: str, value: Mapping[str, Any]) -> int:
        text = self._setting_json(key, value)
        with self._wlock:
            conn = self._write()
            try:
                with _immediate(conn):
                    conn.execute(
                        "INSERT INTO store_settings (key, version, value, updated_at) VALUES (?, 1, ?, ?) "
                        "ON CONFLICT (key) DO UPDATE SET version = store_settings.version + 1, "
                        "value = excluded.value, updated_at = excluded.updated_at",
                        (key, text, time.time()),
                    )
                    return conn.execute(
                        "SELECT version FROM store_settings WHERE key = ?", (key,)
                    ).fetchone()[0]
            except sqlite3.Error as exc:
                raise RecordStoreError(f"cannot write setting {key!r} to {self.path}: {exc}") from None

    def get(self, episode_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._query("SELECT body FROM episodes WHERE episode_id = ?", (episode_id,)).fetchone()
        if row is None:
            return None
        return self._decode(episode_id, row[0])

    def _decode(self, episode_id: str, body: bytes) -> dict[str, Any]:
        try:
            return json.loads(zlib.decompress(body))
        except (zlib.error, ValueError) as exc:
            raise RecordStoreError(f"episode {episode_id} in {self.location} is damaged: {exc}") from None

    def list(self, *, limit: int = 100, question_id: str | None = None) -> list[dict[str, Any]]:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        columns = ", ".join(SUMMARY_FIELDS)
        # rowid breaks created_at ties so records put in the same instant still list newest first.
        where, params = ("WHERE question_id = ? ", (question_id,)) if question_id is not None else ("", ())
        sql = f"SELECT {columns} FROM episodes {where}ORDER BY created_at DESC, rowid DESC LIMIT ?"
        with self._lock:
            rows = self._query(sql, (*params, limit)).fetchall()
        return [dict(zip(SUMMARY_FIELDS, row, strict=True)) for row in rows]

    def search(
        self, query: RecordQuery = RecordQuery(), *, offset: int = 0, limit: int = 50
    ) -> tuple[list[dict[str, Any]], int]:
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
        """Every record, oldest first, read in one snapshot."""
        with self._lock:
            rows = self._query(
                "SELECT episode_id, body FROM episodes ORDER BY created_at, rowid", ()
            ).fetchall()
        for episode_id, body in rows:
            yield self._decode(episode_id, body)

    def _export_sqlite(self, tmp: Path) -> int:
        # SQLite's online backup API: a consistent copy with what is still in the -wal file (a
        # plain `cp` of a live WAL database misses it).
        target = sqlite3.connect(tmp)
        try:
            with self._lock:
                self._read().backup(target)
            n = target.execute("SELECT count(*) FROM episodes").fetchone()[0]
            target.execute("PRAGMA journal_mode=DELETE")
        finally:
            target.close()
        return n

    def _query(self, sql: str, params: tuple[Any, ...]) -> sqlite3.Cursor:
        try:
            return self._read().execute(sql, params)
        except sqlite3.Error as exc:
            raise RecordStoreError(f"cannot read record file {self.path}: {exc}") from None

    def _close(self) -> None:
        self._stop_checkpointer()
        with self._lock, self._wlock:
            for conn in (self._conn, self._wconn):
                if conn is not None:
                    conn.close()
            self._conn = self._wconn = None
