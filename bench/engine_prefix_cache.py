"""Benchmark: the CPU engine's prefix cache off vs on, on worker-like multi-turn episodes.

    python bench/engine_prefix_cache.py [--scenarios 16:4:300:48,8:8:1000:48] [--system-tokens 256]
                                        [--question-tokens 64] [--repeats 3]
                                        [--work DIR] [--json FILE] [--results FILE] [--dirty-ok]

Two engine processes (`bcstack serve engine`) serve the same tiny Qwen3 (`devkit.modelkit`, built
into --work once) on this machine: one with `--prefix-cache-tokens 0` (off), one with the default
budget (on). A scenario EPISODES:TURNS:OBS_TOKENS:NEW_TOKENS drives EPISODES episodes at once
against one engine, as a worker with that many episodes in flight does: an episode's first request
is a system prompt shared by all episodes plus its own question; every later request is the whole
trajectory so far (the previous request, its output, then OBS_TOKENS of observation), so without
the cache every turn prefills everything again. Every turn generates exactly NEW_TOKENS tokens
(`ignore_eos`; the worker's sampling, temperature 1.0, top-p 0.95, a fixed seed per episode and
turn). Token ids are random (seeded): the tiny model's speed does not depend on what they say.
The first default scenario is the issue's (16 x 4 turns, +300 tokens a turn); the second has
longer trajectories (up to ~7,700 tokens), where the re-prefill the cache saves grows.

The variants take turns (off, on, on, off, ...) so background load hits them alike; the cache is
flushed (`POST /flush_cache`) before each run, so every run starts cold. Per run, from the engine's
/metrics and the client: wall seconds for all episodes, prompt tokens sent, computed (prefilled)
and taken from the cache, generated tokens, tokens/s, the mean time to first token and the engine
process's CPU seconds. Ratios compare each variant's median with off's. Every run also checks what
the cache must not change: each turn's output tokens equal to the first off run's (seeded
sampling, so the same logits give the same draws) and the largest log-prob difference.

The tables, with the command, commit, machine and date, go to bench/results/engine_prefix_cache.md
(--results); refused from a checkout with uncommitted changes unless --dirty-ok (the report then
says DIRTY)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

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

ADMIN_TOKEN = "bench-admin-token"
VARIANTS: dict[str, list[str]] = {"off": ["--prefix-cache-tokens", "0"], "on": []}  # on: the default
VOCAB_LOW, VOCAB_HIGH = 10, 4000  # ordinary token ids of the tiny tokenizer
COUNTERS = (
    "bcstack_engine_prompt_tokens_total",
    "bcstack_engine_computed_prompt_tokens_total",
    "bcstack_engine_cached_prompt_tokens_total",
    "bcstack_engine_generation_tokens_total",
)
TTFT = "bcstack_engine_time_to_first_token_seconds"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far, all its threads (Linux /proc), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in COUNTERS:
            values[name] = float(value)
    return values


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


@dataclass(frozen=True)
class Scenario:
    episodes: int  # in flight at once
    turns: int  # requests per episode
    obs_tokens: int  # observation tokens appended after each turn but the last
    new_tokens: int  # generated per turn

    @classmethod
    def parse(cls, text: str) -> Scenario:
        try:
            episodes, turns, obs, new = (int(x) for x in text.split(":"))
        except ValueError:
            raise SystemExit(f"bad scenario {text!r}: want EPISODES:TURNS:OBS_TOKENS:NEW_TOKENS") from None
        return cls(episodes, turns, obs, new)

    @property
    def name(self) -> str:
        return f"{self.episodes} x {self.turns} turns, +{self.obs_tokens} obs, {self.new_tokens} new"


def episodes_plan(scenario: Scenario, system_tokens: int, question_tokens: int) -> list[dict[str, Any]]:
    """The same episodes for every run: prompt and per-turn observation ids, per-turn seeds."""
    rng = random.Random(0)
    system = tokens(rng, system_tokens)
    return [
        {
            "prompt": system + tokens(rng, question_tokens),
            "observations": [tokens(rng, scenario.obs_tokens) for _ in range(scenario.turns - 1)],
            "seeds": [1000 * e + t for t in range(scenario.turns)],
        }
        for e in range(scenario.episodes)
    ]


async def run_episode(client: httpx.AsyncClient, url: str, plan: dict, new_tokens: int) -> list[dict]:
    ids, turns = list(plan["prompt"]), []
    for t, seed in enumerate(plan["seeds"]):
        body = {
            "input_ids": ids,
            "sampling_params": {
                "max_new_tokens": new_tokens,
                "temperature": 1.0,
                "top_p": 0.95,
                "ignore_eos": True,
                "sampling_seed": seed,
            },
            "return_logprob": True,
        }
        start = time.perf_counter()
        response = await client.post(url + "/generate", json=body)
        response.raise_for_status()
        out = response.json()
        meta = out["meta_info"]
        turns.append(
            {
                "prompt_tokens": meta["prompt_tokens"],
                "cached_tokens": meta["cached_tokens"],
                "output_ids": out["output_ids"],
                "logprobs": [e[0] for e in meta["output_token_logprobs"]],
                "latency_s": time.perf_counter() - start,
            }
        )
        if t < len(plan["observations"]):
            ids = ids + out["output_ids"] + plan["observations"][t]
    return turns


async def drive(url: str, plans: list[dict], new_tokens: int) -> tuple[float, list[list[dict]]]:
    limits = httpx.Limits(max_connections=len(plans) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(run_episode(client, url, p, new_tokens) for p in plans))
        return time.perf_counter() - start, list(results)


def measure(engine: dict, plans: list[dict], new_tokens: int) -> dict:
    url = engine["url"]
    flushed = httpx.post(url + "/flush_cache", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30)
    flushed.raise_for_status()
    before, ttft_before, cpu_before = counters(url), histogram(url, TTFT), cpu_seconds(engine["pid"])
    wall, episodes = asyncio.run(drive(url, plans, new_tokens))
    after, ttft_after, cpu_after = counters(url), histogram(url, TTFT), cpu_seconds(engine["pid"])
    delta = {name: after[name] - before[name] for name in COUNTERS}
    ttft_n = ttft_after[2] - ttft_before[2]
    return {
        "wall_s": wall,
        "prompt_tokens": delta["bcstack_engine_prompt_tokens_total"],
        "computed_prompt_tokens": delta["bcstack_engine_computed_prompt_tokens_total"],
        "cached_prompt_tokens": delta["bcstack_engine_cached_prompt_tokens_total"],
        "generated_tokens": delta["bcstack_engine_generation_tokens_total"],
        "ttft_mean_ms": (ttft_after[1] - ttft_before[1]) / ttft_n * 1e3 if ttft_n else float("nan"),
        "engine_cpu_s": cpu_after - cpu_before,
        "episodes": episodes,
    }


def compare(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per variant: turns whose output ids differ from the first off run's, and the largest
    log-prob difference among the turns whose ids agree (the first off run itself included)."""
    reference = runs["off"][0]["episodes"]
    check = {}
    for variant, variant_runs in runs.items():
        differing, turns, max_diff = 0, 0, 0.0
        for run in variant_runs:
            for ref_episode, episode in zip(reference, run["episodes"], strict=True):
                for ref, turn in zip(ref_episode, episode, strict=True):
                    turns += 1
                    if ref["output_ids"] != turn["output_ids"]:
                        differing += 1
                        continue
                    diffs = (abs(a - b) for a, b in zip(ref["logprobs"], turn["logprobs"], strict=True))
                    max_diff = max(max_diff, *diffs)
        check[variant] = {"turns": turns, "differing": differing, "max_logprob_diff": max_diff}
    return check


MAIN_COLUMNS = [
    "scenario",
    "prefix cache",
    "wall s (median)",
    "wall s per run",
    "prompt tokens",
    "computed prompt tokens",
    "cached prompt tokens",
    "generated tokens",
    "prompt+generated tokens/s",
    "generated tokens/s",
    "time to first token mean ms",
    "engine CPU s",
    "speed-up vs off (wall)",
    "computed prompt tokens ÷ off",
    "turns differing from off",
    "max log-prob diff",
]


def main_rows(scenario: Scenario, runs: dict[str, list[dict]], check: dict) -> list[list[Any]]:
    rows = []
    medians = {v: statistics.median(r["wall_s"] for r in rs) for v, rs in runs.items()}
    computed = {v: statistics.median(r["computed_prompt_tokens"] for r in rs) for v, rs in runs.items()}
    for variant, variant_runs in runs.items():
        best = min(variant_runs, key=lambda r: abs(r["wall_s"] - medians[variant]))  # the median run
        served = best["prompt_tokens"] + best["generated_tokens"]
        rows.append(
            [
                scenario.name,
                variant,
                medians[variant],
                [r["wall_s"] for r in variant_runs],
                best["prompt_tokens"],
                best["computed_prompt_tokens"],
                best["cached_prompt_tokens"],
                best["generated_tokens"],
                served / best["wall_s"],
                best["generated_tokens"] / best["wall_s"],
                best["ttft_mean_ms"],
                best["engine_cpu_s"],
                medians["off"] / medians[variant],
                computed[variant] / computed["off"],
                f"{check[variant]['differing']} of {check[variant]['turns']}",
                check[variant]["max_logprob_diff"],
            ]
        )
    return rows


def per_turn_table(scenario: Scenario, runs: dict[str, list[dict]]) -> Table:
    rows = []
    for t in range(scenario.turns):
        row: list[Any] = [t + 1]
        for variant in runs:
            turns = [ep[t] for run in runs[variant] for ep in run["episodes"]]
            if variant == "off":
                row.append(statistics.mean(x["prompt_tokens"] for x in turns))
            row += [
                statistics.mean(x["cached_tokens"] for x in turns),
                statistics.mean(x["latency_s"] for x in turns) * 1e3,
            ]
        rows.append(row)
    columns = ["turn", "prompt tokens (mean)"]
    for variant in runs:
        columns += [f"{variant}: cached tokens (mean)", f"{variant}: request latency ms (mean)"]
    return Table(f"Per turn: {scenario.name} (all runs)", columns, rows)


DEFAULT_SCENARIOS = "16:4:300:48,8:8:1000:48"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--scenarios",
        default=DEFAULT_SCENARIOS,
        help="EPISODES:TURNS:OBS_TOKENS:NEW_TOKENS, comma-separated (episodes run at once)",
    )
    parser.add_argument("--system-tokens", type=int, default=256, help="system prompt shared by all episodes")
    parser.add_argument("--question-tokens", type=int, default=64, help="each episode's own prompt tokens")
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant and scenario (alternating)")
    parser.add_argument(
        "--work", type=Path, default=Path(tempfile.gettempdir()) / "bcstack-bench-prefix-cache"
    )
    parser.add_argument("--json", type=Path, help="also write the raw numbers here")
    parser.add_argument(
        "--results", type=Path, default=RESULTS_DIR / "engine_prefix_cache.md", help="results file"
    )
    parser.add_argument("--dirty-ok", action="store_true", help="write the report from uncommitted changes")
    args = parser.parse_args()
    scenarios = [Scenario.parse(x) for x in args.scenarios.split(",") if x.strip()]
    require_clean_tree("engine_prefix_cache", args.dirty_ok)  # before the run, not after it
    args.work.mkdir(parents=True, exist_ok=True)

    print("engine prefix cache benchmark")
    print_machine()
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    model = args.work / "tiny"
    if not (model / "config.json").is_file():
        from devkit.modelkit.build import build_tiny_kit

        build_tiny_kit(model)
    os.environ["BCSTACK_ADMIN_TOKEN"] = ADMIN_TOKEN  # the engines inherit it: /flush_cache is admin
    results: list[tuple[Scenario, dict[str, list[dict]], dict[str, dict]]] = []
    with contextlib.ExitStack() as stack:
        engines = {}
        for variant, flags in VARIANTS.items():
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            command = ["serve", "engine", "--model", str(model), "--port", str(port), *flags]
            command += ["--max-running-requests", str(max(s.episodes for s in scenarios))]
            log = args.work / f"engine-{variant}.log"
            proc = stack.enter_context(process(command, url + "/health", log))
            engines[variant] = {"url": url, "pid": proc.pid}
            warm = episodes_plan(Scenario(2, 2, 16, 4), args.system_tokens, args.question_tokens)
            asyncio.run(drive(url, warm, 4))  # first forward passes, connections
        order = list(VARIANTS)
        for scenario in scenarios:
            plans = episodes_plan(scenario, args.system_tokens, args.question_tokens)
            runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
            for rep in range(args.repeats):
                for variant in order if rep % 2 == 0 else order[::-1]:
                    run = measure(engines[variant], plans, scenario.new_tokens)
                    runs[variant].append(run)
                    print(
                        f"  {scenario.name}, run {rep + 1}, cache {variant}: {run['wall_s']:.2f} s, "
                        f"computed prompt tokens {run['computed_prompt_tokens']:.0f}, "
                        f"cached {run['cached_prompt_tokens']:.0f}",
                        flush=True,
                    )
            results.append((scenario, runs, compare(runs)))
    load_after = os.getloadavg()
    out = [
        Table(
            f"Multi-turn episodes, prefix cache off vs on ({args.repeats} runs each)",
            MAIN_COLUMNS,
            [row for scenario, runs, check in results for row in main_rows(scenario, runs, check)],
            notes=[
                "Scenario: episodes at once x turns, observation tokens appended per turn, tokens "
                f"generated per turn. Every episode starts with {args.system_tokens} system tokens "
                f"shared by all and {args.question_tokens} of its own. Token counts, tokens/s, time to "
                "first token and CPU are the median-wall run's; prompt tokens count every token sent "
                "(each turn resends the trajectory). Turns differing: output ids unlike the first "
                "off run's, over all runs of the variant.",
            ],
        ),
        *(per_turn_table(scenario, runs) for scenario, runs, _ in results),
    ]
    import torch

    extra = {
        "torch": torch.__version__,
        "engine": "1 torch thread (the engine's default below 100M parameters), max_running_requests "
        f"{max(s.episodes for s in scenarios)}",
        "load average (1 min)": f"{load_before[0]:.2f} before, {load_after[0]:.2f} after",
        "wall time": f"{time.perf_counter() - t0:.0f} s",
    }
    print()
    print(render_results("engine_prefix_cache", out, extra))
    if args.json:
        raw = [
            {
                "scenario": scenario.__dict__,
                "check": check,
                "runs": {
                    v: [{k: x for k, x in r.items() if k != "episodes"} for r in rs] for v, rs in runs.items()
                },
            }
            for scenario, runs, check in results
        ]
        args.json.write_text(json.dumps({"machine": machine(), "results": raw}, indent=2))
    path = write_results("engine_prefix_cache", out, extra, path=args.results, dirty_ok=args.dirty_ok)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
