"""The PostgreSQL record store: one database shared by every gateway replica (`core.record_store`
has the interface and its contract; this is the production adapter).

    store = PostgresRecordStore("postgresql://bcstack@db:5432/bcstack")   # password: URL or PGPASSWORD

psycopg 3 with its connection pool (`psycopg_pool.ConnectionPool`). Group commits insert many
episodes with one statement in one transaction; `claim()` is one upsert that takes an id only when
it is free, the caller's, or its lease lapsed, against the server's clock (replicas' clocks may
disagree). Bodies are the same zlib-compressed JSON as in SQLite; `weight_versions` is `jsonb`.

Schema migrations are versioned (`MIGRATIONS`, the version in `bcstack_schema`); they run under a
transaction-scoped advisory lock, so replicas starting together migrate once, and a database whose
version is newer than this code's is refused with one line. Every message that could carry the
connection string goes through `redact()`: a password never reaches a log or an error.
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import psycopg
import psycopg_pool
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from core.record_store import (
    MAX_BATCH,
    ROW_FIELDS,
    SUMMARY_FIELDS,
    RecordExists,
    RecordQuery,
    RecordStore,
    RecordStoreError,
    Row,
    SchemaTooNew,
    redact,
)

log = logging.getLogger("bcstack.records")
# The pool logs a warning at every failed reconnection (every few seconds while the database is
# down); the store reports an outage itself, once, in one line.
logging.getLogger("psycopg.pool").setLevel(logging.ERROR)

# Each entry: (version, statements). Only ever appended; each runs once, in order, in one
# transaction with the version bump. 1-2 mirror the SQLite file's history; 3 adds claims, 4 settings.
MIGRATIONS: tuple[tuple[int, tuple[str, ...]], ...] = (
    (
        1,
        (
            """CREATE TABLE episodes (
                seq         bigint GENERATED ALWAYS AS IDENTITY,
                episode_id  text PRIMARY KEY,
                question_id text,
                status      text NOT NULL,
                endpoint    text,
                created_at  double precision NOT NULL,
                body        bytea NOT NULL
            )""",
            # Bodies are zlib-compressed already: stored out of line without pglz trying again.
            "ALTER TABLE episodes ALTER COLUMN body SET STORAGE EXTERNAL",
            "CREATE INDEX episodes_by_time ON episodes (created_at, seq)",
            "CREATE INDEX episodes_by_question ON episodes (question_id, created_at)",
        ),
    ),
    (
        2,
        (
            "ALTER TABLE episodes ADD COLUMN group_id text",
            "ALTER TABLE episodes ADD COLUMN weight_versions jsonb NOT NULL DEFAULT '[]'",
            "ALTER TABLE episodes ADD COLUMN correct boolean",
            "CREATE INDEX episodes_by_group ON episodes (group_id, created_at)",
            "CREATE INDEX episodes_by_status ON episodes (status, created_at)",
            "CREATE INDEX episodes_by_weights ON episodes USING gin (weight_versions)",
        ),
    ),
    (
        3,
        (
            """CREATE TABLE episode_claims (
                episode_id  text PRIMARY KEY,
                replica     text NOT NULL,
                lease_until timestamptz NOT NULL
            )""",
        ),
    ),
    (
        4,
        (
            """CREATE TABLE store_settings (
                key        text PRIMARY KEY,
                version    bigint NOT NULL,
                value      jsonb NOT NULL,
                updated_at timestamptz NOT NULL DEFAULT now()
            )""",
        ),
    ),
)
SCHEMA_VERSION = MIGRATIONS[-1][0]
# pg_advisory_xact_lock key of the migrations ("bcstack" in ASCII, as a number).
MIGRATION_LOCK = 0x626373746163
CONNECT_TIMEOUT_SECONDS = 10
_COLUMNS = (
    "episode_id",
    "question_id",
    "status",
    "endpoint",
    "created_at",
    "body",
    "group_id",
    "weight_versions",
    "correct",
)


def describe(url: str) -> str:
    """`url` without its password, for messages."""
    try:
        params = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return redact(url)
    params.pop("password", None)
    host, port, db = params.get("host", "localhost"), params.get("port", "5432"), params.get("dbname", "")
    user = params.get("user")
    return f"postgresql://{user + '@' if user else ''}{host}:{port}/{db}"


def migrate(conn: psycopg.Connection, *, where: str) -> int:
    """Bring the schema to SCHEMA_VERSION (the caller's connection, autocommit off); the version."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
        conn.execute("CREATE TABLE IF NOT EXISTS bcstack_schema (version integer NOT NULL)")
        row = conn.execute("SELECT version FROM bcstack_schema").fetchone()
        version = row[0] if row else 0
        if version > SCHEMA_VERSION:
            raise SchemaTooNew(
                f"record database {where} has schema version {version}, newer than this bcstack's "
                f"{SCHEMA_VERSION}: upgrade bcstack (or point it at another database)"
            )
        if version == 0:
            tables = conn.execute(
                "SELECT count(*) FROM information_schema.tables WHERE table_schema = current_schema() "
                "AND table_name IN ('episodes', 'episode_claims')"
            ).fetchone()[0]
            if tables:
                raise RecordStoreError(
                    f"record database {where} has an 'episodes' table bcstack did not create "
                    "(no bcstack_schema version): use another database or schema"
                )
            conn.execute("INSERT INTO bcstack_schema (version) VALUES (0)")
        for target, statements in MIGRATIONS:
            if target <= version:
                continue
            for statement in statements:
                conn.execute(statement)
            if target == 2:  # fill the filter columns of records written at version 1
                _fill_v2(conn)
            conn.execute("UPDATE bcstack_schema SET version = %s", (target,))
            log.info("record database %s migrated to schema version %d", where, target)
            version = target
    return version


def _fill_v2(conn: psycopg.Connection) -> None:
    from core.record_store import index_fields

    rows = conn.execute("SELECT episode_id, body FROM episodes").fetchall()
    updates = []
    for episode_id, body in rows:
        try:
            record = json.loads(zlib.decompress(body))
        except (zlib.error, ValueError):
            continue
        if isinstance(record, dict):
            group_id, versions, correct = index_fields(record)
            updates.append((group_id, versions, correct, episode_id))
    if updates:
        with conn.cursor() as cur:
            cur.executemany(
                "UPDATE episodes SET group_id = %s, weight_versions = %s::jsonb, correct = %s "
                "WHERE episode_id = %s",
                updates,
            )


class PostgresRecordStore(RecordStore):
    """Episode records in PostgreSQL, shared by every gateway replica. Thread-safe (a pool).

    With `wait=True` (the default) the constructor connects and migrates, raising RecordStoreError
    with one line when it cannot. With `wait=False` it returns at once and the pool keeps trying in
    the background: `connect()` then connects and migrates (the gateway starts not ready and
    becomes ready when the database answers)."""

    def __init__(
        self,
        url: str,
        *,
        group_commit: bool = True,
        max_batch: int = MAX_BATCH,
        pool_size: int = 8,
        wait: bool = True,
        connect_timeout: float = CONNECT_TIMEOUT_SECONDS,
    ) -> None:
        super().__init__(group_commit=group_commit, max_batch=max_batch)
        self.location = describe(url)
        self._ready = False
        try:
            conninfo = make_conninfo(url, connect_timeout=max(1, int(connect_timeout)))
        except psycopg.ProgrammingError as exc:
            raise RecordStoreError(
                redact(f"not a PostgreSQL connection URL ({self.location}): {exc}")
            ) from None
        self.connect_timeout = connect_timeout
        self._conninfo = conninfo
        self._pool = psycopg_pool.ConnectionPool(
            conninfo,
            min_size=1,
            max_size=max(2, pool_size),
            open=False,
            name="bcstack-records",
            timeout=connect_timeout,
        )
        try:
            self._pool.open(wait=False)
        except psycopg.Error as exc:
            raise RecordStoreError(self._message("cannot connect to", exc)) from None
        if wait:
            try:
                self.connect()
            except RecordStoreError:
                self._pool.close()
                raise

    def _message(self, what: str, exc: BaseException) -> str:
        detail = " ".join(str(exc).split()) or type(exc).__name__
        return redact(f"{what} record database {self.location}: {detail}")

    def _why_not(self) -> str:
        """Why the pool has no connection: one direct attempt says (a refused port, a wrong
        password, no such database), where the pool's timeout alone does not."""
        try:
            psycopg.connect(self._conninfo).close()
        except psycopg.Error as exc:
            return self._message("cannot connect to", exc)
        return f"cannot connect to record database {self.location} within {self.connect_timeout:g} s"

    @property
    def ready(self) -> bool:
        """Connected and migrated."""
        return self._ready

    def connect(self) -> None:
        """Wait for a connection (up to connect_timeout) and migrate; RecordStoreError otherwise."""
        if self._ready:
            return
        try:
            with self._pool.connection(timeout=self.connect_timeout) as conn:
                migrate(conn, where=self.location)
        except psycopg_pool.PoolTimeout:
            raise RecordStoreError(self._why_not()) from None
        except psycopg.Error as exc:
            raise RecordStoreError(self._message("cannot prepare", exc)) from None
        self._ready = True

    def _run(self, what: str, fn: Any) -> Any:
        """Call fn(conn) on a pooled connection; database errors become one redacted line."""
        if self._closed:
            raise RecordStoreError(f"record store {self.location} is closed")
        self.connect()
        try:
            with self._pool.connection(timeout=self.connect_timeout) as conn:
                return fn(conn)
        except psycopg_pool.PoolTimeout:
            raise RecordStoreError(
                f"cannot {what}: record database {self.location} did not answer "
                f"within {self.connect_timeout:g} s"
            ) from None
        except psycopg.Error as exc:
            raise RecordStoreError(self._message(f"cannot {what} in", exc)) from None

    # --- writing ---------------------------------------------------------------------------------

    def _write_batch(self, rows: Sequence[Row]) -> list[Exception | None]:
        keep, repeats = self._first_of_each(rows)
        result: list[Exception | None] = [repeats.get(i) for i in range(len(rows))]
        chosen = [rows[i] for i in keep]

        def write(conn: psycopg.Connection) -> set[str]:
            with conn.transaction():
                inserted = conn.execute(
                    f"INSERT INTO episodes ({', '.join(_COLUMNS)}) "
                    # Binary parameters (%b): the bodies travel as bytes, not hex text.
                    "SELECT * FROM unnest(%b::text[], %b::text[], %b::text[], %b::text[], "
                    "%b::float8[], %b::bytea[], %b::text[], %b::text[]::jsonb[], %b::bool[]) "
                    "ON CONFLICT (episode_id) DO NOTHING RETURNING episode_id",
                    (
                        [r.episode_id for r in chosen],
                        [r.question_id for r in chosen],
                        [r.status for r in chosen],
                        [r.endpoint for r in chosen],
                        [r.created_at for r in chosen],
                        [r.body for r in chosen],
                        [r.group_id for r in chosen],
                        [r.weight_versions for r in chosen],
                        [r.correct for r in chosen],
                    ),
                ).fetchall()
                stored = {row[0] for row in inserted}
                if stored:
                    conn.execute("DELETE FROM episode_claims WHERE episode_id = ANY(%s)", (list(stored),))
            return stored

        stored = self._run(f"write {len(chosen)} episode(s)", write)
        for i in keep:
            if rows[i].episode_id not in stored:
                result[i] = RecordExists(f"episode {rows[i].episode_id} is already recorded")
        return result

    # --- claims ----------------------------------------------------------------------------------

    def claim(self, episode_id: str, replica: str, lease_seconds: float) -> str | None:
        def claim(conn: psycopg.Connection) -> str:
            with conn.transaction():
                row = conn.execute(
                    "INSERT INTO episode_claims AS c (episode_id, replica, lease_until) "
                    "VALUES (%s, %s, clock_timestamp() + make_interval(secs => %s)) "
                    "ON CONFLICT (episode_id) DO UPDATE SET replica = excluded.replica, "
                    "lease_until = excluded.lease_until "
                    "WHERE c.replica = excluded.replica OR c.lease_until < clock_timestamp() "
                    "RETURNING replica",
                    (episode_id, replica, lease_seconds),
                ).fetchone()
                if row is not None:
                    return row[0]
                held = conn.execute(
                    "SELECT replica FROM episode_claims WHERE episode_id = %s", (episode_id,)
                ).fetchone()
                return held[0] if held else replica

        holder = self._run(f"claim episode {episode_id}", claim)
        return None if holder == replica else holder

    def claim_or_record(
        self, episode_id: str, replica: str, lease_seconds: float
    ) -> tuple[dict[str, Any] | None, str | None]:
        # One statement: the record if there is one; else the claim's upsert and, when it took
        # nothing, who holds it (the statement's snapshot: the row as it was before the upsert).
        # A record committed while this runs can go unseen and the id be claimed: the run that
        # follows finds it recorded at its put (RecordExists) and answers the stored one.
        def ask(conn: psycopg.Connection) -> tuple[Any, Any, Any]:
            with conn.transaction():
                return conn.execute(
                    "WITH recorded AS (SELECT body FROM episodes WHERE episode_id = %(id)s), "
                    "claimed AS ("
                    " INSERT INTO episode_claims AS c (episode_id, replica, lease_until)"
                    " SELECT %(id)s, %(replica)s, clock_timestamp() + make_interval(secs => %(lease)s)"
                    " WHERE NOT EXISTS (SELECT 1 FROM recorded)"
                    " ON CONFLICT (episode_id) DO UPDATE SET replica = excluded.replica,"
                    " lease_until = excluded.lease_until"
                    " WHERE c.replica = excluded.replica OR c.lease_until < clock_timestamp()"
                    " RETURNING replica) "
                    "SELECT (SELECT body FROM recorded), (SELECT replica FROM claimed), "
                    "(SELECT replica FROM episode_claims WHERE episode_id = %(id)s)",
                    {"id": episode_id, "replica": replica, "lease": lease_seconds},
                ).fetchone()

        body, claimed, held = self._run(f"claim episode {episode_id}", ask)
        if body is not None:
            return self._decode(episode_id, bytes(body)), None
        if claimed is not None:
            return None, None
        # Held by another replica (or a claim made between the snapshot and the upsert: ask again).
        return None, held if held not in (None, replica) else "another replica"

    def renew(self, episode_ids: Sequence[str], replica: str, lease_seconds: float) -> int:
        if not episode_ids:
            return 0

        def renew(conn: psycopg.Connection) -> int:
            with conn.transaction():
                cur = conn.execute(
                    "UPDATE episode_claims SET lease_until = clock_timestamp() + make_interval(secs => %s) "
                    "WHERE episode_id = ANY(%s) AND replica = %s",
                    (lease_seconds, list(episode_ids), replica),
                )
                return cur.rowcount

        return self._run("renew claims", renew)

    def release(self, episode_id: str, replica: str) -> None:
        def release(conn: psycopg.Connection) -> None:
            with conn.transaction():
                conn.execute(
                    "DELETE FROM episode_claims WHERE episode_id = %s AND replica = %s", (episode_id, replica)
                )

        self._run(f"release episode {episode_id}", release)

    # --- reading ---------------------------------------------------------------------------------

    def read_setting(self, key: str) -> tuple[int, dict[str, Any]] | None:
        rows = self._fetch(
            f"read setting {key!r}", "SELECT version, value FROM store_settings WHERE key = %s", (key,)
        )
        return (int(rows[0][0]), rows[0][1]) if rows else None

    def write_setting(self, key: str, value: Mapping[str, Any]) -> int:
        text = self._setting_json(key, value)

        def write(conn: psycopg.Connection) -> int:
            with conn.transaction():
                return conn.execute(
                    "INSERT INTO store_settings (key, version, value) VALUES (%s, 1, %s::jsonb) "
                    "ON CONFLICT (key) DO UPDATE SET version = store_settings.version + 1, "
                    "value = excluded.value, updated_at = now() RETURNING version",
                    (key, text),
                ).fetchone()[0]

        return int(self._run(f"write setting {key!r}", write))

    def _decode(self, episode_id: str, body: bytes) -> dict[str, Any]:
        try:
            return json.loads(zlib.decompress(body))
        except (zlib.error, ValueError) as exc:
            raise RecordStoreError(f"episode {episode_id} in {self.location} is damaged: {exc}") from None

    def _fetch(self, what: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        def fetch(conn: psycopg.Connection) -> list[tuple[Any, ...]]:
            with conn.transaction():
                return conn.execute(sql, params).fetchall()

        return self._run(what, fetch)

    def get(self, episode_id: str) -> dict[str, Any] | None:
        rows = self._fetch(
            f"read episode {episode_id}", "SELECT body FROM episodes WHERE episode_id = %s", (episode_id,)
        )
        return self._decode(episode_id, bytes(rows[0][0])) if rows else None

    def list(self, *, limit: int = 100, question_id: str | None = None) -> list[dict[str, Any]]:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        where, params = ("WHERE question_id = %s ", (question_id,)) if question_id is not None else ("", ())
        rows = self._fetch(
            "list episodes",
            f"SELECT {', '.join(SUMMARY_FIELDS)} FROM episodes {where}"
            "ORDER BY created_at DESC, seq DESC LIMIT %s",
            (*params, limit),
        )
        return [dict(zip(SUMMARY_FIELDS, row, strict=True)) for row in rows]

    def search(
        self, query: RecordQuery = RecordQuery(), *, offset: int = 0, limit: int = 50
    ) -> tuple[list[dict[str, Any]], int]:
        if limit < 0 or offset < 0:
            raise ValueError(f"offset and limit must be >= 0, got {offset} and {limit}")
        where, params = query.where(mark="%s", weight_clause="weight_versions @> jsonb_build_array(%s::text)")
        fields = ", ".join(ROW_FIELDS)

        def search(conn: psycopg.Connection) -> tuple[list[tuple[Any, ...]], int]:
            with conn.transaction():  # one snapshot for the count and the page
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                total = conn.execute(f"SELECT count(*) FROM episodes{where}", params).fetchone()[0]
                rows = conn.execute(
                    f"SELECT {fields} FROM episodes{where} "
                    "ORDER BY created_at DESC, seq DESC LIMIT %s OFFSET %s",
                    (*params, limit, offset),
                ).fetchall()
            return rows, total

        rows, total = self._run("search episodes", search)
        out = []
        for row in rows:
            item = dict(zip(ROW_FIELDS, row, strict=True))
            item["weight_versions"] = [str(v) for v in (item["weight_versions"] or [])]
            out.append(item)
        return out, total

    def facets(self) -> dict[str, list[str]]:
        def facets(conn: psycopg.Connection) -> dict[str, list[str]]:
            with conn.transaction():
                statuses = conn.execute("SELECT DISTINCT status FROM episodes ORDER BY status").fetchall()
                endpoints = conn.execute(
                    "SELECT DISTINCT endpoint FROM episodes WHERE endpoint IS NOT NULL ORDER BY endpoint"
                ).fetchall()
                versions = conn.execute(
                    "SELECT DISTINCT v FROM episodes, jsonb_array_elements_text(weight_versions) AS v "
                    "ORDER BY v"
                ).fetchall()
            return {
                "status": [r[0] for r in statuses],
                "endpoint": [r[0] for r in endpoints],
                "weight_version": [str(r[0]) for r in versions],
            }

        return self._run("read facets", facets)

    def count(self) -> int:
        return self._fetch("count episodes", "SELECT count(*) FROM episodes")[0][0]

    def iter_records(self) -> Iterator[dict[str, Any]]:
        """Every record, oldest first, streamed from one snapshot (a server-side cursor)."""
        if self._closed:
            raise RecordStoreError(f"record store {self.location} is closed")
        self.connect()
        try:
            with self._pool.connection(timeout=self.connect_timeout) as conn, conn.transaction():
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                with conn.cursor(name="bcstack_export") as cur:
                    cur.itersize = 256
                    cur.execute("SELECT episode_id, body FROM episodes ORDER BY created_at, seq")
                    for episode_id, body in cur:
                        yield self._decode(episode_id, bytes(body))
        except psycopg_pool.PoolTimeout:
            raise RecordStoreError(f"record database {self.location} did not answer") from None
        except psycopg.Error as exc:
            raise RecordStoreError(self._message("cannot read", exc)) from None

    def _close(self) -> None:
        self._pool.close()
