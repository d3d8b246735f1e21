"""Benchmark: coordinator-gateway episodes per second and the gateway's whole CPU per coordinator turn,
for gateway variants side by side in one run.

    python bench/gateway.py [--concurrency 1,64,512] [--duration 20] [--variants httpx,aiohttp]
                            [--work DIR] [--json FILE] [--results FILE] [--dirty-ok]

Behind the gateway (`bcstack serve coordinator`) stand an instant coordinator and instant
workers: the scripted coordinator LLM (`bcstack serve coordinator-llm`, no model: it branches
the question to one worker, then finishes with the worker's answer) and a stub worker service in
a child process of this script (a real gRPC WorkerService that answers every branch at once with
a canned finished report). One gateway process runs per variant (`VARIANTS`: the same settings
but one), all behind the same LLM and worker; at each concurrency level this script drives each
variant in turn (the order alternating from level to level), keeping N episodes in flight over
HTTP for --duration seconds after a short unmeasured warm-up at that level.

The headline is the gateway process's whole CPU time (user + system, all threads, from
/proc/<pid>/stat) per coordinator turn served: its HTTP server and client, gRPC, JSON, records,
the event loop, everything. It is compared with the first variant's at the same level (a ratio).
Beside it: episodes/s, errors, the client-side episode latency (raw samples), the CPU time of the
other processes, and from a sample of the stored records (`GET /v1/episodes/{id}`, after the
level) the gateway's compute inside each turn = turn time - LLM wait - worker wait, percentiles
of raw per-turn samples. The LLM call as the gateway timed it against the same calls as the LLM
server timed them (means, from the two /metrics) shows the time lost between the processes and
in the gateway's event loop. The durable record write (SQLite, fsync) is per episode.
All processes share this machine's cores.

Target (issues 5 and 13): gateway CPU <= 5 ms per coordinator turn and no errors at 512 concurrent
episodes. The tables, with the command, commit, machine and date, go to bench/results/gateway.md
(--results), the file the README's numbers come from; refused from a checkout with uncommitted
changes unless --dirty-ok (the report then says DIRTY).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
import yaml

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
    render_results,
    require_clean_tree,
    write_results,
)

from devkit.stubworker import gateway_config, stub_worker  # noqa: E402

# Gateway settings per variant, on top of the common ones; the first listed is the baseline.
VARIANTS: dict[str, dict] = {
    "httpx": {"upstream_http_client": "httpx"},
    "aiohttp": {"upstream_http_client": "aiohttp"},
}
TARGET_CONCURRENCY = 512
TARGET_CPU_MS_PER_TURN = 5.0
RECORDS_SAMPLED = 400  # stored records read back per level and variant for the per-turn samples


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far, all its threads (Linux /proc), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentiles_ms(samples: list[float]) -> dict:
    """n, mean, p50, p99 in ms of raw samples in seconds (linear interpolation between samples)."""
    if not samples:
        return {"n": 0, "mean_ms": float("nan"), "p50_ms": float("nan"), "p99_ms": float("nan")}
    a = np.asarray(samples) * 1e3
    return {
        "n": len(samples),
        "mean_ms": float(a.mean()),
        "p50_ms": float(np.percentile(a, 50)),
        "p99_ms": float(np.percentile(a, 99)),
    }


def histogram_mean_ms(before, after) -> dict:
    """Count and exact mean (sum / count) of a histogram between two scrapes; no bucket is read."""
    (_, s0, c0), (_, s1, c1) = before, after
    n = c1 - c0
    return {"n": int(n), "mean_ms": (s1 - s0) / n * 1e3 if n > 0 else float("nan")}


async def drive(
    url: str, concurrency: int, duration: float, *, named: bool = False, rate: float | None = None
) -> dict:
    """Post episodes for `duration` seconds (aiohttp: a cheap load generator). Closed loop by default:
    `concurrency` clients, each posting its next episode when the last one returns, so the load is
    whatever the machine serves. With `rate` (episodes per second), open loop: episodes arrive at
    that mean rate (Poisson, seeded) whether or not earlier ones have returned, at most
    `concurrency` in flight (an arrival beyond that is counted in `refused`, not sent), so every
    variant is offered the same work and a busy gateway does not slow its own load down. `named`:
    each body names its episode id, as the apps do (the gateway then claims it)."""
    if rate is not None and not rate > 0:
        raise ValueError(f"rate must be a positive number of episodes per second, not {rate!r}")
    run_id = f"{random.randrange(16**8):08x}"
    connector = aiohttp.TCPConnector(limit=concurrency + 8)
    deadline = time.perf_counter() + duration
    done = turns = errors = refused = 0
    statuses: dict[str, int] = {}
    latencies: list[float] = []
    episode_ids: list[str] = []
    counter = 0
    async with aiohttp.ClientSession(
        url, connector=connector, timeout=aiohttp.ClientTimeout(total=600)
    ) as client:

        async def one() -> None:
            nonlocal done, turns, errors, counter
            counter += 1
            body = {"question": f"Where was the laureate of prize {counter} born?"}
            if named:
                body["episode_id"] = f"{run_id}-{counter}"
            t0 = time.perf_counter()
            try:
                async with client.post("/v1/episodes", json=body) as r:
                    status = r.status
                    data = await r.json() if status == 200 else None
            except (aiohttp.ClientError, TimeoutError) as e:
                errors += 1
                statuses[type(e).__name__] = statuses.get(type(e).__name__, 0) + 1
                return
            if data is None:
                errors += 1
                statuses[f"http{status}"] = statuses.get(f"http{status}", 0) + 1
                return
            latencies.append(time.perf_counter() - t0)
            statuses[data["status"]] = statuses.get(data["status"], 0) + 1
            if data["status"] != "finish":
                errors += 1
            done += 1
            turns += data["usage"]["turns"]
            episode_ids.append(data["episode_id"])

        async def loop() -> None:
            while time.perf_counter() < deadline:
                await one()

        async def arrivals() -> None:
            nonlocal refused
            rng = random.Random(0)
            in_flight: set[asyncio.Task] = set()
            due = time.perf_counter()
            while True:
                due += rng.expovariate(rate)
                if due >= deadline:
                    break
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                if len(in_flight) >= concurrency:
                    refused += 1
                    continue
                task = asyncio.create_task(one())
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
            await asyncio.gather(*in_flight)

        start = time.perf_counter()
        if rate is None:
            await asyncio.gather(*(loop() for _ in range(concurrency)))
        else:
            await arrivals()
        elapsed = time.perf_counter() - start
    return {
        "episodes": done,
        "turns": turns,
        "errors": errors,
        "refused": refused,
        "seconds": elapsed,
        "statuses": statuses,
        "latency": percentiles_ms(latencies),
        "episode_ids": episode_ids,
    }


async def turn_samples(url: str, episode_ids: list[str], limit: int) -> dict[str, list[float]]:
    """Per coordinator turn of a random sample of stored records: the gateway's own compute
    (turn - LLM wait - worker wait) and the LLM wait as the gateway timed it, in seconds."""
    chosen = random.Random(0).sample(episode_ids, min(limit, len(episode_ids)))
    compute: list[float] = []
    llm: list[float] = []
    gate = asyncio.Semaphore(8)
    async with aiohttp.ClientSession(url) as client:

        async def one(episode_id: str) -> None:
            async with gate, client.get(f"/v1/episodes/{episode_id}") as r:
                record = await r.json()
            for t in record["coordinator"]["turns"]:
                if t["total_seconds"] > 0:
                    compute.append(max(0.0, t["total_seconds"] - t["seconds"] - t["workers_seconds"]))
                    llm.append(t["seconds"])

        await asyncio.gather(*(one(i) for i in chosen))
    return {"compute": compute, "llm": llm}


def measure(gateway: dict, llm_url: str, pids: dict[str, int], level: int, duration: float) -> dict:
    """One variant at one level: warm-up, then the measured window, then the record sample."""
    url = gateway["url"]
    asyncio.run(drive(url, level, min(2.0, duration / 5)))  # connections up, pools grown
    series = {
        "record_write": (url, "bcstack_coordinator_record_write_duration_seconds", None),
        "llm_call_gateway": (url, "bcstack_coordinator_upstream_request_duration_seconds", {"outcome": "ok"}),
        "llm_call_server": (llm_url, "bcstack_coordinator_llm_request_duration_seconds", None),
    }
    procs = {"gateway": gateway["pid"], **pids}
    before = {k: histogram(*v) for k, v in series.items()}
    cpu0 = {k: cpu_seconds(pid) for k, pid in procs.items()}
    run = asyncio.run(drive(url, level, duration))
    cpu1 = {k: cpu_seconds(pid) for k, pid in procs.items()}
    after = {k: histogram(*v) for k, v in series.items()}
    run["cpu_seconds"] = {k: cpu1[k] - cpu0[k] for k in procs}
    run["gateway_cpu_ms_per_turn"] = run["cpu_seconds"]["gateway"] * 1e3 / max(run["turns"], 1)
    for key in series:
        run[key] = histogram_mean_ms(before[key], after[key])
    samples = asyncio.run(turn_samples(url, run.pop("episode_ids"), RECORDS_SAMPLED))
    run["turn_compute"] = percentiles_ms(samples["compute"])
    run["turn_llm_wait"] = percentiles_ms(samples["llm"])
    return run


def tables(results: list[dict], variants: list[str], duration: float) -> list[Table]:
    base = {r["concurrency"]: r for r in results if r["variant"] == variants[0]}
    verdicts = []
    top = max(r["concurrency"] for r in results)
    target_level = TARGET_CONCURRENCY if TARGET_CONCURRENCY in base else top
    for r in results:
        if r["concurrency"] == target_level:
            met = r["gateway_cpu_ms_per_turn"] <= TARGET_CPU_MS_PER_TURN and r["errors"] == 0
            verdicts.append(
                f"Target (gateway CPU <= {TARGET_CPU_MS_PER_TURN:g} ms per coordinator turn and no errors "
                f"at {target_level} concurrent episodes), {r['variant']}: {'met' if met else 'NOT met'} "
                f"({r['gateway_cpu_ms_per_turn']:.2f} ms, {r['errors']} errors)."
            )
    headline = Table(
        f"Gateway CPU per coordinator turn, {duration:g} s per level and variant "
        f"(ratios: ÷ {variants[0]} at the same level)",
        [
            "concurrent episodes",
            "variant",
            "gateway CPU ms per turn",
            f"CPU per turn ÷ {variants[0]}",
            "episodes/s",
            f"episodes/s ÷ {variants[0]}",
            "turns/s",
            "episodes",
            "turns",
            "errors",
            "statuses",
        ],
        [
            [
                r["concurrency"],
                r["variant"],
                r["gateway_cpu_ms_per_turn"],
                r["gateway_cpu_ms_per_turn"] / base[r["concurrency"]]["gateway_cpu_ms_per_turn"],
                r["episodes"] / r["seconds"],
                (r["episodes"] / r["seconds"])
                / (base[r["concurrency"]]["episodes"] / base[r["concurrency"]]["seconds"]),
                r["turns"] / r["seconds"],
                r["episodes"],
                r["turns"],
                r["errors"],
                json.dumps(r["statuses"], sort_keys=True),
            ]
            for r in results
        ],
        verdicts,
    )
    detail = Table(
        "Where the time goes (raw samples: episode latency client-side, compute per turn from "
        f"{RECORDS_SAMPLED} stored records per row; means of the /metrics histograms)",
        [
            "concurrent episodes",
            "variant",
            "episode p50 ms",
            "episode p99 ms",
            "compute per turn p50 ms",
            "compute per turn p99 ms",
            "compute per turn mean ms",
            "turns sampled",
            "LLM call mean ms, gateway view",
            "LLM call mean ms, server view",
            "record write mean ms",
            "CPU s gateway",
            "CPU s LLM",
            "CPU s worker",
            "CPU s client",
        ],
        [
            [
                r["concurrency"],
                r["variant"],
                r["latency"]["p50_ms"],
                r["latency"]["p99_ms"],
                r["turn_compute"]["p50_ms"],
                r["turn_compute"]["p99_ms"],
                r["turn_compute"]["mean_ms"],
                r["turn_compute"]["n"],
                r["llm_call_gateway"]["mean_ms"],
                r["llm_call_server"]["mean_ms"],
                r["record_write"]["mean_ms"],
                *(r["cpu_seconds"][k] for k in ("gateway", "llm", "worker", "client")),
            ]
            for r in results
        ],
        [
            "Compute per turn = the turn minus the LLM and worker waits, as the gateway timed them: it "
            "leaves out the gateway's HTTP server and client and its event loop's queueing, which the "
            "CPU per turn above includes and the gap between the two LLM-call views shows."
        ],
    )
    return [headline, detail]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", default="1,64,512", help="levels of episodes in flight")
    parser.add_argument("--duration", type=float, default=20.0, help="measured seconds per level and variant")
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"gateway variants, baseline first ({', '.join(VARIANTS)})",
    )
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "bcstack-bench-gateway")
    parser.add_argument("--json", type=Path, help="also write the raw numbers here")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR / "gateway.md", help="results file")
    parser.add_argument("--dirty-ok", action="store_true", help="write the report from uncommitted changes")
    args = parser.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    require_clean_tree("gateway", args.dirty_ok)  # before the run, not after it
    args.work.mkdir(parents=True, exist_ok=True)

    print("gateway benchmark")
    print_machine()
    ports = {k: free_port() for k in ("llm", "worker")}
    stub = multiprocessing.get_context("spawn").Process(
        target=stub_worker, args=(ports["worker"],), daemon=True
    )
    stub.start()
    llm_url = f"http://127.0.0.1:{ports['llm']}"
    results = []
    try:
        with contextlib.ExitStack() as stack:
            llm_proc = stack.enter_context(
                process(
                    ["serve", "coordinator-llm", "--port", str(ports["llm"])],
                    llm_url + "/health",
                    args.work / "llm.log",
                )
            )
            gateways = {}
            for variant in variants:
                gateways[variant] = start_gateway(stack, args.work, variant, ports, max(levels))
                asyncio.run(drive(gateways[variant]["url"], 4, 2.0))  # first connections and records
            pids = {"llm": llm_proc.pid, "worker": stub.pid, "client": os.getpid()}
            for i, level in enumerate(levels):
                for variant in variants if i % 2 == 0 else variants[::-1]:
                    run = measure(gateways[variant], llm_url, pids, level, args.duration)
                    run.update(concurrency=level, variant=variant)
                    results.append(run)
                    print(
                        f"  c={level} {variant}: {run['episodes'] / run['seconds']:.1f} episodes/s, "
                        f"{run['errors']} errors, gateway CPU "
                        f"{run['gateway_cpu_ms_per_turn']:.2f} ms per turn",
                        flush=True,
                    )
    finally:
        stub.terminate()

    order = {v: k for k, v in enumerate(variants)}
    results.sort(key=lambda r: (r["concurrency"], order[r["variant"]]))
    out = tables(results, variants, args.duration)
    print()
    print(render_results("gateway", out))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "results": results}, indent=2))
    print(f"results: {write_results('gateway', out, path=args.results, dirty_ok=args.dirty_ok)}")


def start_gateway(
    stack: contextlib.ExitStack, work: Path, variant: str, ports: dict[str, int], max_concurrent: int
) -> dict:
    """One gateway process with the variant's settings and its own record file; its URL and pid."""
    records = work / f"records-{variant}.sqlite"
    for suffix in ("", "-wal", "-shm"):
        Path(str(records) + suffix).unlink(missing_ok=True)
    config = gateway_config(
        ports["llm"],
        ports["worker"],
        records_path=str(records),
        max_concurrent_episodes=max_concurrent,
        log_level="WARNING",
        **VARIANTS[variant],
    )
    path = work / f"gateway-{variant}.yaml"
    path.write_text(yaml.safe_dump(config))
    http, grpc_port = free_port(), free_port()
    url = f"http://127.0.0.1:{http}"
    proc = stack.enter_context(
        process(
            [
                "serve",
                "coordinator",
                "--config",
                str(path),
                "--port",
                str(http),
                "--grpc-port",
                str(grpc_port),
            ],
            url + "/health",
            work / f"gateway-{variant}.log",
        )
    )
    return {"url": url, "pid": proc.pid}


if __name__ == "__main__":
    main()
