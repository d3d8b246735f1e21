"""Where `make test`'s CPU goes: every process the suite starts, counted by the kernel's process
accounting and charged to the test module that started it, beside a fixed CPU probe that tells a
slower machine from a bigger suite.

    python bench/suite_cpu.py [--workers N] [--pytest-args ARGS] [--results FILE] [--dirty-ok]

Needs root and Debian's `acct` (`accton`, `dump-acct`; `apt-get install acct`): the kernel writes
one record for every process that exits (its CPU, pid, parent pid, start second), which is the
only count that sees the services a test forks and kills. The bench turns accounting on into a
file of its own, runs `make test` with this file as a pytest plugin (`-p bench.suite_cpu`: each
xdist worker logs every item's module, start, end and the worker's own CPU over it), turns
accounting off, and charges each process to the worker its parent chain leads to and to the module
that worker was running when the process started. A worker's own CPU outside its items is its
collection and set-up. Written by hand: no maintained Python reader of process-accounting records
exists; `dump-acct` (acct(5), version 3 records) is read as text.

The probe, run before and after the suite: a pure-Python loop and a 256 x 256 float32 matmul loop
on one torch thread, each a fixed amount of work. The CPU seconds they take move with the machine
(the same suite's CPU moved 2x between sessions on "the same" 2-core box), so compare two reports'
suite CPU only together with their probes.

Writes bench/results/suite_cpu.md: the whole run (wall, CPU, the probes), then every module's wall
and CPU, heaviest first, and the commands that took the CPU.
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

LOG_ENV = "BCSTACK_SUITE_CPU_LOG"  # the folder each xdist worker logs its items to
OUTSIDE = "(outside the workers: make, compileall, pytest's controller)"
SETUP = "(a worker's collection and set-up)"

# --- the pytest plugin (`-p bench.suite_cpu`): imports nothing heavy ---------------------------------

_log_file = None


def _item_log(record: dict) -> None:
    global _log_file
    folder = os.environ.get(LOG_ENV)
    if not folder:
        return
    if _log_file is None:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        _log_file = open(Path(folder) / f"items-{worker}.jsonl", "a", encoding="utf-8")  # noqa: SIM115
    _log_file.write(json.dumps(record) + "\n")
    _log_file.flush()


def _children() -> list[int]:
    """This process's children now, from every thread's /proc children list (a forked stack's parent
    is the worker's forkserver, which the kernel reparents to init once the worker has gone: its own
    accounting record no longer leads to the worker)."""
    pids: list[int] = []
    for path in Path("/proc/self/task").glob("*/children"):
        try:
            pids += [int(pid) for pid in path.read_text().split()]
        except (OSError, ValueError):
            continue
    return pids


def _cpu_self() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # noqa: ARG001 (pytest's hook signature)
    cpu, start = _cpu_self(), time.time()
    yield
    _item_log(
        {
            "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
            "pid": os.getpid(),
            "module": item.nodeid.split("::")[0],
            "start": start,
            "end": time.time(),
            "cpu": _cpu_self() - cpu,
            "children": _children(),
        }
    )


# --- reading and charging the records -------------------------------------------------------------


@dataclass(frozen=True)
class Process:
    command: str
    cpu: float  # user + system seconds
    pid: int
    ppid: int
    started: float  # epoch seconds (accounting keeps whole seconds)


def parse_dump_acct(text: str, ticks_per_second: float = 100.0) -> list[Process]:
    """`dump-acct FILE`'s lines: command|version|user|system|elapsed|uid|gid|memory|io|pid|ppid|flags|
    exit|tty|start (user and system in clock ticks, the start in local time). Lines of another shape
    are skipped."""
    processes = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split("|")]
        if len(fields) < 12 or fields[1] != "v3":
            continue
        try:
            started = time.mktime(time.strptime(fields[-1], "%a %b %d %H:%M:%S %Y"))
            cpu = (float(fields[2]) + float(fields[3])) / ticks_per_second
            processes.append(Process(fields[0], cpu, int(fields[9]), int(fields[10]), started))
        except ValueError:
            continue
    return processes


@dataclass
class Charge:
    items: int = 0
    wall: float = 0.0
    own: float = 0.0  # the worker's CPU over the module's items
    children: float = 0.0  # processes started while the module ran
    commands: Counter = field(default_factory=Counter)

    @property
    def cpu(self) -> float:
        return self.own + self.children


def charge(processes: Iterable[Process], items: list[dict]) -> dict[str, Charge]:
    """CPU per test module: each worker's own CPU over the module's items, and every process whose
    parent chain leads to that worker (or to a child the worker logged), by the module the worker
    was running in the second the process started. A worker's CPU outside its items, and a process
    started between its items, go to SETUP; a process whose chain reaches no worker goes to OUTSIDE."""
    processes = list(processes)
    charges: dict[str, Charge] = defaultdict(Charge)
    windows: dict[int, list[dict]] = defaultdict(list)
    for item in items:
        windows[item["pid"]].append(item)
        c = charges[item["module"]]
        c.items += 1
        c.wall += item["end"] - item["start"]
        c.own += item["cpu"]
    for spans in windows.values():
        spans.sort(key=lambda i: i["start"])
    parent = {p.pid: p.ppid for p in processes}
    # A worker's children seen at the end of its items: its forkserver among them, whose record names
    # init as its parent where the worker left first.
    owner = {child: item["pid"] for item in items for child in item.get("children", ())}

    def worker_of(pid: int) -> int | None:
        for _ in range(64):  # a chain is a few links; a pid reused as its own ancestor never loops
            if pid in windows:
                return pid
            if pid in owner:
                return owner[pid]
            if pid not in parent:
                return None
            pid = parent[pid]
        return None

    for p in processes:
        if p.pid in windows:  # a worker: its items are counted; the rest of its CPU is its set-up
            charges[SETUP].own += max(0.0, p.cpu - sum(i["cpu"] for i in windows[p.pid]))
            continue
        worker = owner.get(p.pid) or worker_of(p.ppid)
        if worker is None:
            name = OUTSIDE
        else:
            # Whole seconds: the module whose items span the start (a second's slack each side),
            # the latest to begin where two touch.
            name = SETUP
            for span in windows[worker]:
                if span["start"] - 1 <= p.started <= span["end"] + 1:
                    name = span["module"]
        charges[name].children += p.cpu
        charges[name].commands[p.command] += p.cpu
    return dict(charges)


# --- the probe -----------------------------------------------------------------------------------


def probe() -> dict[str, float]:
    """CPU seconds of two fixed pieces of work on one thread: a pure-Python loop, torch matmuls."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = time.process_time()
        total = 0
        for i in range(20_000_000):
            total += i & 7
        python = time.process_time() - start
        a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
        start = time.process_time()
        for _ in range(4000):
            a = torch.tanh(a @ a)
        matmul = time.process_time() - start
    finally:
        torch.set_num_threads(threads)
    return {"python": python, "matmul": matmul}


# --- the run ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    import argparse
    import shlex
    import shutil
    import subprocess
    import sys
    import tempfile

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    from bench.common import Table, print_machine, require_clean_tree, write_results

    parser = argparse.ArgumentParser(
        prog="python bench/suite_cpu.py",
        description=(__doc__ or "").split("\n\n")[0],
        epilog="Needs root and Debian's acct package (apt-get install acct). About as long as `make test`.",
    )
    parser.add_argument("--workers", type=int, default=2, help="PYTEST_WORKERS for make test (default 2)")
    parser.add_argument("--pytest-args", default="", help="more PYTEST_ARGS, e.g. 'tests/test_sft.py'")
    parser.add_argument("--top", type=int, default=40, help="modules in the table (default 40)")
    parser.add_argument("--results", type=Path, default=None, help="default bench/results/suite_cpu.md")
    parser.add_argument(
        "--dirty-ok", action="store_true", help="write the report from uncommitted changes, stamped DIRTY"
    )
    args = parser.parse_args(argv)
    if args.workers < 0 or args.top < 1:
        parser.error("--workers is 0 or more, --top 1 or more")
    if os.geteuid() != 0:
        print("bench/suite_cpu.py: process accounting needs root (accton)", file=sys.stderr)
        return 2
    missing = [tool for tool in ("accton", "dump-acct") if not shutil.which(tool)]
    if missing:
        print(f"bench/suite_cpu.py: {', '.join(missing)} not found: apt-get install acct", file=sys.stderr)
        return 2
    require_clean_tree("suite_cpu", args.dirty_ok)
    print_machine()

    before = probe()
    print(f"probe before: python loop {before['python']:.2f} s, matmuls {before['matmul']:.2f} s of CPU")
    with tempfile.TemporaryDirectory(prefix="suite-cpu-") as tmp:
        folder = Path(tmp)
        pacct = folder / "pacct"
        pacct.touch()
        pytest_args = f"-p bench.suite_cpu {args.pytest_args}".strip()
        command = ["make", "test", f"PYTEST_WORKERS={args.workers}", f"PYTEST_ARGS={pytest_args}"]
        print("$ " + shlex.join(command), flush=True)
        subprocess.run(["accton", str(pacct)], check=True, capture_output=True)
        start = time.monotonic()
        try:
            done = subprocess.run(command, cwd=root, env={**os.environ, LOG_ENV: tmp})
            wall = time.monotonic() - start
            # The workers' forkservers leave when their parent has gone: let them write their records.
            time.sleep(5)
        finally:
            subprocess.run(["accton", "off"], capture_output=True)
        if done.returncode != 0:
            print(f"bench/suite_cpu.py: make test exited {done.returncode}; no report", file=sys.stderr)
            return 1
        text = subprocess.run(["dump-acct", str(pacct)], capture_output=True, text=True, check=True).stdout
        processes = parse_dump_acct(text, float(os.sysconf("SC_CLK_TCK")))
        items = [
            json.loads(line)
            for path in sorted(folder.glob("items-*.jsonl"))
            for line in path.read_text(encoding="utf-8").splitlines()
        ]
    if not items:
        print("bench/suite_cpu.py: no item was logged (was the plugin loaded?)", file=sys.stderr)
        return 1
    after = probe()
    print(f"probe after: python loop {after['python']:.2f} s, matmuls {after['matmul']:.2f} s of CPU")

    charges = charge(processes, items)
    counted = sum(c.cpu for c in charges.values())
    modules = sorted(charges.items(), key=lambda kv: -kv[1].cpu)
    rows, running = [], 0.0
    for name, c in modules[: args.top]:
        running += c.cpu
        top = ", ".join(f"{cmd} {s:.0f}" for cmd, s in c.commands.most_common(3))
        rows.append(
            [name, c.items, round(c.wall, 1), round(c.own, 1), round(c.children, 1), round(c.cpu, 1),
             f"{c.cpu / counted:.1%}", f"{running / counted:.0%}", top or "—"]
        )  # fmt: skip
    commands: Counter = Counter()
    for c in charges.values():
        commands.update(c.commands)
    extra = {
        "make test": f"{wall:.0f} s wall, {len(items)} items on {args.workers or 1} worker(s)",
        "CPU, counted by accounting": f"{counted:.0f} s (user + system) in {len(processes)} processes",
        "probe (CPU s, one thread)": f"before: python loop {before['python']:.2f}, matmuls "
        f"{before['matmul']:.2f}; after: {after['python']:.2f}, {after['matmul']:.2f}",
    }
    columns = ["module", "items", "wall s", "CPU s in the worker", "CPU s in its processes", "CPU s", "share",
               "cumulative", "top commands (CPU s)"]  # fmt: skip
    by_command = [[k, round(v, 1)] for k, v in commands.most_common(15)]
    tables = [
        Table(
            "CPU by test module, heaviest first",
            columns,
            rows,
            notes=[
                "A process is charged to the module its worker was running in the second it started; the "
                "workers' forkservers' children (the forked stacks) through their parent chain.",
            ],
        ),
        Table(
            "CPU by command",
            ["command", "CPU s"],
            by_command,
            notes=[
                "A command is the name the kernel records as a process exits, its last thread's: "
                "grpc_global_tim, event_engine, pt_gloo_runloop and the like are Python processes' threads.",
            ],
        ),
    ]
    path = write_results("suite_cpu", tables, extra, args.results, dirty_ok=args.dirty_ok)
    for name, c in modules[:15]:
        print(f"{c.cpu:8.1f} s  {name}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
