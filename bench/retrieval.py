"""Benchmark: the retrieval service against its own search core, side by side.

    python bench/retrieval.py [--docs 100000] [--duration 20] [--concurrency 1,8,32] [--work DIR]
                              [--json FILE] [--results FILE] [--dirty-ok]

1. Generate a toy corpus (default 100,000 documents) and index it with `bcstack index`
   (embedded backends: bm25s + Qdrant Edge, all-MiniLM-L6-v2): wall time and peak memory.
   The index is kept under --work and reused by later runs of the same size.
2. (a) the search core called in-process (asyncio, N concurrent callers) and (b) the service,
   `bcstack serve retrieval` in its own process, under `bcstack loadtest` over gRPC and over
   HTTP with N concurrent users: QPS and p50/p99 latency, plus p50/p99 per stage (embed,
   lexical, dense, fuse, total) from the core's own timings (in-process) and from the
   service's /metrics histograms (service).
3. An open-loop run over gRPC at half the service's peak QPS: its p99.

Targets (issue 3): the service reaches >= 70% of the in-process throughput at concurrency 8,
and p99 <= 50 ms at half of its peak QPS. Queries are the toy world's 300 test and train
questions, cycled. Everything runs on this machine: the load generator shares its cores with
the service, as a client on the same node would. The tables, with the command, commit, machine and
date, go to bench/results/retrieval.md (--results), the file the README's numbers come from;
refused from a checkout with uncommitted changes unless --dirty-ok (the report then says DIRTY).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from common import RESULTS_DIR, Table, machine, print_machine, require_clean_tree, write_results  # noqa: E402

STAGES = ("embed", "lexical", "dense", "fuse", "fetch", "total")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def build(work: Path, docs: int) -> dict:
    world, index = work / f"world-{docs}", work / f"index-{docs}"
    if not (world / "corpus.jsonl").exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "bcstack",
                "toyworld",
                "generate",
                "--out",
                str(world),
                "--docs",
                str(docs),
            ],
            check=True,
        )
    manifest = index / "manifest.json"
    if manifest.exists() and json.loads(manifest.read_text()).get("complete"):
        info = json.loads((work / f"build-{docs}.json").read_text())
        info["reused"] = True
        return info
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "bcstack",
            "index",
            "--corpus",
            str(world / "corpus.jsonl"),
            "--index-dir",
            str(index),
        ],
        check=True,
    )
    info = {
        "docs": docs,
        "build_s": time.perf_counter() - start,
        "peak_rss_mib": max(before, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024,
        "index_mib": sum(f.stat().st_size for f in index.rglob("*") if f.is_file()) / 2**20,
        "reused": False,
    }
    (work / f"build-{docs}.json").write_text(json.dumps(info))
    return info


def queries(work: Path, docs: int) -> list[str]:
    out = []
    for name in ("questions.jsonl", "train.jsonl"):
        out += [
            json.loads(line)["query"] for line in (work / f"world-{docs}" / name).read_text().splitlines()
        ]
    return out


# --- (a) in-process ------------------------------------------------------------------------------


async def _in_process(index_dir: Path, qs: list[str], concurrency: int, duration: float) -> dict:
    from core.kit.metrics import new_registry
    from services.retrieval.core import RetrievalMetrics, SearchCore, SearchQuery
    from services.retrieval.index import open_index
    from services.retrieval.settings import RetrievalSettings

    settings = RetrievalSettings(index_dir=index_dir)
    core = SearchCore(open_index(settings), settings, RetrievalMetrics(new_registry()))
    for q in qs[:20]:  # warm up: model, caches, thread pool
        await core.search(SearchQuery(q, 10))
    latencies: list[float] = []
    stages: dict[str, list[float]] = {s: [] for s in STAGES}
    deadline = time.perf_counter() + duration
    counter = 0

    async def caller() -> None:
        nonlocal counter
        while time.perf_counter() < deadline:
            q = qs[counter % len(qs)]
            counter += 1
            t0 = time.perf_counter()
            result = await core.search(SearchQuery(q, 10))
            latencies.append(time.perf_counter() - t0)
            for s in STAGES:
                stages[s].append(result.timings.get(s, 0.0))

    start = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    core.close()
    return {
        "qps": len(latencies) / elapsed,
        "p50_ms": pct(latencies, 0.5) * 1e3,
        "p99_ms": pct(latencies, 0.99) * 1e3,
        "stages": {s: (pct(v, 0.5) * 1e3, pct(v, 0.99) * 1e3) for s, v in stages.items()},
    }


def in_process(index_dir: Path, qs: list[str], concurrency: int, duration: float) -> dict:
    # A fresh process per run: the benchmark's own thread pools and model copies do not linger.
    code = (
        "import asyncio, json, sys; sys.path.insert(0, 'bench'); import retrieval as b; "
        f"args = (b.Path({str(index_dir)!r}), {qs!r}, {concurrency}, {duration}); "
        "print(json.dumps(asyncio.run(b._in_process(*args))))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- (b) the service -----------------------------------------------------------------------------


def _histograms(url: str) -> dict[str, list[tuple[float, float]]]:
    """Cumulative bucket counts of bcstack_retrieval_stage_seconds per stage."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[float, float]]] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        if fam.name != "bcstack_retrieval_stage_seconds":
            continue
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                out.setdefault(s.labels["stage"], []).append((float(s.labels["le"]), s.value))
    return out


def _quantile(before: list[tuple[float, float]], after: list[tuple[float, float]], q: float) -> float:
    """Quantile from the bucket deltas, interpolated linearly inside its bucket as PromQL's
    histogram_quantile does, in ms."""
    delta = [(le, a - b) for (le, a), (_, b) in zip(sorted(after), sorted(before), strict=True)]
    total = delta[-1][1] if delta else 0
    if total <= 0:
        return float("nan")
    lower_le, lower_count = 0.0, 0.0
    for le, count in delta:
        if count >= q * total:
            if le == float("inf"):
                return lower_le * 1e3
            share = (q * total - lower_count) / max(count - lower_count, 1e-12)
            return (lower_le + (le - lower_le) * share) * 1e3
        lower_le, lower_count = le, count
    return float("inf")


def service_run(
    http: str,
    grpc_addr: str,
    qs_file: Path,
    transport: str,
    concurrency: int | None,
    qps: float | None,
    duration: float,
) -> dict:
    from services.retrieval.loadtest import LoadTestConfig, load_queries, run_loadtest

    before = _histograms(http)
    config = LoadTestConfig(
        url=grpc_addr if transport == "grpc" else http,
        duration_s=duration,
        concurrency=concurrency,
        qps=qps,
        grpc=transport == "grpc",
        queries=load_queries(qs_file),
        k=10,
        warmup_s=2,
    )
    report = run_loadtest(config)
    after = _histograms(http)
    stages = {}
    for s, buckets in after.items():
        base = before.get(s) or [(le, 0.0) for le, _ in buckets]  # no search yet: all zero
        stages[s] = (_quantile(base, buckets, 0.5), _quantile(base, buckets, 0.99))
    return {
        "qps": report.achieved_qps,
        "p50_ms": report.latency_ms["p50"],
        "p99_ms": report.latency_ms["p99"],
        "errors": report.errors,
        "client_cpu_percent": report.client_cpu_percent,
        "stages": stages,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--docs", type=int, default=100_000)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per measured run")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "bcstack-bench-retrieval")
    parser.add_argument("--json", type=Path, help="also write the raw numbers here")
    parser.add_argument(
        "--results", type=Path, default=RESULTS_DIR / "retrieval.md", help="the Markdown tables"
    )
    parser.add_argument("--dirty-ok", action="store_true", help="write the report from uncommitted changes")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    require_clean_tree("retrieval", args.dirty_ok)  # before the run, not after it
    args.work.mkdir(parents=True, exist_ok=True)

    print("retrieval benchmark")
    print_machine()
    built = build(args.work, args.docs)
    index_dir = args.work / f"index-{args.docs}"
    print(
        f"\nindex: {args.docs:,} docs; build {built['build_s']:.0f} s, "
        f"peak RSS {built['peak_rss_mib']:.0f} MiB, "
        f"on disk {built['index_mib']:.0f} MiB{' (built by an earlier run)' if built['reused'] else ''}"
    )
    qs = queries(args.work, args.docs)
    qs_file = args.work / "queries.txt"
    qs_file.write_text("\n".join(qs) + "\n")

    results: dict[str, dict[int, dict]] = {"in-process": {}, "grpc": {}, "http": {}}
    for c in levels:
        results["in-process"][c] = in_process(index_dir, qs, c, args.duration)
        print(f"  in-process c={c}: {results['in-process'][c]['qps']:.0f} QPS", flush=True)

    http_port, grpc_port = free_port(), free_port()
    env = {**os.environ, "BCSTACK_RETRIEVAL_LOG_LEVEL": "WARNING"}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bcstack",
            "serve",
            "retrieval",
            "--index-dir",
            str(index_dir),
            "--port",
            str(http_port),
            "--grpc-port",
            str(grpc_port),
        ],
        env=env,
    )
    http, grpc_addr = f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(http + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        for transport in ("grpc", "http"):
            for c in levels:
                results[transport][c] = service_run(
                    http, grpc_addr, qs_file, transport, c, None, args.duration
                )
                print(f"  {transport} c={c}: {results[transport][c]['qps']:.0f} QPS", flush=True)
        peak = max(r["qps"] for r in results["grpc"].values())
        half = service_run(http, grpc_addr, qs_file, "grpc", None, round(peak / 2, 1), args.duration)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)

    print("\nthroughput and end-to-end latency (k=10, hybrid)")
    print(f"{'path':<11} {'conc':>4} {'QPS':>8} {'p50 ms':>8} {'p99 ms':>8} {'vs in-proc':>10} {'errors':>6}")
    for path, rows in results.items():
        for c, r in rows.items():
            ratio = r["qps"] / results["in-process"][c]["qps"]
            print(
                f"{path:<11} {c:>4} {r['qps']:>8.1f} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} {ratio:>10.2f} "
                f"{r.get('errors', 0):>6}"
            )
    print("\nper-stage latency p50 / p99 ms (service: from /metrics buckets, interpolated)")
    print(f"{'path':<11} {'conc':>4} " + " ".join(f"{s:>15}" for s in STAGES))
    for path, rows in results.items():
        for c, r in rows.items():
            nan = (float("nan"), float("nan"))
            cells = " ".join(
                f"{r['stages'].get(s, nan)[0]:>7.2f}/{r['stages'].get(s, nan)[1]:<7.2f}" for s in STAGES
            )
            print(f"{path:<11} {c:>4} {cells}")
    c8 = 8 if 8 in levels else levels[len(levels) // 2]
    best = max(results["grpc"][c8]["qps"], results["http"][c8]["qps"])
    ratio8 = best / results["in-process"][c8]["qps"]
    print(
        f"\nservice / in-process throughput at concurrency {c8}: {ratio8:.2f} (target >= 0.70): "
        f"{'met' if ratio8 >= 0.7 else 'NOT met'}"
    )
    print(
        f"open loop over gRPC at half the peak ({peak / 2:.0f} of {peak:.0f} QPS): "
        f"achieved {half['qps']:.0f} QPS, "
        f"p50 {half['p50_ms']:.1f} ms, p99 {half['p99_ms']:.1f} ms (target <= 50): "
        f"{'met' if half['p99_ms'] <= 50 else 'NOT met'}"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"machine": machine(), "build": built, "results": results, "half": half},
                indent=2,
                default=str,
            )
        )
    tables = retrieval_tables(args, built, results, half)
    print(f"results: {write_results('retrieval', tables, path=args.results, dirty_ok=args.dirty_ok)}")


def retrieval_tables(args: argparse.Namespace, built: dict, results: dict, half: dict) -> list[Table]:
    """The tables of bench/results/retrieval.md: build, throughput and latency, stages, open loop."""
    nan = (float("nan"), float("nan"))
    build_table = Table(
        f"Index build, {args.docs} documents",
        ["docs", "build s", "peak RSS MiB", "on disk MiB", "built by an earlier run"],
        [[args.docs, built["build_s"], built["peak_rss_mib"], built["index_mib"], built["reused"]]],
    )
    throughput = Table(
        f"Throughput and end-to-end latency (k=10, hybrid), {args.duration:g} s per run",
        ["path", "concurrency", "QPS", "p50 ms", "p99 ms", "QPS ÷ in-process", "errors"],
        [
            [
                path,
                c,
                r["qps"],
                r["p50_ms"],
                r["p99_ms"],
                r["qps"] / results["in-process"][c]["qps"],
                r.get("errors", 0),
            ]
            for path, rows in results.items()
            for c, r in rows.items()
        ],
    )
    stages = Table(
        "Per-stage latency p50 / p99 ms (service: from /metrics buckets, interpolated)",
        ["path", "concurrency", *(f"{s} p50" for s in STAGES), *(f"{s} p99" for s in STAGES)],
        [
            [path, c, *(r["stages"].get(s, nan)[0] for s in STAGES)]
            + [r["stages"].get(s, nan)[1] for s in STAGES]
            for path, rows in results.items()
            for c, r in rows.items()
        ],
    )
    peak = max(r["qps"] for r in results["grpc"].values())
    open_loop = Table(
        "Open loop over gRPC at half the peak",
        ["peak QPS", "offered QPS", "achieved QPS", "p50 ms", "p99 ms", "errors"],
        [[peak, round(peak / 2, 1), half["qps"], half["p50_ms"], half["p99_ms"], half.get("errors", 0)]],
    )
    return [build_table, throughput, stages, open_loop]


if __name__ == "__main__":
    main()
