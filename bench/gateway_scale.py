"""Benchmark: the record store under a gateway, and gateway replicas on one PostgreSQL (issue 33).

    python bench/gateway_scale.py [--writers 256] [--store-seconds 10] [--concurrency 256]
                                  [--rate R,...] [--per-replica-rate R,...] [--max-in-flight 256]
                                  [--duration 15] [--replicas 1,2,4] [--disk-iops 1000]
                                  [--stores-only | --gateways-only] [--results FILE] [--dirty-ok]

Two parts, each comparing its variants side by side in one run:

1. **Stores** (in a child process, no gateway): `--writers` concurrent episodes writing records the
   size of a real one (4 worker trajectories of 3,000 tokens with log-probs, ~70 KiB compressed)
   and small ones (~0.7 KiB) for `--store-seconds` each: SQLite with one commit per episode (the
   store before group commit, SQLite's own checkpoints), SQLite with group commit (and its
   background checkpointer), PostgreSQL with one commit per episode, PostgreSQL with group commit.
   Episodes stored per second, the write latency (put to durable) p50/p99 of raw samples, and
   episodes per commit; ratios against the first. All of it twice: on this machine's disk, and on
   it with its write operations capped at `--disk-iops` per second (a blkio cgroup holding the
   child and its own PostgreSQL server: a network volume's ~1 ms per write, which a virtual disk
   whose host caches writes does not have).
2. **Gateways** (real processes: `bcstack serve coordinator` replicas, the scripted coordinator LLM,
   the instant stub worker of `devkit.stubworker`, Debian's PostgreSQL, HAProxy in front of several
   replicas): `--concurrency` closed-loop clients for `--duration` seconds, the same episode mix:
   one gateway on SQLite, one on PostgreSQL, then 1, 2 and 4 replicas on PostgreSQL behind HAProxy.
   `--concurrency 32,256` runs every variant at each load in turn (ratios against one PostgreSQL
   replica at the same load), so whether a replica's extra CPU per turn on shared cores depends on
   how busy the cores are can be read side by side. `--rate 100` adds an open-loop load: episodes
   arrive at 100 per second (Poisson) whatever the gateways do, at most `--max-in-flight` at once,
   so every variant is offered the same work; at a rate well below what the box serves the cores are
   mostly idle, and the CPU per turn is a replica's own work rather than its share of the contention.
   `--per-replica-rate 40` offers N replicas N x 40 episodes/s, each replica the same load as the one
   replica it is compared with: whether a replica costs more per turn when there are more of them
   (the goal), apart from how busy each one is (a busier gateway spreads its event loop's wake-ups
   over more turns, so splitting one load over more replicas costs more per turn by itself).
   Episodes/s, client latency p50/p99, every gateway process's CPU (user + system from /proc) per
   coordinator turn, that CPU relative to one replica's, the gateways' context switches per turn
   and a replica's CPU when idle.

All processes share this machine's cores (2 here): more replicas cannot add cores, so what this box
shows for replicas is the CPU each episode costs (the goal: N replicas <= 1.1x one replica's), not
throughput growing with cores. Machine, commit and raw numbers go to bench/results/gateway_scale.md;
a checkout with uncommitted changes is refused unless --dirty-ok.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from common import (  # noqa: E402
    Table,
    free_port,
    print_machine,
    require_clean_tree,
    write_results,
)
from gateway import cpu_seconds, drive, percentiles_ms  # noqa: E402

from bcstack.front import HaproxyFront  # noqa: E402
from bcstack.pgserver import PostgresServer  # noqa: E402
from core.record_store import RecordStore, open_record_store  # noqa: E402
from devkit.stubworker import gateway_config, stub_worker  # noqa: E402


def episode_record(episode_id: str, rng: random.Random, tokens: int = 3000) -> dict:
    """A record shaped like a real episode's: 4 worker trajectories of `tokens` tokens with log-probs."""
    workers = []
    for w in range(4):
        n = tokens
        workers.append(
            {
                "episode_id": f"{episode_id}.w{w}",
                "trajectory": {
                    "token_ids": [rng.randrange(151_000) for _ in range(n)],
                    "loss_mask": [int(i % 5 != 0) for i in range(n)],
                    "rollout_logprobs": [round(-rng.random() * 3, 4) for _ in range(n)],
                },
            }
        )
    return {
        "episode_id": episode_id,
        "status": "finish",
        "question_id": f"q{rng.randrange(500)}",
        "group_id": f"g{rng.randrange(100)}",
        "weight_versions": ["v1"],
        "grades": {"correct": rng.random() < 0.3},
        "workers": workers,
    }


def store_run(target: str, group_commit: bool, writers: int, seconds: float, records: list[dict]) -> dict:
    """`writers` episodes on one event loop putting records for `seconds`, as the gateway does
    (`put_async`: encode, then wait on the commit without a thread); stored/s, latency, episodes per
    commit."""
    store = open_record_store(target, group_commit=group_commit)
    encoded = [store.encode(r) for r in records]  # the encoding is the caller's, not the store's
    latencies: list[float] = []
    counter = iter(range(10**9))

    async def writer(stop: float) -> None:
        while time.perf_counter() < stop:
            i = next(counter)
            row = encoded[i % len(encoded)]
            row = dataclasses.replace(row, episode_id=f"{row.episode_id}-{i}")
            t0 = time.perf_counter()
            await asyncio.wrap_future(store.submit(row))
            latencies.append(time.perf_counter() - t0)

    async def run() -> float:
        start = time.perf_counter()
        await asyncio.gather(*(writer(start + seconds) for _ in range(writers)))
        return time.perf_counter() - start

    batches0 = store.batches
    elapsed = asyncio.run(run())
    batches = store.batches - batches0
    store.close()
    return {
        "stored": len(latencies),
        "seconds": elapsed,
        "per_s": len(latencies) / elapsed,
        "latency": percentiles_ms(latencies),
        "per_commit": len(latencies) / max(batches, 1),
    }


def fsync_us(folder: Path, n: int = 500) -> float:
    """This disk's cost of one 8 KiB write + fsync, the mean over `n` (what a commit waits for)."""
    path = folder / "fsync.probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        block = os.urandom(8192)
        start = time.perf_counter()
        for _ in range(n):
            os.pwrite(fd, block, 0)
            os.fsync(fd)
        return (time.perf_counter() - start) / n * 1e6
    finally:
        os.close(fd)
        path.unlink()


def blkio_cgroup(folder: Path, iops: int) -> Path:
    """A cgroup that caps write operations per second on the disk holding `folder` (Linux blkio
    throttling, cgroup v1 `blkio.throttle.write_iops_device` or v2 `io.max`): the way to give this
    machine's fast disk a network volume's commit cost without a cloud. Needs root; raises OSError
    saying why when the kernel or the permissions do not allow it."""
    dev = os.stat(folder).st_dev
    major, minor = os.major(dev), os.minor(dev)
    sysdev = Path(f"/sys/dev/block/{major}:{minor}")
    if (sysdev / "partition").exists():  # throttling applies to whole disks, not partitions
        major, minor = (int(x) for x in (sysdev.resolve().parent / "dev").read_text().split(":"))
    name = f"bcstack-bench-{os.getpid()}-{iops}"
    v1 = Path("/sys/fs/cgroup/blkio")
    if (v1 / "blkio.throttle.write_iops_device").exists():
        group = v1 / name
        group.mkdir(exist_ok=True)
        (group / "blkio.throttle.write_iops_device").write_text(f"{major}:{minor} {iops}")
        return group
    v2 = Path("/sys/fs/cgroup")
    if "io" in (v2 / "cgroup.controllers").read_text().split():
        group = v2 / name
        group.mkdir(exist_ok=True)
        (group / "io.max").write_text(f"{major}:{minor} wiops={iops}")
        return group
    raise OSError("no blkio (cgroup v1) or io (cgroup v2) controller to throttle the disk with")


def store_part(folder: Path, disk: str, group: Path | None, writers: int, seconds: float) -> dict:
    """Part 1 in a child process (the bench's pool): every store variant, both record sizes, on this
    disk or, joining the cgroup `group`, on it with its write IOPS capped; a PostgreSQL server of
    its own is started from inside, so that its writes are capped too."""
    if group is not None:
        (group / "cgroup.procs").write_text(str(os.getpid()))
    folder.mkdir(parents=True)
    os.chmod(folder, 0o755)  # the PostgreSQL server runs as 'postgres' when this runs as root
    out: dict = {"stores": []}
    out["fsync_us"] = fsync_us(folder)
    print(f"  {disk}: {out['fsync_us']:.0f} us per 8 KiB write + fsync", flush=True)
    server = PostgresServer(folder / "postgres", port=free_port())
    server.start()
    try:
        databases = iter(range(100))
        rng = random.Random(0)
        for size, tokens in (("real-sized", 3000), ("small", 16)):
            records = [episode_record(f"ep{i}", rng, tokens) for i in range(64)]
            kib = sum(len(RecordStore.encode(r).body) for r in records) / len(records) / 1024
            for name, kind, group_commit in STORE_VARIANTS:
                target = (
                    str(folder / f"{size}-{kind}-{group_commit}.sqlite")
                    if kind == "sqlite"
                    else new_database(server, f"store{next(databases)}")
                )
                run = store_run(target, group_commit, writers, seconds, records)
                run.update(variant=name, record=f"{size} ({kib:.1f} KiB compressed)", disk=disk)
                out["stores"].append(run)
                print(
                    f"  {disk}, {size}, {name}: {run['per_s']:.0f} episodes/s, "
                    f"p50 {run['latency']['p50_ms']:.1f} ms, p99 {run['latency']['p99_ms']:.1f} ms, "
                    f"{run['per_commit']:.1f} per commit",
                    flush=True,
                )
    finally:
        server.stop(mode="fast")
    return out


def new_database(server: PostgresServer, name: str) -> str:
    """A fresh database on `server`; its URL."""
    import psycopg

    with psycopg.connect(server.url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return server.url.rsplit("/", 1)[0] + "/" + name


STORE_VARIANTS = (
    ("SQLite, a commit per episode", "sqlite", False),
    ("SQLite, group commit", "sqlite", True),
    ("PostgreSQL, a commit per episode", "postgres", False),
    ("PostgreSQL, group commit", "postgres", True),
)


IDLE_SECONDS = 3.0  # each replica's CPU with nothing to do, before the warm-up


def context_switches(pid: int) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of a process's main thread so far (Linux /proc):
    voluntary ones are its event loop going to sleep for want of work, involuntary ones the kernel
    taking the core away for another process."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    return int(fields["voluntary_ctxt_switches"]), int(fields["nonvoluntary_ctxt_switches"])


def start_gateway(work: Path, name: str, ports: dict, records: dict[str, str], concurrency: int) -> dict:
    config = gateway_config(
        ports["llm"], ports["worker"], max_concurrent_episodes=concurrency * 2, log_level="WARNING"
    )
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    env = {**os.environ, **records, "BCSTACK_COORDINATOR_REPLICA_NAME": name}
    log = (work / f"{name}.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "bcstack", "serve", "coordinator", "--config", str(path), "--port", str(port),
         "--grpc-port", str(free_port())],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"gateway {name} exited; see {work / (name + '.log')}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return {"url": url, "proc": proc, "address": f"127.0.0.1:{port}"}
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"gateway {name} did not become healthy; see {work / (name + '.log')}")
        time.sleep(0.2)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def gateway_run(
    work: Path,
    label: str,
    ports: dict,
    records: dict[str, str],
    n: int,
    args,
    concurrency: int,
    *,
    named: bool = False,
    rate: float | None = None,
) -> dict:
    """One variant: `n` gateway replicas (behind HAProxy when several), driven closed-loop with
    `concurrency` episodes in flight, or open-loop at `rate` episodes/s with at most that many."""
    gateways = [start_gateway(work, f"{label}-{i + 1}", ports, records, concurrency) for i in range(n)]
    front = None
    try:
        url = gateways[0]["url"]
        if n > 1:
            front = HaproxyFront(
                work / f"front-{label}", port=free_port(), backends=[g["address"] for g in gateways]
            )
            front.start()
            url = front.url
        idle0 = [cpu_seconds(g["proc"].pid) for g in gateways]
        time.sleep(IDLE_SECONDS)
        idle = [cpu_seconds(g["proc"].pid) - c for g, c in zip(gateways, idle0, strict=True)]
        asyncio.run(drive(url, concurrency, 2.0, named=named, rate=rate))  # warm-up: connections, pools
        cpu0 = [cpu_seconds(g["proc"].pid) for g in gateways]
        switches0 = [context_switches(g["proc"].pid) for g in gateways]
        run = asyncio.run(drive(url, concurrency, args.duration, named=named, rate=rate))
        cpu1 = [cpu_seconds(g["proc"].pid) for g in gateways]
        switches1 = [context_switches(g["proc"].pid) for g in gateways]
        run.pop("episode_ids")
        turns = max(run["turns"], 1)
        run["gateway_cpu_s"] = sum(b - a for a, b in zip(cpu0, cpu1, strict=True))
        run["cpu_ms_per_turn"] = run["gateway_cpu_s"] * 1e3 / turns
        run["idle_cpu_percent"] = max(idle) / IDLE_SECONDS * 100  # the busiest idle replica
        for i, kind in enumerate(("voluntary", "involuntary")):
            run[f"{kind}_switches_per_turn"] = (
                sum(b[i] - a[i] for a, b in zip(switches0, switches1, strict=True)) / turns
            )
        return run
    finally:
        if front is not None:
            front.stop()
        for g in gateways:
            stop(g["proc"])


def _rates(parser: argparse.ArgumentParser, option: str, text: str) -> list[float]:
    """An option's comma list of episodes per second, each positive; a bad one is refused in one line."""
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        parser.error(f"{option} takes numbers of episodes per second separated by commas: {text!r}")
    if rates and not min(rates) > 0:
        parser.error(f"{option} takes positive numbers of episodes per second: {text!r}")
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--writers", type=int, default=256, help="concurrent episodes writing, part 1")
    parser.add_argument("--store-seconds", type=float, default=10.0, help="seconds per store variant")
    parser.add_argument(
        "--disk-iops", type=int, default=1000,
        help="part 1 again with the disk's write IOPS capped at this (a network volume; needs root and "
        "cgroup blkio throttling; 0 skips it)",
    )  # fmt: skip
    parser.add_argument(
        "--concurrency",
        default="256",
        help="closed-loop loads of part 2, episodes in flight; a comma list runs each load in turn "
        "('' for none, with --rate)",
    )
    parser.add_argument(
        "--rate",
        default="",
        help="open-loop loads of part 2, episodes offered per second (Poisson arrivals); a comma list "
        "runs each in turn, after the closed-loop ones",
    )
    parser.add_argument(
        "--per-replica-rate",
        default="",
        help="open-loop loads of part 2 that grow with the replicas: N replicas are offered N x R "
        "episodes per second; a comma list runs each in turn, after the others",
    )
    parser.add_argument(
        "--max-in-flight", type=int, default=256, help="open-loop loads: arrivals beyond this many in flight "
        "are refused (counted, not sent)",
    )  # fmt: skip
    parser.add_argument("--duration", type=float, default=15.0, help="measured seconds per gateway variant")
    parser.add_argument("--replicas", default="1,2,4", help="gateway replicas on PostgreSQL")
    parser.add_argument(
        "--named", default="1,2", help="gateway replicas on PostgreSQL driven with named episode ids (claims)"
    )
    parser.add_argument("--results", type=Path, default=None, help="results file (default bench/results/)")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw numbers here")
    parser.add_argument("--dirty-ok", action="store_true", help="write results from uncommitted changes")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--stores-only", action="store_true", help="part 1 only (no gateways)")
    only.add_argument("--gateways-only", action="store_true", help="part 2 only (no store variants)")
    args = parser.parse_args()
    try:
        closed = [int(x) for x in args.concurrency.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--concurrency takes whole numbers separated by commas: {args.concurrency!r}")
    if closed and min(closed) < 1:
        parser.error(f"--concurrency takes whole numbers of at least 1: {args.concurrency!r}")
    rates = _rates(parser, "--rate", args.rate)
    per_replica = _rates(parser, "--per-replica-rate", args.per_replica_rate)
    if args.max_in_flight < 1:
        parser.error(f"--max-in-flight takes a whole number of at least 1: {args.max_in_flight}")
    # Each load: (label, episodes in flight or the open loop's cap, offered rate or None, whether the
    # rate is per replica).
    loads = [(f"{c} in flight", c, None, False) for c in closed]
    loads += [(f"{r:g}/s offered", args.max_in_flight, r, False) for r in rates]
    loads += [(f"{r:g}/s per replica offered", args.max_in_flight, r, True) for r in per_replica]
    if not loads and not args.stores_only:
        parser.error("part 2 needs a load: --concurrency, --rate, --per-replica-rate")
    replicas = [int(x) for x in args.replicas.split(",")]
    named_replicas = [int(x) for x in args.named.split(",") if x]

    def load_variants(server, databases, sqlite_env: dict[str, str]) -> list[tuple[str, int, dict[str, str]]]:
        """One load's variants: (label, replicas, records env), each PostgreSQL one its own database."""

        def postgres() -> dict[str, str]:
            return {"BCSTACK_COORDINATOR_RECORDS_URL": new_database(server, f"bench{next(databases)}")}

        return [
            ("1 gateway, SQLite", 1, sqlite_env),
            *((f"{n} gateway(s), PostgreSQL", n, postgres()) for n in replicas),
            *((f"{n} gateway(s), PostgreSQL, named ids", n, postgres()) for n in named_replicas),
        ]

    print("gateway_scale: record stores and gateway replicas")
    print_machine()
    require_clean_tree("gateway_scale", args.dirty_ok)
    work = Path(tempfile.mkdtemp(prefix="bcstack-gateway-scale-"))
    os.chmod(work, 0o755)  # the PostgreSQL server runs as 'postgres' when this runs as root
    server = PostgresServer(work / "postgres", port=free_port())
    server.start()
    spawn = multiprocessing.get_context("spawn")
    ports = {"llm": free_port(), "worker": free_port()}
    stub = spawn.Process(target=stub_worker, args=(ports["worker"],), daemon=True)
    stub.start()
    databases = iter(range(100))

    raw: dict = {"stores": [], "gateways": [], "disks": []}
    try:
        # --- part 1: stores, on this disk and on it capped to a network volume's write IOPS --------
        disks = [] if args.gateways_only else [("this disk", None)]
        if args.disk_iops and not args.gateways_only:
            disks.append((f"this disk at {args.disk_iops} write IOPS", args.disk_iops))
        for disk, iops in disks:
            group = None
            if iops:
                try:
                    group = blkio_cgroup(work, iops)
                except OSError as exc:
                    print(f"  {disk}: skipped ({exc})", flush=True)
                    raw["disks"].append({"disk": disk, "iops": iops, "skipped": str(exc)})
                    continue
            with spawn.Pool(1) as pool:  # a child process, so that it alone joins the cgroup
                result = pool.apply(
                    store_part, (work / f"stores-{iops or 0}", disk, group, args.writers, args.store_seconds)
                )
            if group is not None:
                group.rmdir()
            raw["disks"].append({"disk": disk, "iops": iops, "fsync_us": result["fsync_us"]})
            raw["stores"] += result["stores"]

        # --- part 2: gateways -----------------------------------------------------------------
        llm_log = (work / "llm.log").open("w")
        llm = subprocess.Popen(
            [sys.executable, "-m", "bcstack", "serve", "coordinator-llm", "--port", str(ports["llm"])],
            stdout=llm_log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        with contextlib.ExitStack() as stack:
            stack.callback(stop, llm)
            for _ in range(600):
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"http://127.0.0.1:{ports['llm']}/health", timeout=2).status_code == 200:
                        break
                time.sleep(0.2)
            variants = []
            for i, load in enumerate([] if args.stores_only else loads):
                sqlite_env = {"BCSTACK_COORDINATOR_RECORDS_PATH": str(work / f"gw-{i}.sqlite")}
                variants += [(load, *v) for v in load_variants(server, databases, sqlite_env)]
            for (load, in_flight, rate, each), label, n, records_env in variants:
                named = "named ids" in label
                rate = rate * n if rate is not None and each else rate
                run = gateway_run(
                    work, f"v{len(raw['gateways'])}", ports, records_env, n, args, in_flight, named=named,
                    rate=rate,
                )  # fmt: skip
                run.update(variant=label, replicas=n, load=load, concurrency=in_flight, rate=rate)
                raw["gateways"].append(run)
                print(
                    f"  {load}, {label}: {run['episodes'] / run['seconds']:.1f} episodes/s, "
                    f"{run['errors']} errors, {run['refused']} refused, "
                    f"p99 {run['latency']['p99_ms']:.0f} ms, "
                    f"gateway CPU {run['cpu_ms_per_turn']:.2f} ms/turn",
                    flush=True,
                )
    finally:
        stub.terminate()
        server.stop(mode="fast")
        shutil.rmtree(work, ignore_errors=True)

    base = {(r["disk"], r["record"]): r["per_s"] for r in raw["stores"] if "SQLite, a commit" in r["variant"]}
    store_rows = [
        [
            r["disk"], r["record"], r["variant"], r["stored"], round(r["seconds"], 1), round(r["per_s"], 1),
            round(r["per_s"] / base[r["disk"], r["record"]], 2),
            round(r["latency"]["p50_ms"], 1), round(r["latency"]["p99_ms"], 1), round(r["per_commit"], 1),
        ]
        for r in raw["stores"]
    ]  # fmt: skip
    # Each row's ratio is against one PostgreSQL replica at the same load.
    one = {r["load"]: r for r in reversed(raw["gateways"]) if r["variant"] == "1 gateway(s), PostgreSQL"}
    gateway_rows = [
        [
            r["load"], r["variant"], r["episodes"], r["errors"], r["refused"], round(r["seconds"], 1),
            round(r["episodes"] / r["seconds"], 1), round(r["latency"]["p50_ms"], 0),
            round(r["latency"]["p99_ms"], 0), round(r["cpu_ms_per_turn"], 2),
            round(r["cpu_ms_per_turn"] / one[r["load"]]["cpu_ms_per_turn"], 2) if r["load"] in one else "",
            round(r["voluntary_switches_per_turn"], 2), round(r["involuntary_switches_per_turn"], 2),
            round(r["idle_cpu_percent"], 2),
        ]
        for r in raw["gateways"]
    ]  # fmt: skip
    tables = [
        Table(
            f"Record stores: {args.writers} concurrent writers, {args.store_seconds:g} s each",
            [
                "disk",
                "record",
                "variant",
                "stored",
                "seconds",
                "episodes/s",
                "x a commit per episode on SQLite",
                "write p50 ms",
                "write p99 ms",
                "episodes per commit",
            ],
            store_rows,
            notes=[
                "Goals: group commit >= 5x a commit per episode; PostgreSQL >= 1,000 episodes/s stored.",
                "Disks: "
                + "; ".join(
                    f"{d['disk']}: "
                    + (
                        f"skipped ({d['skipped']})"
                        if d.get("skipped")
                        else f"{d['fsync_us']:.0f} us per 8 KiB write + fsync"
                    )
                    for d in raw["disks"]
                )
                + ". This machine's disk is a virtual disk whose host caches writes; a cluster's network "
                "volume takes ~1 ms per write operation, which the capped disk (a blkio cgroup holding "
                "the writers and their PostgreSQL server) stands for: there a commit per episode caps "
                "a store at a few hundred episodes/s, and group commit's one fsync per batch is what "
                "matters. Writers: coroutines on one event loop awaiting put_async's commit, as the "
                "gateway does; ratios are against SQLite's commit per episode on the same disk.",
            ],
        ),  # fmt: skip
        Table(
            f"Gateways: {', '.join(load for load, *_ in loads)}, {args.duration:g} s each, "
            "scripted LLM, stub worker",
            [
                "load",
                "variant",
                "episodes",
                "errors",
                "refused",
                "seconds",
                "episodes/s",
                "p50 ms",
                "p99 ms",
                "gateway CPU ms/turn",
                "x 1 PostgreSQL replica at that load",
                "sleeps/turn",
                "preemptions/turn",
                "idle CPU % of a core",
            ],
            gateway_rows,
            notes=[
                "Goal: CPU per turn with N replicas <= 1.1x one replica's. On 2 cores every process "
                "(gateways, HAProxy, the LLM, the worker, PostgreSQL, this client) shares the same cores, "
                "so episodes/s cannot grow with replicas here; the CPU per turn says what a replica costs. "
                "Sleeps and preemptions are the gateways' main-thread context switches per turn (voluntary: "
                "an event loop waiting for work; involuntary: the kernel giving the core to another "
                "process); idle CPU is the busiest replica's with no episodes, before the warm-up. "
                "Ratios are against one PostgreSQL replica at the same load. Loads: 'N in flight' is a "
                "closed loop (N clients, each posting its next episode when its last returns: the "
                "cores saturated); 'R/s offered' an open loop (Poisson arrivals at R episodes/s, at "
                f"most {args.max_in_flight} in flight, an arrival beyond that refused and counted): "
                "below saturation the cores are mostly idle, so a replica's CPU per turn is its own "
                "work, not its share of the contention; 'R/s per replica offered' offers N replicas "
                "N x R episodes/s, so each replica carries the load of the one it is compared with; "
                "seconds include draining the last episodes."
            ],
        ),  # fmt: skip
    ]
    tables = [t for t in tables if t.rows]  # --stores-only or --gateways-only: one part's table
    if args.json:
        args.json.write_text(json.dumps(raw, indent=2))
    print(f"results: {write_results('gateway_scale', tables, path=args.results, dirty_ok=args.dirty_ok)}")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
