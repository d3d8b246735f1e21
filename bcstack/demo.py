"""`make demo`: the main job on embedded defaults, start to finish, on one CPU machine.

1. `bcstack up` with the scripted expert worker: builds the toy world (2,000 documents, 150 test
   questions: 50 easy, 50 medium, 50 hard), the tiny Qwen3 model and the indexes when missing,
   and starts retrieval, the engine, the worker, the scripted coordinator LLM, the coordinator
   gateway and the rule-based judge as processes.
2. An evaluation round over all 150 questions with the expert worker.
3. The stack again with the untrained tiny model as the worker, over the same 150 questions. An
   untrained model writes until its budget runs out, and the tiny model decodes a few hundred
   tokens per second per sequence on this CPU (the CPU engine batches 16), so this round runs
   with a small worker budget and one branch per question: as many tokens as the expert's longest
   trajectory (so a perfect model would fit), 8 turns; the output says so. It answers none of
   them, so 10 questions of each tier show that as well as 50 would, in a fifth of the time
   (`--sample-per-tier 50` for all 150).
4. Both seed-001 tables, the paired comparison on the sampled questions, the PNGs, the
   /metrics URLs; then `bcstack down`.

    python -m bcstack.demo [--state .bcstack-demo] [--sample-per-tier 10] [--tiny-max-tokens N]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from bcstack.evaluation.cli import run_with_progress
from bcstack.evaluation.loaders import TIERS, EvalQuestion, load_questions
from bcstack.evaluation.report import build_report, render_markdown, write_report
from bcstack.stack import StackError, down, read_state, up
from core import budget
from trainer.data import longest_trajectory


def sample(questions: list[EvalQuestion], per_tier: int) -> list[EvalQuestion]:
    """The first `per_tier` questions of each tier, in file order."""
    taken = {tier: 0 for tier in TIERS}
    chosen = []
    for q in questions:
        if q.tier in taken and taken[q.tier] < per_tier:
            taken[q.tier] += 1
            chosen.append(q)
    return chosen


def _stage(text: str, t0: float) -> None:
    print(f"\n== {text}  [{time.monotonic() - t0:5.0f} s]", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--state", type=Path, default=Path(".bcstack-demo"), help="working folder (kept)")
    parser.add_argument("--docs", type=int, default=2000, help="toy world documents")
    parser.add_argument(
        "--sample-per-tier",
        type=int,
        default=10,
        help="questions per tier for the untrained tiny model (50: all 150; it answers none, and each "
        "takes about 9 s of the 2 cores)",
    )
    parser.add_argument(
        "--tiny-max-tokens",
        type=int,
        default=None,
        help="tiny worker's episode token budget (default: the expert's longest trajectory, rounded up "
        "to 64)",
    )
    parser.add_argument("--tiny-max-turns", type=int, default=8, help="tiny worker's turns per episode")
    parser.add_argument("--concurrency", type=int, default=16, help="episodes in flight")
    args = parser.parse_args(argv)
    state: Path = args.state
    t0 = time.monotonic()
    results = {name: state / f"eval-{name}" for name in ("expert", "tiny")}
    try:
        if (info := read_state(state)) is not None and info.get("services"):
            down(state, say=lambda s: None)  # a demo interrupted earlier left its stack running
        for path in results.values():
            shutil.rmtree(path, ignore_errors=True)

        _stage(
            "1/4 the stack with the scripted expert worker (builds the toy world, tiny model, indexes)", t0
        )
        info = up(state, worker="expert", docs=args.docs, questions_per_tier=50)
        questions = load_questions(state / "world" / "questions.jsonl")
        urls = {name: s["http"] for name, s in info["services"].items()}

        _stage(f"2/4 evaluation: expert worker, all {len(questions)} test questions", t0)
        run_with_progress(
            questions, results["expert"], urls["coordinator"], urls["judge"], concurrency=args.concurrency,
            label="expert",
        )  # fmt: skip
        down(state, say=lambda s: None)
        longest, _ = longest_trajectory(state / "records.sqlite")
        if args.tiny_max_tokens is None:
            # A perfect tiny model must fit: the budget is the expert's longest trajectory, not a guess.
            args.tiny_max_tokens = -(-longest // 64) * 64

        picked = sample(questions, args.sample_per_tier)
        which = (
            f"all {len(picked)} test questions"
            if len(picked) == len(questions)
            else f"a sample of {len(picked)} questions (the first {args.sample_per_tier} of each tier)"
        )
        _stage(
            f"3/4 evaluation: untrained tiny model, {which}; worker budget {args.tiny_max_tokens} tokens / "
            f"{args.tiny_max_turns} turns and one branch per question, not seed 001's "
            f"{budget.MAX_TOKENS:,} tokens / {budget.MAX_TURNS} turns: an untrained model spends its "
            "whole budget, too slow for a CPU demo",
            t0,
        )
        info = up(state, worker="tiny")
        urls = {name: s["http"] for name, s in info["services"].items()}
        run_with_progress(
            picked,
            results["tiny"],
            urls["coordinator"],
            urls["judge"],
            concurrency=args.concurrency,
            overrides={"max_branches": 1},
            budget={"max_tokens": args.tiny_max_tokens, "max_turns": args.tiny_max_turns},
            label="tiny",
        )

        _stage("4/4 results", t0)
        expert = build_report(results["expert"])
        write_report(expert, results["expert"], name="Scripted expert worker")
        print(render_markdown(expert, name="Scripted expert worker"))
        tiny = build_report(results["tiny"], baseline_dir=results["expert"])
        write_report(
            tiny, results["tiny"], name="Untrained tiny model", baseline_name="Scripted expert worker"
        )
        print(
            f"\nThe untrained tiny model ({which}, budget {args.tiny_max_tokens} tokens), paired with the "
            "expert on the same questions:\n"
        )
        print(render_markdown(tiny, name="Untrained tiny model", baseline_name="Scripted expert worker"))
        print(f"\nPNG: {results['expert'] / 'report.png'}  and  {results['tiny'] / 'report.png'}")
        print("Metrics while the stack runs (Prometheus text):")
        for name, url in urls.items():
            print(f"  {name:16s} {url}/metrics")
        print(
            f"Episode records: {urls['coordinator']}/v1/episodes/<episode_id>; "
            f"run files under {state}/eval-*/runs"
        )
    except StackError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if read_state(state) is not None:
            _stage("bcstack down", t0)
            down(state)
    print(f"\ndemo finished in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
