"""`bcstack up` / `bcstack down` and `bcstack eval run` / `report` against the real local stack."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest
from conftest import wait_until

from bcstack.stack import StackError, down, read_state, up


def bcstack(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bcstack", *args], capture_output=True, text=True, timeout=timeout
    )


def alive(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError):  # the fixture started the stack here: reap an exited child
        os.waitpid(pid, os.WNOHANG)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) is not running
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def stack(tmp_path_factory, toy_kit):
    state = tmp_path_factory.mktemp("stack")
    kit = toy_kit["dir"]  # the session's world, tokenizer and index (conftest.toy_kit): nothing to build
    info = up(
        state, worker="expert", world=kit / "world", kit=kit / "tiny", index=kit / "idx", say=lambda s: None
    )
    # Five questions per tier of the world's eight: the evaluations below stay 15 questions long.
    rows = [json.loads(line) for line in (kit / "world" / "questions.jsonl").read_text().splitlines()]
    tiers: dict[str, list[str]] = {}
    for row in rows:
        tiers.setdefault(row["data_source"], []).append(json.dumps(row))
    questions = state / "questions.jsonl"
    questions.write_text("".join(line + "\n" for lines in tiers.values() for line in lines[:5]))
    try:
        yield {"state": state, "info": info, "questions": questions}
    finally:
        if read_state(state) is not None:
            down(state, say=lambda s: None)


def judgements(out) -> list[dict]:
    path = out / "judgements.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def test_up_starts_every_service_and_a_second_up_refuses(stack):
    services = stack["info"]["services"]
    assert set(services) == {"retrieval", "engine", "worker", "coordinator-llm", "coordinator", "judge"}
    assert all(alive(s["pid"]) for s in services.values())
    assert json.loads((stack["state"] / "stack.json").read_text()) == stack["info"]
    assert oct((stack["state"] / "admin-token").stat().st_mode & 0o777) == "0o600"
    with pytest.raises(StackError, match="already running"):
        up(stack["state"], say=lambda s: None)
    again = bcstack("up", "--state", str(stack["state"]))
    assert again.returncode == 2 and "already running" in again.stderr and "Traceback" not in again.stderr


def test_eval_run_and_report_against_the_stack(stack, tmp_path):
    out = tmp_path / "eval"
    run = bcstack(
        "eval",
        "run",
        "--questions",
        str(stack["questions"]),
        "--out",
        str(out),
        "--state",
        str(stack["state"]),
    )
    assert run.returncode == 0, run.stderr
    rows = judgements(out)
    assert len(rows) == 15 and all(r["correct"] is True and r["status"] == "finish" for r in rows)
    run_files = sorted((out / "runs" / "0").glob("*.json"))
    assert len(run_files) == 15
    one = json.loads(run_files[0].read_text())
    assert set(one) >= {"query_id", "tool_call_counts", "status", "retrieved_docids", "result"}
    assert one["tool_call_counts"]["search"] >= 1 and one["retrieved_docids"]
    assert one["result"][-1]["type"] == "output_text"
    report = bcstack("eval", "report", str(out))
    assert report.returncode == 0, report.stderr
    assert "| eval | 5/5 | 5/5 | 5/5 | 15/15 (100.00%) |" in report.stdout
    assert "Wilson 95% interval: 79.61–100.00%" in report.stdout
    assert all((out / f).is_file() for f in ("report.md", "report.json", "report.png"))


def test_a_killed_eval_run_resumes_without_redoing_or_losing_questions(stack, tmp_path):
    out = tmp_path / "killed"
    cmd = [
        sys.executable,
        "-m",
        "bcstack",
        "eval",
        "run",
        "--questions",
        str(stack["questions"]),
        "--out",
        str(out),
        "--state",
        str(stack["state"]),
        "--rounds",
        "2",
        "--concurrency",
        "1",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: len(judgements(out)) >= 6, timeout=120, interval=0.05, message="6 judgements")
    finally:
        proc.send_signal(signal.SIGKILL)  # a real kill: no cleanup runs
        proc.wait(timeout=10)
    before = judgements(out)
    assert 6 <= len(before) < 30
    resumed = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "already done" in resumed.stdout
    after = judgements(out)
    pairs = [(r["query_id"], r["round"]) for r in after]
    assert len(pairs) == len(set(pairs)) == 30  # 15 questions x 2 rounds, none twice
    assert after[: len(before)] == before  # nothing done before the kill was redone or rewritten
    # the same set as an uninterrupted run over the same questions
    clean = tmp_path / "clean"
    assert subprocess.run([*cmd[:8], str(clean), *cmd[9:]], capture_output=True, timeout=300).returncode == 0
    assert sorted(pairs) == sorted((r["query_id"], r["round"]) for r in judgements(clean))
    assert sorted(p.name for p in (out / "runs" / "1").glob("*.json")) == sorted(
        p.name for p in (clean / "runs" / "1").glob("*.json")
    )


def test_down_stops_every_process_and_leaves_no_orphans(stack):
    pids = [s["pid"] for s in stack["info"]["services"].values()]
    result = bcstack("down", "--state", str(stack["state"]))
    assert result.returncode == 0 and "6 service(s) stopped" in result.stdout
    wait_until(lambda: not any(alive(p) for p in pids), timeout=30, message="every service to exit")
    # nothing of the stack's process groups is left either (e.g. a child of a service)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)
    assert read_state(stack["state"]) is None
    again = bcstack("down", "--state", str(stack["state"]))
    assert again.returncode == 2 and "no stack" in again.stderr
