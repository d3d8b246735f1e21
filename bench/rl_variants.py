"""Benchmark: RL variants side by side, each from the same SFT model of a finished speedrun, each
judged on the held-out dev questions against that SFT model's own evaluation on them.

Variants are choices, and choices are made on the dev split: the test split is refused unless
`--final` is given (for a final report after the choice, read once).

    python bench/rl_variants.py --state .bcstack-speedrun \\
        --variant 'positive only=--lr 3e-5 --vector-lr-scale 300 --negative-advantage-scale 0' \\
        --variant 'seed GRPO=--lr 3e-5 --vector-lr-scale 300 --negative-advantage-scale 1' \\
        [--minutes 10] [--rounds 3] [--tiers easy] [--eval-seed N] [--work DIR] [--results FILE]
        [--dirty-ok] [--final]

A variant is NAME=FLAGS: FLAGS are `bcstack train rl` options added to the speedrun's own (its
`rl-questions.jsonl`, budget, worker settings and replicas, 8 groups x 8 episodes, dynamic
sampling, 4 steps per update, synchronous), later flags winning. Each variant, in turn: a fresh
stack serving the speedrun's SFT model, `bcstack train rl --max-minutes M`, then an evaluation of
its last export on the dev questions of --tiers for --rounds rounds through a fresh stack.
The comparison is paired with the SFT model's evaluation on the same questions and round numbers
(`STATE/eval-dev-sft`, the speedrun's own when it ran on dev, else made here once and kept; with
`--eval-seed N` the baseline and every variant are evaluated with one seed set, common random
numbers for the paired test, and a speedrun evaluation seeded otherwise is not reused):
improved/regressed pairs, Δ pp with Newcombe's interval, exact McNemar p, as
`bcstack eval report --baseline` computes them. Also per variant: updates, the KL to the SFT
model, the sampled tokens' mean negative log-prob (first three and last three updates; the
policy's entropy when rollouts sample at top-p 1.0), the success rate over every
sampled group (first three and last three), and how far the final norm gain (the output head's
scale) moved, the parameter through which a policy can sharpen every distribution at once.

Every variant runs alone on the machine (one after another), so their minutes buy comparable
numbers of updates; the table gives each one's updates. Results, with the command, commit and
machine, go to bench/results/rl_variants.md (--results); refused from a checkout with uncommitted
changes unless --dirty-ok (the report then says DIRTY).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from common import Table, print_machine, render_results, require_clean_tree, write_results  # noqa: E402

from bcstack.evaluation.loaders import load_questions  # noqa: E402
from bcstack.evaluation.report import build_report  # noqa: E402
from bcstack.speedrun import OBSERVATION_SETTINGS, _stack, _urls, evaluate  # noqa: E402
from bcstack.stack import down  # noqa: E402
from trainer.sinks import read_metrics  # noqa: E402

BASE_FLAGS = [
    "--groups", "8", "--group-size", "8", "--dynamic-sampling", "--steps-per-update", "4",
    "--max-policy-lag", "0", "--max-branches", "1", "--updates", "1000",
]  # fmt: skip


def _norm_gain(model: Path) -> float:
    """Mean of the final norm's gain (the output head's input scale)."""
    from safetensors import safe_open

    for path in sorted(model.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            if "model.norm.weight" in f.keys():  # noqa: SIM118 (safe_open has no __contains__)
                return float(f.get_tensor("model.norm.weight").float().mean())
    raise SystemExit(f"{model}: no model.norm.weight")


def _filtered(eval_dir: Path, keep: set[str], out: Path) -> Path:
    """`eval_dir`'s judgements of the `keep` query ids only, as an evaluation directory of its own."""
    out.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in (eval_dir / "judgements.jsonl").read_text().splitlines() if line]
    (out / "judgements.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows if r["query_id"] in keep)
    )
    runs = out / "runs"
    if not runs.exists():
        runs.symlink_to((eval_dir / "runs").resolve(), target_is_directory=True)
    return out


def held_out(world: Path, args: argparse.Namespace) -> list:
    """The questions of --tiers in the split the variants are judged on (dev; test with --final)."""
    path = world / ("questions.jsonl" if args.split == "test" else "dev.jsonl")
    if not path.is_file():
        raise SystemExit(
            f"{world} has no {path.name}: rerun the speedrun (a world from before the dev split)"
        )
    return [q for q in load_questions(path) if q.tier in args.tiers]


def _eval_seed(eval_dir: Path) -> int | None:
    """The --seed an evaluation directory was run with (None: fresh entropy, or no run yet)."""
    meta = eval_dir / "eval.json"
    return json.loads(meta.read_text()).get("seed") if meta.is_file() else None


def baseline_dir(state: Path, split: str, seed: int | None) -> Path:
    """Where the SFT baseline seeded with `seed` is (or goes): the speedrun's own evaluation when it
    has that seed, else one beside it named for the seed."""
    out = state / f"eval-{split}-sft"
    if (out / "judgements.jsonl").is_file() and _eval_seed(out) != seed:
        out = state / f"eval-{split}-sft-seed{seed}"
    return out


def sft_baseline(state: Path, args: argparse.Namespace) -> Path:
    """The SFT model on the held-out questions, --rounds rounds, made once: the speedrun's own
    STATE/eval-{split}-sft when it was seeded as --eval-seed asks, else STATE/eval-{split}-sft-seed{N}
    (each variant is evaluated with the baseline's seeds, so the paired test compares the models with
    common random numbers)."""
    out = baseline_dir(state, args.split, args.eval_seed)
    questions = held_out(state / "world", args)
    if (out / "judgements.jsonl").is_file():
        return out
    report = json.loads((state / "report.json").read_text())
    budget = {k: int(v) for k, v in report["settings"]["budget"].items()}
    replicas = int(report["settings"]["args"].get("replicas", 1))
    stack = Path(tempfile.mkdtemp(prefix="sft-baseline-", dir=args.work)) / "stack"
    info = _stack(stack, str(state / "sft" / "serving"), state / "world", state / "kit", state / "index",
                  dict(OBSERVATION_SETTINGS), replicas)  # fmt: skip
    try:
        evaluate("sft", _urls(info), questions, out, budget, 16, args.rounds, seed=args.eval_seed)
    finally:
        down(stack, say=lambda _s: None)
    return out


def run_variant(
    state: Path, name: str, flags: list[str], args: argparse.Namespace, work: Path, baseline: Path
) -> dict:
    report = json.loads((state / "report.json").read_text())
    budget = {k: int(v) for k, v in report["settings"]["budget"].items()}
    replicas = int(report["settings"]["args"].get("replicas", 1))
    settings = dict(OBSERVATION_SETTINGS)
    sft = state / "sft" / "serving"
    world, kit, index = state / "world", state / "kit", state / "index"
    out = Path(tempfile.mkdtemp(prefix="variant-", dir=work))
    stack = out / "stack"
    rl_out = stack / "train" / "rl"
    started = time.monotonic()
    _stack(stack, str(sft), world, kit, index, settings, replicas)
    command = [
        sys.executable, "-m", "bcstack", "train", "rl", "--state", str(stack),
        "--questions", str(state / "rl-questions.jsonl"), "--model", str(sft), "--ref", str(sft),
        "--out", str(rl_out), "--max-minutes", str(args.minutes),
        "--micro-batch-tokens", str(budget["max_tokens"]), "--worker-max-tokens", str(budget["max_tokens"]),
        "--worker-max-turns", str(budget["max_turns"]), *BASE_FLAGS, *flags,
    ]  # fmt: skip
    print(f"\n== {name}: {shlex.join(command[2:])}", flush=True)
    result = subprocess.run(command, check=False)
    rl_seconds = time.monotonic() - started
    exports = sorted((rl_out / "exports").glob("u*"))
    metrics = read_metrics(rl_out) if (rl_out / "metrics.jsonl").is_file() else []
    if result.returncode != 0 or not exports or not metrics:
        down(stack, say=lambda _s: None)
        raise SystemExit(f"{name}: train rl failed (exit {result.returncode}); see above")
    model = exports[-1]
    questions = held_out(world, args)
    info = _stack(stack, str(model), world, kit, index, settings, replicas)
    try:
        evaluate(name, _urls(info), questions, out / "eval", budget, 16, args.rounds, seed=args.eval_seed)
    finally:
        down(stack, say=lambda _s: None)
    keep = {q.query_id for q in questions}
    paired = build_report(out / "eval", _filtered(baseline, keep, out / "eval-sft")).paired
    nll = [m.get("sampled_token_nll", m.get("entropy", 0.0)) for m in metrics]
    sampled = [m.get("sampled_reward_mean", m["reward_mean"]) for m in metrics]
    return {
        "name": name,
        "flags": shlex.join(flags),
        "updates": len(metrics),
        "rl_seconds": rl_seconds,
        "kl": metrics[-1]["kl"],
        "nll": (statistics.fmean(nll[:3]), statistics.fmean(nll[-3:])),
        "sampled": (statistics.fmean(sampled[:3]), statistics.fmean(sampled[-3:])),
        "gain": (_norm_gain(sft), _norm_gain(model)),
        "paired": paired,
        "correct": sum(
            1
            for line in (out / "eval" / "judgements.jsonl").read_text().splitlines()
            if json.loads(line)["correct"] is True
        ),  # fmt: skip
        "total": paired["n"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--state", type=Path, default=Path(".bcstack-speedrun"), help="a finished speedrun")
    parser.add_argument("--variant", action="append", required=True, help="NAME=FLAGS (repeatable)")
    parser.add_argument("--minutes", type=float, default=10.0, help="RL minutes per variant")
    parser.add_argument("--rounds", type=int, default=3, help="evaluation rounds (at most the SFT model's)")
    parser.add_argument("--tiers", default="easy", help="held-out tiers to evaluate, comma-separated")
    parser.add_argument("--work", type=Path, default=None, help="where the variants' runs go")
    parser.add_argument("--results", type=Path, default=None, help="results file")
    parser.add_argument("--dirty-ok", action="store_true", help="write the report from uncommitted changes")
    parser.add_argument(
        "--final",
        action="store_true",
        help="judge on the test split (default: dev); only for the final report of a choice already made",
    )
    parser.add_argument(
        "--eval-seed",
        type=int,
        default=None,
        help="seed the SFT baseline's and every variant's evaluation from this (bcstack eval run --seed): "
        "common random numbers for the paired tests (default: the seed of the speedrun's SFT evaluation)",
    )
    args = parser.parse_args()
    args.tiers = {t.strip() for t in args.tiers.split(",") if t.strip()}
    args.split = "test" if args.final else "dev"
    state = args.state.resolve()
    if not (state / "report.json").is_file() or not (state / "sft" / "serving").is_dir():
        parser.error(f"--state {state}: not a finished speedrun (no report.json or SFT model)")
    variants = []
    for spec in args.variant:
        name, sep, flags = spec.partition("=")
        if not sep or not name.strip():
            parser.error(f"--variant takes NAME=FLAGS, got {spec!r}")
        variants.append((name.strip(), shlex.split(flags)))
    require_clean_tree("rl_variants", args.dirty_ok)  # before the run, not after it
    print("machine:")
    print_machine()
    work = args.work = args.work or Path(tempfile.mkdtemp(prefix="bench-rl-variants-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.eval_seed is None:
        args.eval_seed = _eval_seed(state / f"eval-{args.split}-sft")
    baseline = sft_baseline(state, args)
    results = [run_variant(state, name, flags, args, work, baseline) for name, flags in variants]

    rows = []
    for r in results:
        p = r["paired"]
        rows.append([
            r["name"], r["flags"], r["updates"], round(r["rl_seconds"]), r["kl"], list(r["nll"]),
            list(r["sampled"]), list(r["gain"]), f"{r['correct']}/{r['total']}",
            p["improved"], p["regressed"], p["delta_pp"], list(p["delta_ci_pp"]), p["mcnemar_p"],
        ])  # fmt: skip
    table = Table(
        title=f"RL variants from the SFT model of {state}, {args.split} split "
        f"({', '.join(sorted(args.tiers))}), "
        f"{args.rounds} round(s), paired with the SFT model's evaluation"
        + (f" (both seeded from {args.eval_seed})" if args.eval_seed is not None else ""),
        columns=["variant", "train rl flags (beside the speedrun's)", "updates", "RL s", "final KL",
                 "sampled-token NLL first 3 → last 3", "sampled reward first 3 → last 3",
                 "norm gain SFT → RL",
                 "held-out correct", "improved", "regressed", "Δ pp", "paired 95% CI (pp)", "McNemar p"],
        rows=rows,
        notes=[f"Every variant: {shlex.join(BASE_FLAGS)} and the speedrun's budget, questions and replicas; "
               f"{args.minutes:g} RL minutes each, run one after another."],
    )  # fmt: skip
    print(render_results("rl_variants", [table]))
    print(f"results: {write_results('rl_variants', [table], path=args.results, dirty_ok=args.dirty_ok)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
