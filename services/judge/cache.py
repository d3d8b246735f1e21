"""Verdict cache of the judge proxy: each distinct grading request reaches the grader at most once.

    cache = VerdictCache(Path("judge-cache.sqlite"))
    key = VerdictCache.key(grader="openai", template=TEMPLATE, model="grader", inputs={"answer": "42"})
    verdict, how = await cache.get_or_compute(key, call_grader, keep=lambda v: v["parsed"])

Three layers, checked in order: a bounded in-memory LRU (hot hits touch neither disk nor thread),
the SQLite file (survives restarts), and the map of computations in flight, so concurrent identical
requests share one grader call ("coalesced") instead of each making their own.

The file is in WAL mode with synchronous=NORMAL: a commit survives the process being killed (the WAL
is in the OS page cache), only an OS crash or power loss can drop the last few commits, and a
dropped verdict is merely graded again. Values are stored and handed out as JSON text, so a caller
gets the same shapes (lists, string keys) on a miss as on a later hit from disk, always a fresh copy.

A cache that fails to read or write while serving (disk full, a damaged row) is logged and
bypassed: a grading request does not fail because its verdict could not be cached.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

How = Literal["hit", "miss", "coalesced"]
MEMORY_ITEMS = 10_000
# Seconds a writer waits for another process holding the write lock (judge replicas sharing a file).
BUSY_TIMEOUT_SECONDS = 30.0
_TABLE = "verdicts"
_COLUMNS = ("key", "value", "created_at")
_SCHEMA = f"""
CREATE TABLE {_TABLE} (
    key        TEXT PRIMARY KEY NOT NULL,
    value      TEXT NOT NULL,
    created_at REAL NOT NULL
)
"""


class CacheError(RuntimeError):
    """The cache file cannot be opened, is not a judge cache, or cannot be read or written."""


def _keep_all(value: dict) -> bool:
    return True


class VerdictCache:
    """Verdicts by key: a SQLite file (survives restarts) + an in-process map of in-flight
    computations (coalescing) + an LRU of recent values.

    `path=None` keeps verdicts in memory only (still coalesces, still remembers `memory_items`).
    Thread-safe for get/put/count: one connection behind a lock, so `asyncio.to_thread` callers may
    overlap; `get_or_compute` belongs to one event loop.
    """

    def __init__(self, path: Path | None, *, memory_items: int = MEMORY_ITEMS) -> None:
        if memory_items < 0:
            raise ValueError(f"memory_items must be >= 0, got {memory_items}")
        self.path = Path(path) if path is not None else None
        self.stats: dict[str, int] = {"hit": 0, "miss": 0, "coalesced": 0}
        self._memory_items = memory_items
        self._memory: OrderedDict[str, str] = OrderedDict()
        self._memory_lock = threading.Lock()
        self._disk_lock = threading.Lock()
        # key -> the shared computation: (value as JSON text, whether it was found on disk)
        self._in_flight: dict[str, asyncio.Task[tuple[str, bool]]] = {}
        self._closed = False
        self._conn: sqlite3.Connection | None = None
        if self.path is not None:
            self._conn = self._open(self.path)

    # --- key --------------------------------------------------------------------------------------

    @staticmethod
    def key(grader: str, template: str, model: str, inputs: Mapping[str, str]) -> str:
        """sha256 hex of a canonical JSON of everything that decides a verdict.

        sort_keys makes the order of `inputs` irrelevant; ensure_ascii and fixed separators make the
        text (and so the hash) independent of platform and json defaults.
        """
        document = {"grader": grader, "template": template, "model": model, "inputs": dict(inputs)}
        text = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(text.encode("ascii")).hexdigest()

    # --- the coalescing read-through --------------------------------------------------------------

    async def get_or_compute(
        self,
        key: str,
        compute: Callable[[], Awaitable[dict]],
        *,
        keep: Callable[[dict], bool] = _keep_all,
    ) -> tuple[dict, How]:
        """The value of `key` and how it was obtained: "hit", "miss" (this call ran `compute`) or
        "coalesced" (this call waited for an identical computation already running).

        A miss stores the value (memory and file) before returning when `keep(value)` is true. If
        `compute` raises, every waiter gets the exception and nothing is stored. A cancelled waiter
        does not cancel the computation: it runs on for the others, and when every waiter has gone
        (a client timed out) it still finishes and stores, so the client's retry does not pay for a
        second grader call.
        """
        if self._closed:
            raise CacheError(f"verdict cache {self.path or '(in memory)'} is closed")
        text = self._recall(key)
        if text is not None:
            self.stats["hit"] += 1
            return json.loads(text), "hit"
        flight = self._in_flight.get(key)
        joined = flight is not None
        if flight is None:
            flight = asyncio.ensure_future(self._resolve(key, compute, keep))
            flight.add_done_callback(_retrieve_outcome)
            self._in_flight[key] = flight
        # shield: cancelling this caller (its client went away) leaves the computation running.
        text, found = await asyncio.shield(flight)
        how: How = "hit" if found else "coalesced" if joined else "miss"
        self.stats[how] += 1
        return json.loads(text), how

    async def _resolve(
        self, key: str, compute: Callable[[], Awaitable[dict]], keep: Callable[[dict], bool]
    ) -> tuple[str, bool]:
        """The shared computation: (value as JSON text, whether it was found on disk)."""
        try:
            if self._conn is not None:
                text = await asyncio.to_thread(self._load_or_log, key)
                if text is not None:
                    self._remember(key, text)
                    return text, True
            value = await compute()
            if not isinstance(value, dict):
                raise TypeError(f"a verdict must be a dict, compute returned {type(value).__name__}")
            text = json.dumps(value, separators=(",", ":"))
            if keep(value):
                if self._conn is not None:
                    await asyncio.to_thread(self._store_or_log, key, text)
                self._remember(key, text)
            return text, False
        finally:
            if self._in_flight.get(key) is asyncio.current_task():
                del self._in_flight[key]

    # --- plain access -----------------------------------------------------------------------------

    def get(self, key: str) -> dict | None:
        """The stored value of `key` (a fresh copy), or None. Reads the file on a memory miss."""
        text = self._recall(key)
        if text is None and self._conn is not None:
            text = self._load(key)
            if text is not None:
                self._remember(key, text)
        return None if text is None else json.loads(text)

    def put(self, key: str, value: dict) -> None:
        """Store `value` under `key` (replacing any), committed to the file before returning."""
        text = json.dumps(value, separators=(",", ":"))
        if self._conn is not None:
            self._store(key, text)
        self._remember(key, text)

    def count(self) -> int:
        """Verdicts stored: rows in the file, or values in memory when there is no file."""
        if self.path is None:
            with self._memory_lock:
                return len(self._memory)
        with self._disk_lock:
            try:
                return self._connection().execute(f"SELECT COUNT(*) FROM {_TABLE}").fetchone()[0]
            except sqlite3.Error as exc:
                raise CacheError(f"cannot count verdicts in {self.path}: {exc}") from None

    def close(self) -> None:
        """Close the file (idempotent); computations still in flight finish but store in memory only."""
        self._closed = True
        with self._disk_lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    # --- memory -----------------------------------------------------------------------------------

    def _recall(self, key: str) -> str | None:
        with self._memory_lock:
            text = self._memory.get(key)
            if text is not None:
                self._memory.move_to_end(key)
            return text

    def _remember(self, key: str, text: str) -> None:
        if self._memory_items == 0:
            return
        with self._memory_lock:
            self._memory[key] = text
            self._memory.move_to_end(key)
            while len(self._memory) > self._memory_items:
                self._memory.popitem(last=False)

    # --- disk -------------------------------------------------------------------------------------

    @staticmethod
    def _open(path: Path) -> sqlite3.Connection:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CacheError(f"cannot create the directory of verdict cache {path}: {exc}") from None
        try:
            # isolation_level=None: every statement commits on its own (one commit per put).
            conn = sqlite3.connect(
                path, timeout=BUSY_TIMEOUT_SECONDS, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as exc:
            raise CacheError(f"cannot open verdict cache {path}: {exc}") from None
        try:
            _prepare(conn, path)
        except CacheError:
            conn.close()
            raise
        except sqlite3.Error as exc:
            conn.close()
            raise CacheError(f"verdict cache {path} is not a usable SQLite database: {exc}") from None
        return conn

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise CacheError(f"verdict cache {self.path} is closed")
        return self._conn

    def _load(self, key: str) -> str | None:
        with self._disk_lock:
            try:
                cursor = self._connection().execute(f"SELECT value FROM {_TABLE} WHERE key = ?", (key,))
                row = cursor.fetchone()
            except sqlite3.Error as exc:
                raise CacheError(f"cannot read verdict {key} from {self.path}: {exc}") from None
        if row is None:
            return None
        try:
            json.loads(row[0])
        except (TypeError, ValueError) as exc:
            raise CacheError(f"verdict {key} in {self.path} is damaged: {exc}") from None
        return row[0]

    def _store(self, key: str, text: str) -> None:
        with self._disk_lock:
            try:
                self._connection().execute(
                    f"INSERT OR REPLACE INTO {_TABLE} ({', '.join(_COLUMNS)}) VALUES (?, ?, ?)",
                    (key, text, time.time()),
                )
            except sqlite3.Error as exc:
                raise CacheError(f"cannot write verdict {key} to {self.path}: {exc}") from None

    def _load_or_log(self, key: str) -> str | None:
        # A damaged row reads as absent: the verdict is computed again and the put replaces the row.
        try:
            return self._load(key)
        except CacheError as exc:
            log.warning("verdict cache read failed, computing instead: %s", exc)
            return None

    def _store_or_log(self, key: str, text: str) -> None:
        try:
            self._store(key, text)
        except CacheError as exc:
            log.warning("verdict cache write failed, the verdict is kept in memory only: %s", exc)


def _prepare(conn: sqlite3.Connection, path: Path) -> None:
    """WAL mode and the schema; a SQLite file that holds something else is refused, not extended."""
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    # BEGIN IMMEDIATE: two processes opening a new file at once create the table only once.
    conn.execute("BEGIN IMMEDIATE")
    try:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:
            conn.execute(_SCHEMA)
        elif _TABLE not in tables:
            raise CacheError(
                f"{path} is a SQLite database but not a verdict cache (tables: {', '.join(sorted(tables))})"
            )
        else:
            columns = tuple(row[1] for row in conn.execute(f"PRAGMA table_info({_TABLE})"))
            if columns != _COLUMNS:
                raise CacheError(
                    f"{path}: table '{_TABLE}' has columns {', '.join(columns)}; "
                    f"expected {', '.join(_COLUMNS)}"
                )
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def _retrieve_outcome(task: asyncio.Task) -> None:
    # A computation whose waiters were all cancelled has nobody to hand its exception to; reading it
    # here keeps asyncio from logging "exception was never retrieved" for an expected failure.
    if not task.cancelled():
        task.exception()
