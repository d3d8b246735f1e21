"""Benchmark: the RL loop synchronous (`--max-policy-lag 0`) against asynchronous (lag 1 and 2).

    python bench/rl.py [--updates 6] [--lags 0,1,2] [--groups 2] [--group-size 4] [--work DIR]
                       [--results FILE] [--dirty-ok]

The two-core stand-in for disaggregated inference and training GPUs: the rollout side (engine,
worker, retrieval, gateway, coordinator LLM, judge: a `bcstack up` stack with the untrained tiny
model) is pinned to CPU 0 and the trainer (`bcstack train rl`) to CPU 1, each process with one
torch thread. Synchronous RL leaves each side idle while the other works; with a staleness bound
the rollouts for the next updates run while an update trains. The same stack serves every lag,
one after the other, each from the tiny model again (a fresh --out).

Per lag: updates per hour (over the updates after the first, from the metrics lines' times),
each side's idle fraction (the trainer waiting for groups; no rollout in flight), the policy lag
of the trained groups (histogram), and the ratio against lag 0. Writes bench/results/rl.md
(--results), with the command, commit, machine and date; refused from a checkout with uncommitted
changes unless --dirty-ok (the report then says DIRTY).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from common import Table, print_machine, require_clean_tree, write_results  # noqa: E402

ROLLOUT_CPU, TRAINER_CPU = 0, 1


def pin_tree(pid: int, cpu: int) -> None:
    """Pin a process and every descendant to one CPU."""
    pids = [pid]
    while pids:
        current = pids.pop()
        try:
            os.sched_setaffinity(current, {cpu})
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue
        pids.extend(int(c) for c in children)


def run_lag(state: Path, work: Path, lag: int, args: argparse.Namespace) -> dict:
    out = state / "train" / f"bench-lag{lag}-{int(time.time())}"
    command = [
        sys.executable, "-m", "bcstack", "train", "rl", "--state", str(state),
        "--questions", str(state / "world" / "train.jsonl"), "--model", str(state / "tiny"),
        "--ref", str(state / "tiny"), "--out", str(out), "--updates", str(args.updates),
        "--groups", str(args.groups), "--group-size", str(args.group_size),
        "--max-policy-lag", str(lag), "--worker-max-tokens", str(args.worker_max_tokens),
        "--worker-max-turns", "2", "--max-branches", "1",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.time()
    with (work / f"lag{lag}.log").open("w") as log:
        done = subprocess.run(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=args.timeout,
            preexec_fn=lambda: os.sched_setaffinity(0, {TRAINER_CPU}),
        )  # fmt: skip
    wall = time.time() - started
    if done.returncode != 0:
        raise SystemExit(
            f"lag {lag}: bcstack train rl exited {done.returncode}; see {work / f'lag{lag}.log'}"
        )
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    span = metrics[-1]["time"] - metrics[0]["time"]
    steady = metrics[1:]  # the first update also waits for the first rollouts: leave it out
    lags: Counter[str] = Counter()
    for m in steady:
        lags.update({k: int(v) for k, v in m["policy_lag_hist"].items()})
    return {
        "lag": lag,
        "updates": len(metrics),
        "wall_s": wall,
        "span_s": span,
        "updates_per_hour": 3600 * len(steady) / span if span > 0 else float("nan"),
        "trainer_idle": sum(m["trainer_idle_seconds"] for m in steady) / span if span > 0 else float("nan"),
        "rollout_idle": sum(m["rollout_idle_seconds"] for m in steady) / span if span > 0 else float("nan"),
        "train_s_mean": sum(m["train_seconds"] for m in steady) / len(steady),
        "dropped_stale": sum(m["dropped_stale"] for m in metrics),
        "lag_hist": dict(sorted(lags.items())),
        "lag_mean": sum(int(k) * v for k, v in lags.items()) / max(sum(lags.values()), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--updates", type=int, default=6)
    parser.add_argument("--lags", default="0,1,2")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--worker-max-tokens", type=int, default=640)
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "bcstack-bench-rl")
    parser.add_argument("--results", type=Path, default=None)
    parser.add_argument("--dirty-ok", action="store_true", help="write the report from uncommitted changes")
    args = parser.parse_args()
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("this benchmark pins the two sides to two CPUs; this machine has one")
    require_clean_tree("rl", args.dirty_ok)  # before the run, not after it
    from bcstack.stack import down, up

    print("RL loop benchmark: synchronous vs asynchronous, rollouts on CPU 0, trainer on CPU 1")
    print_machine()
    args.work.mkdir(parents=True, exist_ok=True)
    state = args.work / "stack"
    os.environ["OMP_NUM_THREADS"] = "1"  # every stack process: one torch thread on its one core
    info = up(state, worker="tiny", docs=1000, questions_per_tier=3, train_questions=(30, 20), say=print)
    rows = []
    try:
        for service in info["services"].values():
            pin_tree(service["pid"], ROLLOUT_CPU)
        for lag in (int(x) for x in args.lags.split(",")):
            row = run_lag(state, args.work, lag, args)
            rows.append(row)
            print(
                f"  lag {lag}: {row['updates_per_hour']:.0f} updates/h, "
                f"trainer idle {row['trainer_idle']:.0%}, rollouts idle {row['rollout_idle']:.0%}, "
                f"lag histogram {row['lag_hist']}",
                flush=True,
            )
    finally:
        down(state, say=lambda _m: None)
    base = next((r["updates_per_hour"] for r in rows if r["lag"] == 0), float("nan"))
    table = Table(
        f"RL loop, {args.updates} updates of {args.groups} groups x {args.group_size} episodes, tiny model",
        [
            "max policy lag", "updates/h", "÷ lag 0", "trainer idle", "rollout side idle",
            "train s per update", "stale dropped", "policy lag histogram (groups)", "mean lag", "wall s",
        ],
        [
            [
                r["lag"], r["updates_per_hour"], r["updates_per_hour"] / base, r["trainer_idle"],
                r["rollout_idle"], r["train_s_mean"], r["dropped_stale"], json.dumps(r["lag_hist"]),
                r["lag_mean"], r["wall_s"],
            ]
            for r in rows
        ],
        [
            "Updates/h over the updates after the first (the first also waits for the first rollouts). "
            "Idle fractions over the same span: the trainer waiting for graded groups, and no rollout "
            "in flight on the rollout side.",
        ],
    )  # fmt: skip
    print(f"results: {write_results('rl', [table], path=args.results, dirty_ok=args.dirty_ok)}")


if __name__ == "__main__":
    main()
