"""The coordinator's durable episode records: round trip, immutability, listing, crash safety,
concurrent writers and clear errors on a file that is not a record store."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from core.record_store import RecordStoreError, SqliteRecordStore

REPO_ROOT = Path(__file__).resolve().parents[1]


def make_record(episode_id: str, **fields: object) -> dict:
    return {"episode_id": episode_id, "status": "finished", **fields}


def test_a_big_record_round_trips_exactly_and_is_stored_compressed(tmp_path):
    path = tmp_path / "deep" / "dir" / "records.sqlite"
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
    with SqliteRecordStore(path) as store:
        store.put(record)
        assert store.get("ep-big") == record
        assert store.get("missing") is None
        assert store.count() == 1
    raw_json_bytes = len(json.dumps(record).encode())
    assert path.stat().st_size < raw_json_bytes / 2  # closed: the WAL is checkpointed into the file
    with SqliteRecordStore(path) as reopened:
        assert reopened.get("ep-big") == record


def test_created_at_is_filled_in_when_missing(tmp_path):
    with SqliteRecordStore(tmp_path / "r.sqlite") as store:
        store.put(make_record("ep-1"))
        stored = store.get("ep-1")
        assert isinstance(stored["created_at"], float) and stored["created_at"] > 1_600_000_000
        assert store.list()[0]["created_at"] == stored["created_at"]


def test_finished_records_are_immutable(tmp_path):
    with SqliteRecordStore(tmp_path / "r.sqlite") as store:
        first = make_record("ep-1", answer="first")
        store.put(first)
        with pytest.raises(RecordStoreError, match="episode ep-1 is already recorded"):
            store.put(make_record("ep-1", answer="second", status="failed"))
        assert store.get("ep-1") == {**first, "created_at": store.get("ep-1")["created_at"]}
        assert store.count() == 1


def test_records_without_an_episode_id_or_status_are_refused(tmp_path):
    with SqliteRecordStore(tmp_path / "r.sqlite") as store:
        with pytest.raises(ValueError, match="episode_id"):
            store.put({"status": "finished"})
        with pytest.raises(ValueError, match="status"):
            store.put({"episode_id": "ep-1"})
        assert store.count() == 0


def test_list_gives_summaries_newest_first_with_limit_and_question_filter(tmp_path):
    with SqliteRecordStore(tmp_path / "r.sqlite") as store:
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


def test_sixteen_threads_put_and_read_concurrently(tmp_path):
    store = SqliteRecordStore(tmp_path / "r.sqlite")
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
    store.close()


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


def test_a_closed_store_says_so(tmp_path):
    store = SqliteRecordStore(tmp_path / "r.sqlite")
    store.close()
    store.close()
    with pytest.raises(RecordStoreError, match="closed"):
        store.put(make_record("ep-1"))
    with pytest.raises(RecordStoreError, match="closed"):
        store.count()
