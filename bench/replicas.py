"""Benchmark: one evaluation round through the local stack with 1 worker replica against N.

    python bench/replicas.py [--replicas 1,2] [--repeats 2] [--questions 150] [--model DIR]
                             [--work DIR] [--results FILE] [--dirty-ok]

The CPU engine decodes on one thread (its default below 100M parameters), so on a machine with
several cores one engine leaves the others idle while episodes run. `bcstack up --replicas N`
starts N engine + worker pairs behind the one gateway, which sends each episode to the least busy
replica. This script measures what that buys on this machine: the same evaluation round (the toy
world's held-out questions, 16 episodes in flight, the speedrun's worker settings and budget)
with each replica count, the variants taking turns (1, 2, 2, 1, ...) so background load hits them
alike, a fresh stack and evaluation folder each run.

The workload is the untrained tiny model by default: it spends its whole budget on every episode
(8 turns of up to 192 new tokens, 2,867 tokens), so every run does the same work whatever it
samples. `--model DIR` evaluates another model folder (a trained worker ends episodes sooner and
its runs differ in length; then compare with several repeats).

Per run: wall seconds, episodes/s, generated tokens/s (from the engines' /metrics), and the
speed-up of each variant's median over one replica's. Results, with the command, commit and
machine, go to bench/results/replicas.md (--results); refused from a checkout with uncommitted changes
unless --dirty-ok (the report then says DIRTY).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from common import Table, print_machine, render_results, require_clean_tree, write_results  # noqa: E402

from bcstack.evaluation.loaders import load_questions  # noqa: E402
from bcstack.speedrun import OBSERVATION_SETTINGS  # noqa: E402
from bcstack.stack import base_name, down, up  # noqa: E402

BUDGET = {"max_tokens": 2867, "max_turns": 8}  # the speedrun's (1.25 x the longest expert trajectory)
CONCURRENCY = 16


def generated_tokens(info: dict) -> float:
    """Tokens the stack's engines have generated so far (their generation-token counters)."""
    total = 0.0
    for name, service in info["services"].items():
        if base_name(name) != "engine":
            continue
        text = httpx.get(service["http"] + "/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "bcstack_engine_generation_tokens_total":
                    total += sample.value
    return total


def one_run(
    work: Path, model: str, world: Path, kit: Path, index: Path, replicas: int, questions: list
) -> dict:
    from bcstack.evaluation.cli import run_with_progress

    state = Path(tempfile.mkdtemp(prefix=f"r{replicas}-", dir=work))
    info = up(
        state / "stack", worker=model, world=world, kit=kit, index=index,
        worker_settings=OBSERVATION_SETTINGS, replicas=replicas, say=lambda _s: None,
    )  # fmt: skip
    try:
        urls = {name: s["http"] for name, s in info["services"].items()}
        before = generated_tokens(info)
        started = time.perf_counter()
        tally = run_with_progress(
            questions, state / "eval", urls["coordinator"], urls["judge"], concurrency=CONCURRENCY,
            overrides={"max_branches": 1}, budget=BUDGET, label=f"{replicas} replica(s)",
        )  # fmt: skip
        seconds = time.perf_counter() - started
        tokens = generated_tokens(info) - before
    finally:
        down(state / "stack", say=lambda _s: None)
    return {"replicas": replicas, "seconds": seconds, "episodes": tally["total"], "tokens": tokens}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", default="1,2", help="replica counts to compare, comma-separated")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each replica count")
    parser.add_argument("--questions", type=int, default=150, help="held-out questions per run")
    parser.add_argument(
        "--model", default="tiny", help="the worker: tiny (untrained, the default) or a folder"
    )
    parser.add_argument("--work", type=Path, default=None, help="where the world, kit and index are built")
    parser.add_argument("--results", type=Path, default=None, help="results file (bench/results/replicas.md)")
    parser.add_argument("--dirty-ok", action="store_true", help="write the report from uncommitted changes")
    args = parser.parse_args()
    counts = [int(c) for c in args.replicas.split(",") if c.strip()]
    if not counts or min(counts) < 1 or args.repeats < 1:
        parser.error("--replicas takes counts >= 1 and --repeats must be at least 1")
    require_clean_tree("replicas", args.dirty_ok)  # before the run, not after it
    print("machine:")
    print_machine()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-replicas-"))
    work.mkdir(parents=True, exist_ok=True)
    # The toy world, tiny kit and lexical index a first `up` builds; every run then uses them as they are.
    assets = up(work / "assets", worker="expert", dense="none", say=print)["assets"]
    down(work / "assets", say=lambda _s: None)
    world, kit, index = (Path(assets[k]) for k in ("world", "tiny", "index"))
    model = str(kit) if args.model == "tiny" else args.model
    questions = load_questions(world / "questions.jsonl")[: args.questions]

    # Interleaved (1, 2, 2, 1, ...): drifting background load hits every variant alike.
    order = [c for r in range(args.repeats) for c in (counts if r % 2 == 0 else counts[::-1])]
    runs = [one_run(work, model, world, kit, index, c, questions) for c in order]
    for run in runs:
        print(f"  {run['replicas']} replica(s): {run['seconds']:.1f} s, {run['tokens']:.0f} generated tokens")

    base = statistics.median(r["seconds"] for r in runs if r["replicas"] == counts[0])
    rows = []
    for count in counts:
        mine = [r for r in runs if r["replicas"] == count]
        wall = statistics.median(r["seconds"] for r in mine)
        rows.append([
            count, len(mine), wall, [round(r["seconds"], 1) for r in mine], mine[0]["episodes"],
            statistics.median(r["episodes"] / r["seconds"] for r in mine),
            statistics.median(r["tokens"] / r["seconds"] for r in mine), base / wall,
        ])  # fmt: skip
    table = Table(
        title=f"One evaluation round, {len(questions)} questions, {CONCURRENCY} episodes in flight, {model}",
        columns=[
            "replicas",
            "runs",
            "wall s (median)",
            "wall s per run",
            "episodes",
            "episodes/s",
            "generated tokens/s",
            f"speed-up vs {counts[0]}",
        ],  # fmt: skip
        rows=rows,
        notes=[
            f"Worker budget {BUDGET['max_tokens']} tokens / {BUDGET['max_turns']} turns, the speedrun's "
            "observation settings; runs interleaved; generated tokens from the engines' "
            "bcstack_engine_generation_tokens_total.",
        ],
    )
    extra = {"cores usable": str(len(os.sched_getaffinity(0)))}
    print(render_results("replicas", [table], extra))
    print(f"results: {write_results('replicas', [table], extra, path=args.results, dirty_ok=args.dirty_ok)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
