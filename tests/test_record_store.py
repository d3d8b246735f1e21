"""The coordinator's durable episode records: one contract, run on both adapters (the SQLite file
and a real PostgreSQL server): round trip, immutability, listing, searching, group commit under
concurrent writers, claims, export, migrations of every older schema, a newer schema refused, crash
safety; and each adapter's own clear errors (a file that is not a record store; a database that
does not answer, with its password kept out of every message)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import zlib
from pathlib import Path

import psycopg
import pytest
from conftest import find_free_port as free_port
from fixtures_pg import new_database, pg_server, pg_url  # noqa: F401 (fixtures)

from core.record_store import (
    RecordExists,
    RecordQuery,
    RecordStoreError,
    SchemaTooNew,
    SqliteRecordStore,
    open_record_store,
    redact,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


def make_record(episode_id: str, **fields: object) -> dict:
    return {"episode_id": episode_id, "status": "finished", **fields}


@pytest.fixture(params=["sqlite", "postgres"])
def target(request, tmp_path) -> str:
    """Where a store goes: a SQLite file, or a fresh database on the session's PostgreSQL."""
    if request.param == "sqlite":
        return str(tmp_path / "r.sqlite")
    return new_database(request.getfixturevalue("pg_server"))


def test_a_big_record_round_trips_exactly_and_is_stored_compressed(target):
    token_ids = [(i * 7919) % 151_000 for i in range(200_000)]
    record = make_record(
        "ep-big",
        question_id="q1",
        endpoint="minimax",
        created_at=1_700_000_000.5,
        question="Which Nobel laureate was born in Tartu?",
        workers=[{"trajectory": {"token_ids": token_ids, "loss_mask": [i % 2 for i in range(200_000)]}}],
        grades={"correct": True, "score": 0.75},
        answer="Ünïcödé ✓",
    )
    raw_json_bytes = len(json.dumps(record).encode())
    with open_record_store(target) as store:
        store.put(record)
        assert store.get("ep-big") == record
        assert store.get("missing") is None
        assert store.count() == 1
    if target.startswith("postgresql://"):
        with psycopg.connect(target) as conn:
            stored = conn.execute("SELECT octet_length(body) FROM episodes").fetchone()[0]
    else:
        stored = Path(target).stat().st_size  # closed: the WAL is checkpointed into the file
    assert stored < raw_json_bytes / 2
    with open_record_store(target) as reopened:
        assert reopened.get("ep-big") == record


def test_created_at_is_filled_in_when_missing(target):
    with open_record_store(target) as store:
        store.put(make_record("ep-1"))
        stored = store.get("ep-1")
        assert isinstance(stored["created_at"], float) and stored["created_at"] > 1_600_000_000
        assert store.list()[0]["created_at"] == stored["created_at"]


def test_finished_records_are_immutable(target):
    with open_record_store(target) as store:
        first = make_record("ep-1", answer="first")
        store.put(first)
        with pytest.raises(RecordStoreError, match="episode ep-1 is already recorded"):
            store.put(make_record("ep-1", answer="second", status="failed"))
        assert store.get("ep-1") == {**first, "created_at": store.get("ep-1")["created_at"]}
        assert store.count() == 1


def test_records_without_an_episode_id_or_status_are_refused(target):
    with open_record_store(target) as store:
        with pytest.raises(ValueError, match="episode_id"):
            store.put({"status": "finished"})
        with pytest.raises(ValueError, match="status"):
            store.put({"episode_id": "ep-1"})
        assert store.count() == 0


def test_list_gives_summaries_newest_first_with_limit_and_question_filter(target):
    with open_record_store(target) as store:
        for i, question in enumerate(["q1", "q2", "q1", None, "q1"]):
            store.put(
                make_record(
                    f"ep-{i}",
                    question_id=question,
                    endpoint="default",
                    created_at=1000.0 + i,
                    status="finished" if i % 2 == 0 else "failed",
                    trajectory=[1, 2, 3],
                )
            )
        # Same timestamp as ep-4: the later put lists first.
        store.put(make_record("ep-5", question_id="q2", created_at=1004.0))

        everything = store.list()
        assert [r["episode_id"] for r in everything] == ["ep-5", "ep-4", "ep-3", "ep-2", "ep-1", "ep-0"]
        assert everything[1] == {
            "episode_id": "ep-4",
            "question_id": "q1",
            "status": "finished",
            "endpoint": "default",
            "created_at": 1004.0,
        }
        assert everything[2]["question_id"] is None and everything[0]["endpoint"] is None
        assert [r["episode_id"] for r in store.list(limit=2)] == ["ep-5", "ep-4"]
        assert [r["episode_id"] for r in store.list(question_id="q1")] == ["ep-4", "ep-2", "ep-0"]
        assert [r["episode_id"] for r in store.list(question_id="q1", limit=1)] == ["ep-4"]
        assert store.list(question_id="nope") == []
        assert store.list(limit=0) == []
        assert store.count() == 6


def test_a_record_survives_sigkill_right_after_put_returns(tmp_path):
    path = tmp_path / "records.sqlite"
    token_ids = list(range(50_000))
    script = textwrap.dedent(
        f"""
        import os, sys
        from pathlib import Path
        sys.path.insert(0, {str(REPO_ROOT)!r})
        from core.record_store import SqliteRecordStore
        store = SqliteRecordStore(Path({str(path)!r}))
        store.put({{"episode_id": "ep-a", "status": "finished", "question_id": "q1", "created_at": 1.0}})
        store.put({{"episode_id": "ep-b", "status": "finished", "token_ids": list(range(50_000)),
                    "created_at": 2.0}})
        os.kill(os.getpid(), 9)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert result.returncode == -signal.SIGKILL, result.stderr

    with SqliteRecordStore(path) as store:
        assert store.count() == 2
        assert store.get("ep-b")["token_ids"] == token_ids
        assert [r["episode_id"] for r in store.list()] == ["ep-b", "ep-a"]
        # The reopened file takes new records and still refuses to overwrite old ones.
        store.put(make_record("ep-c"))
        with pytest.raises(RecordStoreError, match="already recorded"):
            store.put(make_record("ep-a"))


def test_sixteen_threads_put_and_read_concurrently(target):
    store = open_record_store(target)
    errors: list[BaseException] = []
    start = threading.Barrier(16)

    def writer(thread: int) -> None:
        try:
            start.wait()
            for i in range(25):
                episode_id = f"t{thread}-{i}"
                store.put(make_record(episode_id, question_id=f"q{thread}", token_ids=[thread] * 500))
                assert store.get(episode_id)["token_ids"] == [thread] * 500
                store.list(limit=5)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert store.count() == 16 * 25
    assert len(store.list(limit=1000)) == 400
    assert len(store.list(question_id="q3")) == 25
    # Group commit: writers that waited together shared a transaction.
    assert store.written == 400 and store.batches < 400
    store.close()


def test_sqlite_checkpoints_in_the_background_and_keeps_its_wal_bounded(tmp_path):
    """Group commit leaves SQLite's in-commit checkpoint off and copies the WAL back from a thread
    of its own; writers that outrun it wait, so the WAL file (whose size is its high-water mark)
    stays within a few times the threshold however much is written (without the parking a busy
    writer never lets SQLite rewind it, and it grows by everything written)."""
    path = tmp_path / "r.sqlite"
    threshold = 256 << 10
    store = SqliteRecordStore(path, checkpoint_bytes=threshold)
    noise = os.urandom(6000).hex()  # ~6 KiB that zlib cannot shrink below ~6 KiB

    def writer(thread: int) -> None:
        for i in range(120):
            store.put(make_record(f"t{thread}-{i}", blob=noise[i:] + str(thread)))

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    written = sum(len(zlib.compress(noise.encode())) for _ in range(16 * 120))
    wal = path.with_name(path.name + "-wal").stat().st_size
    assert store.count() == 16 * 120
    assert store.checkpoints >= 5
    assert written > 12 << 20 and wal < 16 * threshold, (written, wal)
    assert sqlite3.connect(path).execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 1000  # a reader's own
    store.close()
    # A commit per episode (the store before group commit) leaves checkpoints to SQLite.
    with SqliteRecordStore(tmp_path / "b.sqlite", group_commit=False) as plain:
        plain.put(make_record("ep"))
        assert plain.checkpoint_bytes == 0 and plain.checkpoints == 0


def test_a_corrupt_file_is_a_clear_error_naming_it(tmp_path):
    path = tmp_path / "records.sqlite"
    path.write_bytes(os.urandom(8192))
    with pytest.raises(RecordStoreError) as excinfo:
        SqliteRecordStore(path)
    message = str(excinfo.value)
    assert str(path) in message and "\n" not in message


def test_a_foreign_sqlite_database_is_a_clear_error_naming_it(tmp_path):
    path = tmp_path / "other.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE users (name TEXT)")
    conn.commit()
    conn.close()
    with pytest.raises(RecordStoreError, match="not a coordinator record file") as excinfo:
        SqliteRecordStore(path)
    assert str(path) in str(excinfo.value)


def test_a_closed_store_says_so(target):
    store = open_record_store(target)
    store.close()
    store.close()
    with pytest.raises(RecordStoreError, match="closed"):
        store.put(make_record("ep-1"))
    with pytest.raises(RecordStoreError, match="closed"):
        store.count()


def _varied(store) -> None:
    """Six records across groups, statuses, weight versions and verdicts."""
    rows = [
        ("a", "g1", "finished", ["v1"], True, 100.0),
        ("b", "g1", "finished", ["v1", "v2"], False, 101.0),
        ("c", "g2", "failed", ["v2"], None, 102.0),
        ("d", "g2", "finished", [], True, 103.0),
        ("e", None, "cut", ["v3"], None, 104.0),
        ("f", "g1", "finished", ["v2"], True, 105.0),
    ]
    for episode_id, group, status, versions, correct, at in rows:
        grades = None if correct is None else {"correct": correct}
        store.put(
            make_record(
                episode_id, group_id=group, status=status, weight_versions=versions, grades=grades,
                created_at=at, endpoint="e1" if episode_id < "d" else "e2", question_id=f"q-{episode_id}",
            )
        )  # fmt: skip


def test_search_filters_pages_and_facets_alike_on_both(target):
    with open_record_store(target) as store:
        _varied(store)

        def ids(**query) -> list[str]:
            rows, total = store.search(RecordQuery(**query), limit=100)
            assert total == len(rows)
            return [r["episode_id"] for r in rows]

        assert ids() == ["f", "e", "d", "c", "b", "a"]
        assert ids(group_id="g1") == ["f", "b", "a"]
        assert ids(status="finished", group_id="g2") == ["d"]
        assert ids(weight_version="v2") == ["f", "c", "b"]
        assert ids(graded="correct") == ["f", "d", "a"]
        assert ids(graded="incorrect") == ["b"]
        assert ids(graded="ungraded") == ["e", "c"]
        assert ids(endpoint="e2") == ["f", "e", "d"]
        assert ids(created_from=101.0, created_to=104.0) == ["d", "c", "b"]
        page, total = store.search(RecordQuery(), offset=2, limit=2)
        assert total == 6 and [r["episode_id"] for r in page] == ["d", "c"]
        first = store.search(RecordQuery(question_id="q-b"))[0][0]
        assert first == {
            "episode_id": "b", "question_id": "q-b", "group_id": "g1", "status": "finished",
            "endpoint": "e1", "created_at": 101.0, "weight_versions": ["v1", "v2"], "correct": False,
        }  # fmt: skip
        assert store.facets() == {
            "status": ["cut", "failed", "finished"],
            "endpoint": ["e1", "e2"],
            "weight_version": ["v1", "v2", "v3"],
        }


def test_a_claim_is_held_renewed_taken_over_when_it_lapses_and_dropped_by_the_record(target):
    with open_record_store(target) as store:
        assert store.claim("ep", "r1", 30) is None  # new: r1 holds it
        assert store.claim("ep", "r1", 30) is None  # its own: still r1's
        assert store.claim("ep", "r2", 30) == "r1"  # another replica is told who holds it
        assert store.renew(["ep", "not-held"], "r1", 30) == 1
        assert store.renew(["ep"], "r2", 30) == 0  # only the holder renews
        assert store.claim("lapsed", "r1", -1) is None  # a lease already over
        assert store.claim("lapsed", "r2", 30) is None  # taken over
        assert store.claim("lapsed", "r1", 30) == "r2"
        store.release("lapsed", "r1")  # not r1's: nothing happens
        assert store.claim("lapsed", "r3", 30) == "r2"
        store.release("lapsed", "r2")
        assert store.claim("lapsed", "r3", 30) is None
        store.put(make_record("ep"))  # the record's write drops the claim
        assert store.claim("ep", "r2", 30) is None


def test_a_repeat_within_one_group_commit_keeps_the_first(target):
    with open_record_store(target) as store:
        futures = [store.submit(store.encode(make_record("same", answer=str(i)))) for i in range(5)]
        futures += [store.submit(store.encode(make_record(f"other-{i}"))) for i in range(5)]
        outcomes = [f.exception(timeout=30) for f in futures]
        assert sum(o is None for o in outcomes[:5]) == 1
        assert all(isinstance(o, RecordExists) for o in outcomes[:5] if o is not None)
        assert outcomes[5:] == [None] * 5
        assert store.count() == 6


@pytest.mark.parametrize("fmt", ["jsonl", "sqlite"])
def test_export_writes_every_record_oldest_first(target, tmp_path, fmt):
    out = tmp_path / f"out.{fmt}"
    with open_record_store(target) as store:
        _varied(store)
        assert store.export(out, fmt=fmt) == 6
        wanted = list(store.iter_records())
    assert [r["episode_id"] for r in wanted] == ["a", "b", "c", "d", "e", "f"]
    if fmt == "jsonl":
        assert [json.loads(line) for line in out.read_text().splitlines()] == wanted
    else:
        assert not Path(str(out) + "-wal").exists()
        with SqliteRecordStore(out) as copy:
            assert list(copy.iter_records()) == wanted
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_two_stores_opening_a_new_store_at_once_create_it_once(target):
    opened, errors = [], []
    start = threading.Barrier(4)

    def open_one() -> None:
        try:
            start.wait()
            opened.append(open_record_store(target))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    opened[0].put(make_record("x"))
    assert [s.get("x")["episode_id"] for s in opened] == ["x"] * 4
    for s in opened:
        s.close()


def test_a_store_of_a_newer_schema_is_refused_in_one_line(target):
    open_record_store(target).close()
    if target.startswith("postgresql://"):
        with psycopg.connect(target) as conn:
            conn.execute("UPDATE bcstack_schema SET version = 99")
    else:
        conn = sqlite3.connect(target)
        conn.execute("PRAGMA user_version = 99")
        conn.close()
    with pytest.raises(SchemaTooNew) as excinfo:
        open_record_store(target)
    message = str(excinfo.value)
    assert "schema version 99" in message and "upgrade bcstack" in message and "\n" not in message
    if target.startswith("postgresql://"):
        password = target.split("://", 1)[1].split("@")[0].split(":")[1]
        assert password not in message


def test_a_version_1_postgresql_database_is_migrated_with_its_filter_columns_filled(pg_url):  # noqa: F811
    from core.record_store_pg import MIGRATIONS, SCHEMA_VERSION

    record = make_record("old", group_id="g", weight_versions=[7], grades={"correct": False}, created_at=5.0)
    body = zlib.compress(json.dumps(record).encode())
    with psycopg.connect(pg_url) as conn:  # what a version-1 bcstack left
        conn.execute("CREATE TABLE bcstack_schema (version integer NOT NULL)")
        conn.execute("INSERT INTO bcstack_schema VALUES (1)")
        for statement in MIGRATIONS[0][1]:
            conn.execute(statement)
        conn.execute(
            "INSERT INTO episodes (episode_id, status, created_at, body) VALUES ('old', 'finished', 5.0, %s)",
            (body,),
        )
    with open_record_store(pg_url) as store:
        assert store.get("old") == record
        rows, _ = store.search(RecordQuery(group_id="g", weight_version="7", graded="incorrect"))
        assert [r["episode_id"] for r in rows] == ["old"]
        assert store.claim("old-claim", "r1", 30) is None  # version 3's table is there
    with psycopg.connect(pg_url) as conn:
        assert conn.execute("SELECT version FROM bcstack_schema").fetchone()[0] == SCHEMA_VERSION == 4


def test_a_postgresql_that_does_not_answer_is_one_line_without_the_password(tmp_path):
    from core.record_store_pg import PostgresRecordStore

    port = free_port()
    url = f"postgresql://bcstack:s3cret-Pa55@127.0.0.1:{port}/bcstack"
    with pytest.raises(RecordStoreError) as excinfo:
        PostgresRecordStore(url, connect_timeout=1)
    message = str(excinfo.value)
    assert "s3cret-Pa55" not in message and "\n" not in message
    assert f"postgresql://bcstack@127.0.0.1:{port}/bcstack" in message
    # Without waiting: it starts, is not ready, and a put says why (the password still out).
    store = PostgresRecordStore(url, wait=False, connect_timeout=1)
    assert store.ready is False
    with pytest.raises(RecordStoreError) as excinfo:
        store.put(make_record("x"))
    assert "s3cret-Pa55" not in str(excinfo.value)
    store.close()


def test_a_wrong_password_is_refused_without_echoing_it(pg_server):  # noqa: F811
    url = pg_server.url.replace(pg_server.password, "Wr0ng-Pa55word")
    with pytest.raises(RecordStoreError) as excinfo:
        open_record_store(url, connect_timeout=1)  # the pool's retries would wait the 10 s default
    message = str(excinfo.value)
    assert "Wr0ng-Pa55word" not in message and "password authentication failed" in message


def test_a_postgresql_that_comes_up_later_is_connected_then(tmp_path):
    from bcstack.pgserver import PostgresServer
    from core.record_store_pg import PostgresRecordStore

    folder = Path(tempfile.mkdtemp(prefix="bcstack-pg-late-"))
    server = PostgresServer(folder, port=free_port())
    server.init()
    try:
        store = PostgresRecordStore(server.url, wait=False, connect_timeout=1)
        with pytest.raises(RecordStoreError):
            store.connect()
        server.start()
        deadline = time.monotonic() + 30
        while True:
            try:
                store.connect()
                break
            except RecordStoreError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        store.put(make_record("late"))
        assert store.ready and store.get("late")["episode_id"] == "late"
        store.close()
    finally:
        server.stop(mode="immediate")
        shutil.rmtree(folder, ignore_errors=True)


def test_redact_masks_passwords_in_urls_and_keywords():
    assert (
        redact("cannot reach postgresql://u:p%40ss@h:5432/db now")
        == "cannot reach postgresql://u:***@h:5432/db now"
    )
    assert redact("host=h password=hunter2 user=u") == "host=h password=*** user=u"
    assert redact("postgresql://u@h/db") == "postgresql://u@h/db"


def test_claim_or_record_answers_the_record_or_the_claim_in_one_call(target):
    with open_record_store(target) as store:
        assert store.claim_or_record("ep", "r1", 30) == (None, None)  # claimed by r1
        assert store.claim_or_record("ep", "r1", 30) == (None, None)  # its own
        assert store.claim_or_record("ep", "r2", 30) == (None, "r1")  # held by r1
        store.put(make_record("ep", answer="42"))
        record, holder = store.claim_or_record("ep", "r2", 30)
        assert holder is None and record["answer"] == "42"  # recorded: the record, no claim taken
        assert store.claim("ep", "r3", 30) is None  # the record's write dropped r1's claim
        assert store.claim_or_record("lapsed", "r1", -1) == (None, None)
        assert store.claim_or_record("lapsed", "r2", 30) == (None, None)  # taken over


def test_settings_are_versioned_shared_and_outlive_the_store(target):
    with open_record_store(target) as one, open_record_store(target) as two:
        assert one.read_setting("coordinator.endpoints") is None
        assert one.write_setting("coordinator.endpoints", {"active": "a"}) == 1
        assert two.read_setting("coordinator.endpoints") == (1, {"active": "a"})  # another replica
        assert two.write_setting("coordinator.endpoints", {"active": "b", "n": [1, 2]}) == 2
        assert one.read_setting("coordinator.endpoints") == (2, {"active": "b", "n": [1, 2]})
        assert one.read_setting("other") is None
        with pytest.raises(ValueError, match="at most"):
            one.write_setting("big", {"x": "y" * (70 << 10)})
        with pytest.raises(ValueError, match="JSON object"):
            one.write_setting("list", [1])  # type: ignore[arg-type]
        assert one.read_setting("big") is None
    with open_record_store(target) as again:  # a restarted replica reads what was written
        assert again.read_setting("coordinator.endpoints") == (2, {"active": "b", "n": [1, 2]})


def test_a_version_3_record_file_gains_the_settings_table(tmp_path):
    path = tmp_path / "v3.sqlite"
    with open_record_store(path) as store:
        store.put(make_record("kept"))
    conn = sqlite3.connect(path)  # what a version-3 bcstack left: no settings table
    conn.execute("DROP TABLE store_settings")
    conn.execute("PRAGMA user_version = 3")
    conn.commit()
    conn.close()
    with open_record_store(path) as store:
        assert store.get("kept")["episode_id"] == "kept"
        assert store.write_setting("k", {"v": 1}) == 1
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == 4
