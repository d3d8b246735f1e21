"""Shared by the benchmarks: the machine a report ran on, the results file, service processes,
histogram deltas."""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, str]:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kb = int(next(line.split()[1] for line in f if line.startswith("MemTotal")))
            mem = f"{kb / 2**20:.1f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    head, changed = git_state()
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "memory": mem,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "commit": head[:7] or "unknown",
        "worktree": "uncommitted changes" if changed.strip() else "clean",
    }


def git_state() -> tuple[str, str]:
    """`git rev-parse HEAD` and `git status --porcelain` of this checkout ("" each outside git)."""
    git = ["git", "-C", str(Path(__file__).resolve().parents[1])]
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    changed = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True).stdout
    return head, changed.rstrip("\n")


def print_machine() -> None:
    for key, value in machine().items():
        print(f"  {key:9s} {value}")
    head, changed = git_state()
    print(f"  {'head':9s} {head or 'unknown'}")
    for line in changed.splitlines():
        print(f"  {'changed':9s} {line}")


class DirtyTree(SystemExit):
    """A results file refused: the checkout has uncommitted changes and --dirty-ok was not given.
    Exits 2, after `require_clean_tree` has said why in one line on stderr (no traceback)."""


def dirty_tree_line(bench: str, changed: str) -> str:
    """The one line a refusal prints: the bench, how many paths changed, the first of them."""
    paths = changed.splitlines()
    first = paths[0].strip() if paths else ""
    return (
        f"bench/{bench}.py: refused: {len(paths)} uncommitted change(s) in the checkout (first: {first}); "
        "commit them, or pass --dirty-ok to write a report stamped DIRTY"
    )


def require_clean_tree(bench: str, dirty_ok: bool) -> None:
    """`DirtyTree` (exit 2) unless the checkout is clean or `dirty_ok`; a bench calls it before it
    runs too, so that a long run does not end in a refusal."""
    changed = git_state()[1]
    if changed.strip() and not dirty_ok:
        print(dirty_tree_line(bench, changed), file=sys.stderr, flush=True)
        raise DirtyTree(2)


@dataclass(frozen=True)
class Table:
    """One table of a results file: raw values, one row per measurement, in ``columns`` order."""

    title: str
    columns: Sequence[str]
    rows: Sequence[Sequence[Any]]
    notes: Sequence[str] = field(default_factory=tuple)


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.6g}"  # raw: six significant digits, no thousands separators
    if isinstance(value, list | tuple):
        return ", ".join(_cell(v) for v in value)
    return str(value).replace("|", "\\|")


def render_results(bench: str, tables: Sequence[Table], extra: dict[str, str] | None = None) -> str:
    """The Markdown a results file holds: how and where the numbers were made, then the tables."""
    m = machine()
    head, changed = git_state()
    command = shlex.join(["python", *sys.argv])
    dirty = "" if m["worktree"] == "clean" else " (DIRTY: with uncommitted changes, listed below)"
    lines = [
        f"<!-- Written by bench/{bench}.py; run it again to replace this file. -->",
        f"# {bench} benchmark results",
        "",
        f"- command: `{command}`",
        f"- commit: {head or m['commit']}{dirty}",
        *(f"  - `{line}`" for line in changed.splitlines()),
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['memory']}; {m['platform']}; Python {m['python']}",
        f"- date: {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        *(f"- {key}: {value}" for key, value in (extra or {}).items()),
    ]
    for table in tables:
        lines += ["", f"## {table.title}", ""]
        lines.append("| " + " | ".join(table.columns) + " |")
        lines.append("|" + "---|" * len(table.columns))
        for row in table.rows:
            if len(row) != len(table.columns):
                raise ValueError(f"{table.title}: {len(row)} values for {len(table.columns)} columns")
            lines.append("| " + " | ".join(_cell(v) for v in row) + " |")
        if table.notes:
            lines += ["", *table.notes]
    return "\n".join(lines) + "\n"


def write_results(
    bench: str,
    tables: Sequence[Table],
    extra: dict[str, str] | None = None,
    path: Path | None = None,
    *,
    dirty_ok: bool,
) -> Path:
    """Write ``render_results`` to ``path`` (default bench/results/<bench>.md), the file the README's
    tables for this benchmark are taken from; returns the path written.

    ``dirty_ok`` is the bench's ``--dirty-ok`` flag, a required keyword so that no bench forgets it:
    from a checkout with uncommitted changes the file is refused (`DirtyTree`, exit 2, one line on
    stderr) unless it is true, so that a committed report names the commit that made it; with it,
    the report says DIRTY and lists the changes. A bench also calls `require_clean_tree` before its
    run, so that a long run does not end in a refusal."""
    require_clean_tree(bench, dirty_ok)
    path = path or RESULTS_DIR / f"{bench}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_results(bench, tables, extra), encoding="utf-8")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def process(args: list[str], health: str, log: Path):
    out = log.open("w")
    proc = subprocess.Popen([sys.executable, "-m", "bcstack", *args], stdout=out, stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            if proc.poll() is not None:
                raise SystemExit(f"{args[:2]} exited; see {log}")
            try:
                if httpx.get(health, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        out.close()


def histogram(
    url: str, name: str, labels: dict[str, str] | None = None
) -> tuple[list[tuple[float, float]], float, float]:
    """Buckets, sum and count of one histogram series (the one whose labels include ``labels``)."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets, total, count = [], 0.0, 0.0
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if labels and any(s.labels.get(k) != v for k, v in labels.items()):
                continue
            if s.name == name + "_bucket":
                buckets.append((float(s.labels["le"]), s.value))
            elif s.name == name + "_sum":
                total = s.value
            elif s.name == name + "_count":
                count = s.value
    return sorted(buckets), total, count


def summary(before, after) -> dict:
    """Mean and interpolated p50/p99 (ms) of a histogram between two scrapes."""
    (b0, s0, c0), (b1, s1, c1) = before, after
    n = c1 - c0
    if n <= 0:
        return {"n": 0, "mean_ms": float("nan"), "p50_ms": float("nan"), "p99_ms": float("nan")}
    delta = [(le, a - b) for (le, a), (_, b) in zip(b1, b0, strict=True)]

    def q(x: float) -> float:
        lo_le, lo_n = 0.0, 0.0
        for le, cum in delta:
            if cum >= x * n:
                if le == float("inf"):
                    return lo_le * 1e3
                return (lo_le + (le - lo_le) * (x * n - lo_n) / max(cum - lo_n, 1e-12)) * 1e3
            lo_le, lo_n = le, cum
        return float("inf")

    return {"n": int(n), "mean_ms": (s1 - s0) / n * 1e3, "p50_ms": q(0.5), "p99_ms": q(0.99)}
