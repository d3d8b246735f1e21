"""gRPC fuzzing at depth: every RPC of every bcstack.v1 service against real processes, with many
more examples than `tests/test_grpc_fuzz.py` runs in `make test`.

    python bench/fuzz_grpc.py [--examples 2000] [--garbage 500] [--only RetrievalService.Search ...]
                              [--seed 0] [--kit DIR] [--work DIR] [--results FILE] [--dirty-ok]

The stack is `devkit.fuzzstack.stack_layout`, the one the HTTP fuzzing and the test suite use
(retrieval, the tiny-model and the scripted expert engines, worker, judge, the scripted
coordinator LLM, gateway; BCSTACK_ADMIN_TOKEN set) on a toy kit built like the test suite's
(`--kit` reuses one: a folder with world/, tiny/ and idx/). For each RPC (from the service
descriptors) it sends `--examples` Hypothesis-generated requests and `--garbage` raw byte strings,
counts the status codes, and stops that RPC at the first call that ends with a code outside
`devkit.grpcfuzz.ALLOWED_CODES` or an answer that does not parse (the finding, shrunk by
Hypothesis, goes in the report). After each RPC the process must be alive and answer a
known-good request. Random (not derandomized) unless --seed is given.

The tables go to bench/results/fuzz_grpc.md (--results): command, `git rev-parse HEAD` and `git
status --porcelain`, machine, date, and per RPC the examples, calls, seconds, the count of each
status code and the findings; from a checkout with uncommitted changes only with --dirty-ok (the
report then says DIRTY). Exit status 1 when anything was found.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
import grpc  # noqa: E402
from common import Table, free_port, print_machine, process, require_clean_tree, write_results  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import seed as hypothesis_seed  # noqa: E402

from core.kit.grpc_server import sync_channel  # noqa: E402
from devkit.fuzzstack import STACK_ENV, stack_layout  # noqa: E402
from devkit.grpcfuzz import (  # noqa: E402
    ALLOWED_CODES,
    Rpc,
    all_rpcs,
    call,
    garbage_bytes,
    known_good,
    message_strategy,
    parse_response,
    world_hints,
)

CALL_TIMEOUT_S = 120.0


def build_kit(kit: Path) -> None:
    """The test suite's toy kit (tests/conftest.py `toy_kit`): 500 documents, seed 5, the tiny
    model and the index."""
    import subprocess

    from devkit.modelkit.build import build_tiny_kit
    from devkit.toyworld.generator import generate_world, write_world

    if (kit / "idx").exists():
        return
    print(f"building the toy kit in {kit} ...", flush=True)
    write_world(generate_world(500, 5, questions_per_tier=8, train_medium=0, train_hard=0), kit / "world")
    build_tiny_kit(kit / "tiny")
    subprocess.run(
        [sys.executable, "-m", "bcstack", "index", "--corpus", str(kit / "world" / "corpus.jsonl"),
         "--index-dir", str(kit / "idx")],
        check=True, capture_output=True,
    )  # fmt: skip


def fuzz_one(rpc: Rpc, strategy, channel: grpc.Channel, examples: int, seed: int | None) -> dict:
    """Run `examples` of `strategy` against `rpc`; the codes seen, the calls, the seconds, a finding."""
    codes: Counter = Counter()
    samples: dict[str, str] = {}  # code -> the first details seen with it

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def fuzz(payload) -> None:
        data = payload if isinstance(payload, bytes) else payload.SerializeToString()
        outcome = call(channel, rpc, data, timeout=CALL_TIMEOUT_S)
        codes[outcome.code.name] += 1
        samples.setdefault(outcome.code.name, outcome.details[:160])
        assert outcome.allowed, f"{outcome.code.name}: {outcome.details[:500]!r} to {data[:200]!r}"
        for answer in outcome.responses:
            parse_response(rpc, answer)

    if seed is not None:
        fuzz = hypothesis_seed(seed)(fuzz)
    started = time.perf_counter()
    finding = ""
    try:
        fuzz()
    except Exception as exc:  # the shrunk falsifying example, reported and not raised
        finding = f"{type(exc).__name__}: {exc}".splitlines()[0][:600]
    return {"codes": codes, "samples": samples, "seconds": time.perf_counter() - started, "finding": finding}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--examples", type=int, default=2000, help="generated requests per RPC (default 2000)"
    )
    parser.add_argument("--garbage", type=int, default=500, help="raw byte strings per RPC (default 500)")
    parser.add_argument("--only", nargs="*", default=None, metavar="RPC", help="e.g. RetrievalService.Search")
    parser.add_argument("--seed", type=int, default=None, help="Hypothesis seed (default: random)")
    parser.add_argument(
        "--kit", type=Path, default=None, help="toy kit folder (world/, tiny/, idx/); built if missing"
    )
    parser.add_argument(
        "--work", type=Path, default=None, help="logs, gateway config and records (default: a temp dir)"
    )
    parser.add_argument(
        "--results", type=Path, default=None, help="report path (default bench/results/fuzz_grpc.md)"
    )
    parser.add_argument("--dirty-ok", action="store_true", help="write the report from uncommitted changes")
    args = parser.parse_args()

    rpcs = [r for r in all_rpcs() if args.only is None or r.id in args.only]
    unknown = set(args.only or ()) - {r.id for r in rpcs}
    if unknown:
        parser.error(
            f"no such RPC: {', '.join(sorted(unknown))} (known: {', '.join(r.id for r in all_rpcs())})"
        )
    print("machine:")
    print_machine()
    require_clean_tree("fuzz_grpc", args.dirty_ok)  # before the run, not after it
    print(f"  date      {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}")
    os.environ.update(STACK_ENV)  # every process of the stack inherits it
    work = args.work or Path(tempfile.mkdtemp(prefix="bcstack-fuzz-grpc-"))
    work.mkdir(parents=True, exist_ok=True)
    kit = args.kit or work / "kit"
    build_kit(kit)
    layout = stack_layout(kit, work, free_port)
    hints = world_hints(kit / "world")
    import json

    question = json.loads((kit / "world" / "questions.jsonl").read_text().splitlines()[0])
    print(
        f"{len(rpcs)} RPCs x ({args.examples} generated + {args.garbage} garbage); logs in {work}", flush=True
    )

    rows, findings = [], []
    with contextlib.ExitStack() as stack:
        procs = {
            p.name: stack.enter_context(process(p.args, p.health_url, work / f"{p.name}.log")) for p in layout
        }
        serving = {name: p for p in layout for name in p.grpc_services}
        channels = {p.grpc_target: stack.enter_context(sync_channel(p.grpc_target)) for p in serving.values()}
        for rpc in rpcs:
            target = serving.get(rpc.service)
            if target is None:
                findings.append(f"{rpc.id}: no process of devkit.fuzzstack.stack_layout serves {rpc.service}")
                continue
            channel = channels[target.grpc_target]
            for kind, strategy, n in (
                ("generated", message_strategy(rpc.request, hints=hints), args.examples),
                ("garbage", garbage_bytes(), args.garbage),
            ):
                if n <= 0:
                    continue
                result = fuzz_one(rpc, strategy, channel, n, args.seed)
                alive = procs[target.name].poll() is None
                after = ""
                try:
                    if alive:
                        known_good(rpc.service, channel, question)
                except Exception as exc:
                    after = f"known-good request failed after fuzzing: {exc}"[:300]
                if not alive:
                    after = (
                        f"{target.name} exited {procs[target.name].returncode}; see {work / target.name}.log"
                    )
                codes = result["codes"]
                calls = sum(codes.values())
                found = "; ".join(x for x in (result["finding"], after) if x)
                if found:
                    findings.append(f"{rpc.id} ({kind}): {found}")
                print(
                    f"{rpc.id:38s} {kind:9s} {calls:6d} calls {result['seconds']:7.1f} s  {dict(codes)}"
                    + "".join(f"\n    {k}: {v}" for k, v in result["samples"].items() if k != "OK")
                    + (f"\n    FOUND: {found}" if found else ""),
                    flush=True,
                )
                other = sum(v for k, v in codes.items() if grpc.StatusCode[k] not in ALLOWED_CODES)
                rows.append([
                    rpc.id, kind, n, calls, round(result["seconds"], 2),
                    round(1000 * result["seconds"] / max(calls, 1), 2),
                    *(codes.get(c.name, 0) for c in ALLOWED_CODES), other, found or "none",
                ])  # fmt: skip

    table = Table(
        "Calls per RPC and their status codes",
        ["RPC", "kind", "examples", "calls", "seconds", "ms per call",
         *(c.name for c in ALLOWED_CODES), "other", "finding"],
        rows,
        notes=[
            "calls >= examples: Hypothesis also replays and shrinks. 'other' counts codes outside "
            "devkit.grpcfuzz.ALLOWED_CODES (UNKNOWN, INTERNAL, DEADLINE_EXCEEDED, ...): each is a finding.",
        ],
    )  # fmt: skip
    extra = {"seed": str(args.seed) if args.seed is not None else "random", "findings": str(len(findings))}
    path = write_results("fuzz_grpc", [table], extra, args.results, dirty_ok=args.dirty_ok)
    print(f"\n{len(findings)} finding(s); report: {path}")
    for f in findings:
        print(f"  - {f}")
    return 1 if findings else 0


if __name__ == "__main__":
    raise SystemExit(main())
