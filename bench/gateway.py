"""Benchmark: coordinator-gateway episodes per second and the gateway's own overhead per turn.

    python bench/gateway.py [--concurrency 1,64,512] [--duration 20] [--work DIR]

Behind the gateway (`bcstack serve coordinator`) stand an instant coordinator and instant
workers: the scripted coordinator LLM (`bcstack serve coordinator-llm`, no model: it branches
the question to one worker, then finishes with the worker's answer) and a stub worker service in
a child process of this script (a real gRPC WorkerService that answers every branch at once with
a canned finished report). This script keeps N episodes in flight over HTTP for --duration
seconds per level. It reports episodes/s, turns/s, errors, statuses, the client-side episode
latency, and per coordinator turn (from the gateway's /metrics, deltas per level) the gateway's
own compute = turn time - coordinator LLM wait - worker wait (parsing, validation, dispatch,
observations), mean and p99; and the gateway process's whole CPU time per turn (its HTTP
server and client, gRPC, JSON, records, the event loop: everything it spends, per turn served),
beside the CPU time of the other processes. Time lost between the processes (HTTP client, transport, the
gateway's event loop picking up a finished call) shows as the gap between an LLM call as the
gateway timed it and the same calls as the LLM server timed them. The durable record write
(SQLite, fsync) is per episode and reported apart. All processes share this machine's cores.

Target (issue 5): overhead <= 5 ms per turn and no errors at 512 concurrent episodes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from common import free_port, histogram, machine, print_machine, process, summary  # noqa: E402


def stub_worker(port: int) -> None:
    """A WorkerService that finishes every branch at once (run in a child process)."""
    import grpc

    from core import protocol as p
    from core.v1 import common_pb2, worker_pb2, worker_pb2_grpc

    class Instant(worker_pb2_grpc.WorkerServiceServicer):
        async def RunEpisode(self, request, context):  # noqa: N802
            text = p.render_worker_report(
                p.WorkerReportText(request.branch.description, "finish", "Tartu", "[d1] says so", "90%")
            )
            return worker_pb2.RunWorkerEpisodeResponse(
                episode_id=request.episode_id,
                report=common_pb2.WorkerReport(
                    answer="Tartu",
                    explanation="[d1] says so",
                    confidence="90%",
                    stop_reason=common_pb2.STOP_REASON_FINISH,
                    raw_text=text,
                    episode_id=request.episode_id,
                ),
                trajectory=worker_pb2.Trajectory(
                    token_ids=list(range(64)),
                    loss_mask=[0] * 48 + [1] * 16,
                    rollout_logprobs=[-0.1] * 16,
                    turns=[
                        worker_pb2.Turn(
                            prompt_start=0,
                            gen_start=48,
                            gen_end=64,
                            generated_tokens=16,
                            weight_version="stub",
                            finish_reason="stop",
                        )
                    ],
                    stop_reason=common_pb2.STOP_REASON_FINISH,
                    tokens_used=64,
                    turns_used=1,
                ),
                usage=common_pb2.Usage(prompt_tokens=48, completion_tokens=16, total_tokens=64, turns=1),
            )

    async def serve() -> None:
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(Instant(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(url: str, concurrency: int, duration: float) -> dict:
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    deadline = time.perf_counter() + duration
    done = turns = errors = 0
    statuses: dict[str, int] = {}
    latencies: list[float] = []
    counter = 0
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:

        async def loop() -> None:
            nonlocal done, turns, errors, counter
            while time.perf_counter() < deadline:
                counter += 1
                body = {"question": f"Where was the laureate of prize {counter} born?"}
                t0 = time.perf_counter()
                try:
                    r = await client.post("/v1/episodes", json=body)
                except httpx.HTTPError as e:
                    errors += 1
                    statuses[type(e).__name__] = statuses.get(type(e).__name__, 0) + 1
                    continue
                if r.status_code != 200:
                    errors += 1
                    statuses[f"http{r.status_code}"] = statuses.get(f"http{r.status_code}", 0) + 1
                    continue
                latencies.append(time.perf_counter() - t0)
                data = r.json()
                statuses[data["status"]] = statuses.get(data["status"], 0) + 1
                if data["status"] != "finish":
                    errors += 1
                done += 1
                turns += data["usage"]["turns"]

        start = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    latencies.sort()

    def pct(q: float) -> float:
        return (
            latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1e3 if latencies else float("nan")
        )

    return {
        "episodes": done,
        "turns": turns,
        "errors": errors,
        "seconds": elapsed,
        "statuses": statuses,
        "latency_p50_ms": pct(0.5),
        "latency_p99_ms": pct(0.99),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", default="1,64,512", help="levels of episodes in flight")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per level")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "bcstack-bench-gateway")
    parser.add_argument("--json", type=Path, help="also write the raw numbers here")
    args = parser.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    args.work.mkdir(parents=True, exist_ok=True)
    records = args.work / "records.sqlite"
    records.unlink(missing_ok=True)
    for suffix in ("-wal", "-shm"):
        Path(str(records) + suffix).unlink(missing_ok=True)

    print("gateway benchmark")
    print_machine()
    ports = {k: free_port() for k in ("llm", "worker", "g_http", "g_grpc")}
    stub = multiprocessing.get_context("spawn").Process(
        target=stub_worker, args=(ports["worker"],), daemon=True
    )
    stub.start()
    config = {
        "endpoints": [
            {
                "name": "scripted",
                "base_url": f"http://127.0.0.1:{ports['llm']}/v1",
                "model": "scripted-coordinator",
            }
        ],
        "workers": [f"127.0.0.1:{ports['worker']}"],
        "records_path": str(records),
        "max_concurrent_episodes": max(levels),
        "log_level": "WARNING",
    }
    (args.work / "gateway.yaml").write_text(yaml.safe_dump(config))
    gateway_url = f"http://127.0.0.1:{ports['g_http']}"
    results = []
    try:
        with (
            process(
                ["serve", "coordinator-llm", "--port", str(ports["llm"])],
                f"http://127.0.0.1:{ports['llm']}/health",
                args.work / "llm.log",
            ) as llm_proc,
            process(
                [
                    "serve",
                    "coordinator",
                    "--config",
                    str(args.work / "gateway.yaml"),
                    "--port",
                    str(ports["g_http"]),
                    "--grpc-port",
                    str(ports["g_grpc"]),
                ],
                gateway_url + "/health",
                args.work / "gateway.log",
            ) as gateway_proc,
        ):
            asyncio.run(drive(gateway_url, 4, 2.0))  # warm-up: connections, first records
            llm_url = f"http://127.0.0.1:{ports['llm']}"
            series = {
                "overhead": (gateway_url, "bcstack_coordinator_turn_overhead_seconds", None),
                "record_write": (gateway_url, "bcstack_coordinator_record_write_duration_seconds", None),
                "llm_call_gateway": (
                    gateway_url,
                    "bcstack_coordinator_upstream_request_duration_seconds",
                    {"outcome": "ok"},
                ),
                "llm_call_server": (llm_url, "bcstack_coordinator_llm_request_duration_seconds", None),
            }
            pids = {
                "gateway": gateway_proc.pid,
                "llm": llm_proc.pid,
                "worker": stub.pid,
                "client": os.getpid(),
            }
            for level in levels:
                before = {k: histogram(*v) for k, v in series.items()}
                cpu0 = {k: cpu_seconds(pid) for k, pid in pids.items()}
                run = asyncio.run(drive(gateway_url, level, args.duration))
                cpu1 = {k: cpu_seconds(pid) for k, pid in pids.items()}
                after = {k: histogram(*v) for k, v in series.items()}
                run["concurrency"] = level
                run["cpu_seconds"] = {k: cpu1[k] - cpu0[k] for k in pids}
                for key in series:
                    run[key] = summary(before[key], after[key])
                results.append(run)
                print(
                    f"  c={level}: {run['episodes'] / run['seconds']:.1f} episodes/s, "
                    f"{run['errors']} errors, overhead mean {run['overhead']['mean_ms']:.2f} ms",
                    flush=True,
                )
    finally:
        stub.terminate()

    base = results[0]["episodes"] / results[0]["seconds"] if results else float("nan")
    print()
    print(
        "| concurrent episodes | episodes/s | vs 1 | turns/s | errors | statuses | episode p50 / p99 ms "
        "| gateway compute per turn mean / p99 ms | gateway CPU ms per turn "
        "| LLM call mean ms: gateway view / server view | record write p50 / p99 ms "
        "| CPU s: gateway / LLM / worker / client |"
    )
    print("|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|")
    for r in results:
        eps = r["episodes"] / r["seconds"]
        o, w = r["overhead"], r["record_write"]
        g, v, c = r["llm_call_gateway"], r["llm_call_server"], r["cpu_seconds"]
        print(
            f"| {r['concurrency']} | {eps:.1f} | {eps / base:.2f} | {r['turns'] / r['seconds']:.1f} "
            f"| {r['errors']} | {', '.join(f'{k} {v}' for k, v in sorted(r['statuses'].items()))} "
            f"| {r['latency_p50_ms']:.1f} / {r['latency_p99_ms']:.1f} "
            f"| {o['mean_ms']:.3f} / {o['p99_ms']:.3f} "
            f"| {c['gateway'] * 1e3 / max(r['turns'], 1):.2f} "
            f"| {g['mean_ms']:.2f} / {v['mean_ms']:.2f} "
            f"| {w['p50_ms']:.2f} / {w['p99_ms']:.2f} "
            f"| {' / '.join(f'{c[k]:.1f}' for k in ('gateway', 'llm', 'worker', 'client'))} |"
        )
    top = results[-1] if results else None
    if top is not None:
        met = top["overhead"]["mean_ms"] <= 5.0 and top["errors"] == 0
        print(
            f"\ntarget at {top['concurrency']} concurrent episodes: overhead <= 5 ms per turn and no "
            f"errors: {'met' if met else 'NOT met'} (mean {top['overhead']['mean_ms']:.2f} ms, "
            f"{top['errors']} errors)"
        )
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
