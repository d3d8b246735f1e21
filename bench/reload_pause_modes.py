"""Benchmark: a hot reload with requests in flight on the CPU engine, pausing `in_place` vs `retract`.

    python bench/reload_pause_modes.py [--requests 8] [--tokens 400] [--repeats 3] [--work DIR]
                                       [--results FILE] [--dirty-ok]

Two tiny Qwen3 kits (`devkit.modelkit`, seeds 0 and 1, built into --work once) and one CPU engine
in this process. Per run: REQUESTS greedy requests of TOKENS tokens (`ignore_eos`, distinct
prompts of 200 tokens) start together; once each has 50 tokens out, the reload sequence runs:
pause (mode) -> update_weights_from_disk (the other kit, `flush_cache` false) -> continue. Measured:
the seconds generation stayed paused, the seconds from continue until every in-flight request
has one more token (what retract adds: every KV recomputed), the KV tokens recomputed after the
swap, and whether every request finished with TOKENS tokens.
A last row tries what SGLang 0.5.19 refuses: `retract` and the update's own flush
(`flush_cache` true) with requests waiting: the engine goes down as SGLang's scheduler does.

This is the measurement behind the choice in services/worker/reload.py (in_place, flush_cache
false). Tables go to bench/results/reload_pause_modes.md (--results), with the command, commit,
machine and date; refused from a checkout with uncommitted changes unless --dirty-ok (the report
then says DIRTY)."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from common import Table, print_machine, require_clean_tree, write_results  # noqa: E402


def _kits(work: Path) -> tuple[Path, Path]:
    from devkit.modelkit.build import build_tiny_kit

    kits = []
    for seed in (0, 1):
        out = work / f"tiny-seed{seed}"
        if not (out / "config.json").is_file():
            build_tiny_kit(out, seed=seed)
        kits.append(out)
    return kits[0], kits[1]


async def _engine(model: Path) -> Any:
    from core.kit.metrics import new_registry
    from services.engine.core import EngineCore
    from services.engine.metrics import EngineMetrics
    from services.engine.settings import EngineSettings

    core = EngineCore(EngineSettings(model=model, max_running_requests=32), EngineMetrics(new_registry()))
    await core.start()
    return core


async def _one_run(
    core: Any, target: Path, version: str, mode: str, n: int, tokens: int, flush: bool
) -> dict:
    from services.engine import protocol as proto
    from services.engine.core import EngineUnavailable

    seqs = []
    for i in range(n):
        request = proto.GenerateRequest(
            rid=f"{version}-{i}",
            sampling=proto.SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True),
            input_ids=tuple((7 * i + j) % 500 + 10 for j in range(200)),
        )
        seqs.append(core.submit(request))
    while not all(len(s.output_ids) >= 50 for s in seqs):
        await asyncio.sleep(0.002)
    paused_at = time.perf_counter()
    await core.pause(mode)
    try:
        result = await core.update_weights_from_disk(str(target), weight_version=version, flush_cache=flush)
        ok = result.success
    except EngineUnavailable:
        ok = False
    if core.state != "ready":
        return {"paused_s": time.perf_counter() - paused_at, "ok": False, "engine": core.failure}
    before = {id(s): len(s.output_ids) for s in seqs}
    # The swap empties the prefix cache, so a retracted request recomputes the KV of its prompt and
    # of all its output but the last token; an in-place one keeps its KV.
    recomputed = sum(len(s.prompt_ids) + before[id(s)] - 1 for s in seqs) if mode == "retract" else 0
    core.resume()
    resumed_at = time.perf_counter()
    paused_s = resumed_at - paused_at
    while not all(s.finished or len(s.output_ids) > before[id(s)] for s in seqs):
        await asyncio.sleep(0.001)
    next_token_s = time.perf_counter() - resumed_at
    for s in seqs:
        await s.wait_finished()
    return {
        "paused_s": paused_s,
        "next_token_s": next_token_s,
        "recomputed": recomputed,
        "ok": ok and all(len(s.output_ids) == tokens for s in seqs),
        "engine": "ready",
    }


async def _bench(args: argparse.Namespace, a: Path, b: Path) -> list[Table]:
    rows = []
    for mode in ("in_place", "retract"):
        runs = []
        for r in range(args.repeats):
            core = await _engine(a)
            try:
                runs.append(await _one_run(core, b, f"v{r}", mode, args.requests, args.tokens, False))
            finally:
                await core.close()
        rows.append(
            [
                mode,
                "false",
                statistics.median(x["paused_s"] for x in runs),
                statistics.median(x["next_token_s"] for x in runs),
                statistics.median(x["recomputed"] for x in runs),
                all(x["ok"] for x in runs),
                "ready",
            ]
        )
    core = await _engine(a)
    try:
        crash = await _one_run(core, b, "vx", "retract", args.requests, args.tokens, True)
    finally:
        await core.close()
    rows.append(["retract", "true", crash["paused_s"], None, None, crash["ok"], crash["engine"]])
    columns = [
        "pause mode",
        "flush_cache",
        "paused s (median)",
        "continue -> next token s",
        "KV tokens recomputed",
        "all finished",
        "engine after",
    ]
    note = (
        f"{args.requests} requests x {args.tokens} tokens, reload after 50 tokens each; medians of "
        f"{args.repeats} runs; tiny Qwen3 on the CPU."
    )
    return [Table("Reload with requests in flight", columns, rows, (note,))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "bcstack-bench-reload")
    parser.add_argument("--results", type=Path, default=None)
    parser.add_argument("--dirty-ok", action="store_true", help="write the report from uncommitted changes")
    args = parser.parse_args()
    require_clean_tree("reload_pause_modes", args.dirty_ok)  # before the run, not after it
    print_machine()
    a, b = _kits(args.work)
    tables = asyncio.run(_bench(args, a, b))
    for table in tables:
        print(table.title)
        for row in table.rows:
            print("  ", dict(zip(table.columns, row, strict=True)))
    print("wrote", write_results("reload_pause_modes", tables, path=args.results, dirty_ok=args.dirty_ok))


if __name__ == "__main__":
    main()
