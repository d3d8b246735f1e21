"""Kill anything during an evaluation (issue 19, item 5).

`bcstack eval run` goes over the local stack (the scripted expert worker: fast, deterministic, and
right on every toy question it can research) while the test SIGKILLs, in turn, the retrieval
service, the engine, the worker, the judge and the gateway, each while episodes are in flight, and
brings each back with `bcstack restart`. What a user relies on afterwards: the evaluation finished
(exit 0); every (question, round) has exactly one judgement and one run file; every status says
what happened (a kill the stack rode out is a plain `finish` with the right answer, a failure is an
error naming the service); and the gateway recorded every (question, round) episode once, under
the evaluation's episode id, with nothing recorded twice.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import zlib

import httpx
import pytest
from conftest import wait_until

from bcstack.stack import down, read_state, restart, up

ROUNDS = 3
CONCURRENCY = 4
KILL_ORDER = ("retrieval", "engine", "worker", "judge", "coordinator")


def bcstack(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bcstack", *args], capture_output=True, text=True, timeout=timeout
    )


def judgements(out) -> list[dict]:
    path = out / "judgements.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def stored_episodes(records) -> list[dict]:
    """Every record in the gateway's SQLite file, read as a user of the file would (read-only)."""
    with sqlite3.connect(f"file:{records}?mode=ro", uri=True) as conn:
        rows = conn.execute("SELECT body FROM episodes").fetchall()
    return [json.loads(zlib.decompress(body)) for (body,) in rows]


def gateway_active(info: dict) -> int:
    r = httpx.get(info["services"]["coordinator"]["http"] + "/health", timeout=2)
    return int(r.json().get("active_episodes", 0))


@pytest.fixture(scope="module")
def stack(tmp_path_factory, toy_kit):
    state = tmp_path_factory.mktemp("kill-stack")
    kit = toy_kit["dir"]  # the session's world, tokenizer and index: nothing to build
    info = up(
        state, worker="expert", world=kit / "world", kit=kit / "tiny", index=kit / "idx", say=lambda s: None
    )
    try:
        yield {"state": state, "info": info, "questions": kit / "world" / "questions.jsonl"}
    finally:
        if read_state(state) is not None:
            down(state, say=lambda s: None)


def test_restart_refuses_an_unknown_service_in_one_line(stack):
    result = bcstack("restart", "retreival", "--state", str(stack["state"]))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "no service 'retreival'" in result.stderr and "retrieval" in result.stderr


def test_every_service_killed_during_an_evaluation(stack, tmp_path):
    state, out = stack["state"], tmp_path / "eval"
    n_questions = len(stack["questions"].read_text().splitlines())
    cmd = [
        sys.executable, "-m", "bcstack", "eval", "run", "--questions", str(stack["questions"]),
        "--out", str(out), "--state", str(state), "--rounds", str(ROUNDS), "--concurrency", str(CONCURRENCY),
    ]  # fmt: skip
    log = (tmp_path / "eval.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    t0 = time.monotonic()
    kills: list[tuple[str, float, float]] = []  # (service, killed at, seconds its restart took)
    try:
        for name in KILL_ORDER:
            info = read_state(state)
            assert info is not None
            before = len(judgements(out))
            # Episodes in flight on the gateway (and so branches on the worker, generations on the
            # engine, searches on retrieval, grades queued behind them) at the moment of the kill.
            wait_until(lambda info=info: gateway_active(info) > 0, timeout=60, interval=0.02,
                       message=f"episodes in flight before killing {name}")  # fmt: skip
            pid = info["services"][name]["pid"]
            os.killpg(pid, signal.SIGKILL)
            killed_at = time.monotonic()
            if name == KILL_ORDER[0]:  # the command a user runs; then the same call in-process (faster)
                restarted = bcstack("restart", name, "--state", str(state))
                assert restarted.returncode == 0, restarted.stderr
            else:
                restart(state, name, say=lambda s: None)
            kills.append((name, round(killed_at - t0, 1), round(time.monotonic() - killed_at, 1)))
            assert read_state(state)["services"][name]["pid"] != pid
            assert proc.poll() is None, f"eval run exited {proc.returncode} after {name} was killed"
            # The evaluation goes on after the restart before the next service is killed.
            wait_until(lambda before=before: len(judgements(out)) > before + 2, timeout=120, interval=0.1,
                       message=f"evaluation progress after restarting {name}")  # fmt: skip
        assert proc.wait(timeout=300) == 0, (tmp_path / "eval.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()

    rows = judgements(out)
    pairs = [(r["query_id"], r["round"]) for r in rows]
    # Every (question, round) judged exactly once.
    assert len(pairs) == len(set(pairs)) == n_questions * ROUNDS
    # Every run file is there, and its status says what happened.
    for r in rows:
        run = json.loads((out / "runs" / str(r["round"]) / f"{r['query_id']}.json").read_text())
        assert run["status"] == r["status"] and run["episode_id"] == r["episode_id"]
    # Each kill was ridden out (the services wait for a restarted neighbour): no disrupted episode
    # became a wrong answer. A failure that outlasted the waits would be named in `error`.
    print(f"kills (service, s into the run, s to restart): {kills}; run took {time.monotonic() - t0:.0f} s")
    failed = [(r["query_id"], r["round"], r["status"], r["error"]) for r in rows if r["correct"] is not True]
    assert not failed, (kills, failed)
    assert {r["status"] for r in rows} == {"finish"} and not any(r["error"] for r in rows)

    # The gateway recorded each (question, round) once, under the evaluation's episode id
    # (eval-<run id>-<query id>-r<round>), and nothing else of this evaluation.
    run_id = json.loads((out / "eval.json").read_text())["run_id"]
    records = [
        e for e in stored_episodes(state / "records.sqlite") if e["episode_id"].startswith(f"eval-{run_id}-")
    ]
    ids = [e["episode_id"] for e in records]
    assert len(ids) == len(set(ids))
    assert sorted(ids) == sorted(r["episode_id"] for r in rows)
    assert sorted(ids) == sorted(f"eval-{run_id}-{q}-r{n}" for q, n in pairs)
    worker_ids = [w["episode_id"] for e in records for w in e["workers"]]
    assert len(worker_ids) == len(set(worker_ids))
