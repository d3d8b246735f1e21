"""bench/suite_cpu.py's reading of the kernel's process-accounting records and its charging of each
process to the test module that started it; its pytest plugin logging every item in a real run.
The whole bench (root, accton, a `make test`) is a command with a committed report, not a test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import bench_module

ROOT = Path(__file__).resolve().parents[1]
suite_cpu = bench_module("suite_cpu")


def _line(command: str, user: int, system: int, pid: int, ppid: int, started: float) -> str:
    when = time.strftime("%a %b %d %H:%M:%S %Y", time.localtime(started))
    return (
        f"{command:16s}|v3|{user:9.2f}|{system:9.2f}|     2.00|     0|     0| 18480.00|     0.00|"
        f"{pid:8d}|{ppid:8d}| F   |       0|__      |{when}"
    )


def test_dump_acct_lines_become_processes_with_cpu_seconds_and_start_times():
    t0 = 1_796_674_200.0
    text = "\n".join(
        [_line("python", 150, 50, 101, 1, t0), "not a record", _line("postgres", 3, 1, 102, 101, t0 + 7)]
    )
    processes = suite_cpu.parse_dump_acct(text, ticks_per_second=100)
    assert [(p.command, p.cpu, p.pid, p.ppid, p.started) for p in processes] == [
        ("python", 2.0, 101, 1, t0),
        ("postgres", 0.04, 102, 101, t0 + 7),
    ]


def test_each_process_is_charged_to_its_workers_module_at_the_second_it_started():
    t0 = 1_796_674_200.0
    items = [  # worker 10 ran module a then b; worker 20 ran c (gw0 logged its child 11)
        {
            "worker": "gw0",
            "pid": 10,
            "module": "a",
            "start": t0,
            "end": t0 + 10,
            "cpu": 4.0,
            "children": [11],
        },
        {"worker": "gw0", "pid": 10, "module": "a", "start": t0 + 10, "end": t0 + 20, "cpu": 1.0},
        {"worker": "gw0", "pid": 10, "module": "b", "start": t0 + 40, "end": t0 + 50, "cpu": 2.0},
        {"worker": "gw1", "pid": 20, "module": "c", "start": t0, "end": t0 + 50, "cpu": 3.0},
    ]
    P = suite_cpu.Process
    processes = [
        P("python", 20.0, 10, 5, t0 - 30),  # worker gw0: 7 s in its items, 13 s its set-up
        P("python", 3.0, 20, 5, t0 - 30),  # worker gw1: all of it in its items
        # gw0's forkserver, started before its first item; reparented to init when gw0 left, it is
        # known as gw0's from the children gw0 logged.
        P("python", 1.0, 11, 1, t0 - 25),
        P("python", 8.0, 12, 11, t0 + 15),  # forked by it during a: charged to a through the chain
        P("haproxy", 2.0, 13, 12, t0 + 44),  # started by that service, but while gw0 ran b
        P("python", 5.0, 21, 20, t0 + 30),  # gw1's child during c
        P("python", 0.5, 14, 10, t0 + 30),  # gw0 between a and b: set-up
        P("make", 1.5, 5, 1, t0 - 40),  # outside: the workers' parent and make
        P("postgres", 0.25, 30, 1, t0 + 5),  # reparented to init: no worker in its chain
    ]
    charges = suite_cpu.charge(processes, items)
    cpu = {name: round(c.cpu, 2) for name, c in charges.items()}
    assert cpu == {
        "a": 5.0 + 8.0,
        "b": 2.0 + 2.0,
        "c": 3.0 + 5.0,
        suite_cpu.SETUP: 13.0 + 1.0 + 0.5,
        suite_cpu.OUTSIDE: 1.5 + 0.25,
    }
    assert (charges["a"].items, charges["a"].wall) == (2, 20.0)
    assert charges["b"].commands == {"haproxy": 2.0}
    # Every second of CPU is charged once.
    assert sum(cpu.values()) == pytest.approx(sum(p.cpu for p in processes))


def test_the_plugin_logs_every_item_with_its_module_times_and_cpu(tmp_path):
    tests = tmp_path / "case"
    tests.mkdir()
    (tests / "test_two.py").write_text(
        "def test_spin():\n    sum(range(200_000))\n\ndef test_quick():\n    pass\n"
    )
    log = tmp_path / "log"
    log.mkdir()
    env = {**os.environ, suite_cpu.LOG_ENV: str(log), "PYTHONPATH": str(ROOT)}
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "bench.suite_cpu", "-p", "no:randomly",
         "-p", "no:cacheprovider", str(tests)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [json.loads(line) for line in (log / "items-main.jsonl").read_text().splitlines()]
    assert [r["module"] for r in rows] == ["case/test_two.py"] * 2
    assert all(r["pid"] == rows[0]["pid"] and r["end"] >= r["start"] and r["cpu"] >= 0 for r in rows)


def test_the_bench_refuses_without_root_or_its_tools_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert suite_cpu.main([]) == 2
    assert capsys.readouterr().err.strip() == "bench/suite_cpu.py: process accounting needs root (accton)"
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert suite_cpu.main([]) == 2
    assert capsys.readouterr().err.strip().endswith("accton, dump-acct not found: apt-get install acct")
