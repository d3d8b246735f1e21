"""Benchmark: worker episodes per second and the worker's own overhead per turn.

    python bench/worker.py [--concurrency 1,32,256] [--duration 30] [--docs 2000] [--work DIR]
                           [--json FILE] [--results FILE] [--dirty-ok]

The scripted expert engine (`bcstack serve engine --policy expert`, near-zero model time) and the
embedded retrieval service (`bcstack serve retrieval` over a toy world) stand behind one worker
(`bcstack serve worker`); this script keeps N episodes in flight over gRPC for --duration
seconds per level, cycling through the toy world's test questions. It reports episodes/s,
turns/s, errors, and per turn (from the worker's /metrics, deltas per level): the whole turn,
the engine wait, and the worker's own overhead = turn time - engine wait - retrieval wait
(parsing, rendering the chat template, tokenizing, budget, protocol, the event loop), mean,
p50 and p99. All processes share this machine's cores.

Target (issue 4): overhead <= 5 ms per turn at 256 concurrent episodes, no errors.

The table, with the command, commit, machine and date, goes to bench/results/worker.md (--results),
the file the README's numbers come from; refused from a checkout with uncommitted changes unless
--dirty-ok (the report then says DIRTY).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from common import (  # noqa: E402
    RESULTS_DIR,
    Table,
    free_port,
    histogram,
    machine,
    print_machine,
    process,
    require_clean_tree,
    summary,
    write_results,
)

from core.v1 import common_pb2, worker_pb2, worker_pb2_grpc  # noqa: E402
from devkit.toyworld.policies import WORKER_TASK_TEMPLATE  # noqa: E402


async def drive(address: str, questions: list[str], concurrency: int, duration: float) -> dict:
    channel = grpc.aio.insecure_channel(address)
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    deadline = time.perf_counter() + duration
    done = turns = errors = 0
    reasons: dict[str, int] = {}
    counter = 0

    async def loop() -> None:
        nonlocal done, turns, errors, counter
        while time.perf_counter() < deadline:
            q = questions[counter % len(questions)]
            counter += 1
            request = worker_pb2.RunWorkerEpisodeRequest(
                branch=worker_pb2.BranchTask(
                    description="bench", prompt=WORKER_TASK_TEMPLATE.format(question=q)
                )
            )
            try:
                resp = await stub.RunEpisode(request, timeout=600)
            except grpc.aio.AioRpcError as e:
                errors += 1
                reasons[e.code().name] = reasons.get(e.code().name, 0) + 1
                continue
            done += 1
            turns += resp.usage.turns
            name = common_pb2.StopReason.Name(resp.report.stop_reason).removeprefix("STOP_REASON_").lower()
            reasons[name] = reasons.get(name, 0) + 1

    start = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    await channel.close()
    return {"episodes": done, "turns": turns, "errors": errors, "seconds": elapsed, "outcomes": reasons}


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--concurrency", default="1,32,256")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds per concurrency level")
    parser.add_argument("--docs", type=int, default=2000)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "bcstack-bench-worker")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--results", type=Path, default=RESULTS_DIR / "worker.md", help="the Markdown table")
    parser.add_argument("--dirty-ok", action="store_true", help="write the report from uncommitted changes")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    require_clean_tree("worker", args.dirty_ok)  # before the run, not after it
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    print("worker benchmark (scripted expert engine, embedded retrieval)")
    print_machine()
    world, tiny, index = work / "world", work / "tiny", work / "index"
    if not (world / "corpus.jsonl").exists():
        subprocess.run([sys.executable, "-m", "bcstack", "toyworld", "generate", "--out", str(world),
                        "--docs", str(args.docs)], check=True)  # fmt: skip
    if not (tiny / "tokenizer.json").exists():
        subprocess.run([sys.executable, "-m", "bcstack", "model", "tiny", "--out", str(tiny)], check=True)
    subprocess.run([sys.executable, "-m", "bcstack", "index", "--corpus", str(world / "corpus.jsonl"),
                    "--index-dir", str(index)], check=True)  # fmt: skip
    questions = [json.loads(line)["query"] for line in (world / "questions.jsonl").read_text().splitlines()]
    p = {k: free_port() for k in ("r_http", "r_grpc", "e_http", "w_http", "w_grpc")}
    config = work / "worker.yaml"
    config.write_text(f"max_concurrent_episodes: {max(levels)}\nlog_level: WARNING\n")
    rows = []
    retrieval = ["serve", "retrieval", "--index-dir", str(index)]
    retrieval += ["--port", str(p["r_http"]), "--grpc-port", str(p["r_grpc"])]
    engine = ["serve", "engine", "--policy", "expert", "--tokenizer", str(tiny), "--port", str(p["e_http"])]
    worker = ["serve", "worker", "--tokenizer", str(tiny), "--engine-url", f"http://127.0.0.1:{p['e_http']}"]
    worker += ["--retrieval-address", f"127.0.0.1:{p['r_grpc']}", "--config", str(config)]
    worker += ["--port", str(p["w_http"]), "--grpc-port", str(p["w_grpc"])]
    health = "http://127.0.0.1:{}/health".format
    with (
        process(retrieval, health(p["r_http"]), work / "retrieval.log"),
        process(engine, health(p["e_http"]), work / "engine.log"),
        process(worker, health(p["w_http"]), work / "worker.log"),
    ):
        w = f"http://127.0.0.1:{p['w_http']}"
        asyncio.run(drive(f"127.0.0.1:{p['w_grpc']}", questions, 4, 3.0))  # warm up
        for c in levels:
            names = ("bcstack_worker_turn_overhead_seconds", "bcstack_worker_engine_request_duration_seconds")
            before = {n: histogram(w, n) for n in names}
            run = asyncio.run(drive(f"127.0.0.1:{p['w_grpc']}", questions, c, args.duration))
            after = {n: histogram(w, n) for n in names}
            run["overhead"] = summary(before[names[0]], after[names[0]])
            run["engine"] = summary(before[names[1]], after[names[1]])
            run["concurrency"] = c
            rows.append(run)
            print(f"  c={c}: {run['episodes'] / run['seconds']:.1f} episodes/s", flush=True)

    print(
        f"\n{'conc':>5} {'episodes/s':>11} {'turns/s':>8} {'errors':>6} "
        f"{'overhead mean/p50/p99 ms':>26} {'engine p50 ms':>14}  outcomes"
    )
    for r in rows:
        o = r["overhead"]
        print(
            f"{r['concurrency']:>5} {r['episodes'] / r['seconds']:>11.1f} {r['turns'] / r['seconds']:>8.1f} "
            f"{r['errors']:>6} {o['mean_ms']:>10.2f}/{o['p50_ms']:>6.2f}/{o['p99_ms']:>7.2f} "
            f"{r['engine']['p50_ms']:>14.2f}  {r['outcomes']}"
        )
    last = rows[-1]
    ok = last["overhead"]["mean_ms"] <= 5 and last["errors"] == 0
    print(
        f"\noverhead per turn at {last['concurrency']} concurrent episodes: "
        f"mean {last['overhead']['mean_ms']:.2f} ms (target <= 5 ms, no errors): {'met' if ok else 'NOT met'}"
    )
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "rows": rows}, indent=2))
    table = Table(
        f"Worker episodes, {args.duration:g} s per level, {args.docs} toy documents",
        [
            "concurrent episodes",
            "episodes",
            "turns",
            "seconds",
            "episodes/s",
            "turns/s",
            "errors",
            "overhead mean ms",
            "overhead p50 ms",
            "overhead p99 ms",
            "engine wait p50 ms",
            "outcomes",
        ],
        [
            [
                r["concurrency"],
                r["episodes"],
                r["turns"],
                r["seconds"],
                r["episodes"] / r["seconds"],
                r["turns"] / r["seconds"],
                r["errors"],
                r["overhead"]["mean_ms"],
                r["overhead"]["p50_ms"],
                r["overhead"]["p99_ms"],
                r["engine"]["p50_ms"],
                json.dumps(r["outcomes"]),
            ]
            for r in rows
        ],
        [
            f"Target: overhead <= 5 ms per turn at {last['concurrency']} concurrent episodes, no errors: "
            f"{'met' if ok else 'NOT met'}."
        ],
    )
    print(f"results: {write_results('worker', [table], path=args.results, dirty_ok=args.dirty_ok)}")


if __name__ == "__main__":
    main()
