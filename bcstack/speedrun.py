"""`make speedrun`: the CPU learning proof. A tiny worker from nothing to answering held-out questions.

Every stage runs through the live stack (`bcstack up`: retrieval, engine, worker, scripted coordinator
LLM, gateway, rule judge as processes) and prints its seconds on a timeline:

1. world    one toy world (`--world-seed`) with a test split and a dev split (50 questions per tier each,
            page-disjoint from each other and from train) and a large train split
            (`--train-easy` plus medium and hard) whose questions read no page a test question reads,
            and `--rl-easy` more easy questions (and `--rl-medium`, `--rl-hard` ones) kept for RL alone (SFT
            never sees them); the tiny kit
            (its tokenizer is trained on the fixed toy text, so it serves any world, and keeps a year
            whole, `--number-digits`; the model is bigger than the demo's: `--hidden-size`,
            `--layers`); a lexical-only index (`--dense none`: the dense embedder is ~55 ms per
            document here);
2. collect  the scripted expert answers every SFT train question through the stack (`expert-snippets`:
            it takes a fact from a search snippet when the snippet states it, and writes names as it
            read them, so what it does can be learnt by copying); the records are
            exported (JSONL, not a copy of the live SQLite file) and become SFT samples with their
            exact token ids and masks; gate rows are made from them (core/gate.py);
3. copy     a copy-inducing stage (trainer/copy_stage.py): spans followed by themselves (random ids,
            and windows of the tokenizer's fixed toy text, a world no stack evaluates on), so the
            model from scratch learns to copy from its context before it learns the job;
4. sft      `trainer.sft` on the token-balanced mixture: expert trajectories x `--core-repeat` and gate
            rows sampled to `--gate-fraction` of their supervised tokens; settings scaled for a model
            trained from scratch (LR, batch), printed;
5. eval     the untrained model and the SFT model on the 150 held-out questions through the stack: the dev
            split, or with `--final` the test split (read once, for the final report: every choice is
            made on dev first),
            under one worker budget sized from the expert's trajectories (`--budget-factor` x the longest);
            the SFT (and RL) model for `--eval-rounds` rounds per question, the untrained one for one;
            with `--eval-seed N` every stage samples with one seed set (`bcstack eval run --seed`), so
            the paired tests compare the models with common random numbers (`--eval-seed-check`
            evaluates the RL model once more with N + 1 and reports both tests; N is 0 unless told);
6. rl       `bcstack train rl` from the SFT model on the `--rl-easy` questions (the `--rl-medium` ones,
            and SFT's train questions of any other tier in `--rl-tiers`), the workers hot-reloaded after
            each update, for `--rl-minutes` (or `--rl-updates`, the minutes then a cap); then the RL
            model is evaluated the same way;
7. report   one table in seed 001's shape with three rows (untrained, SFT, SFT + RL), Wilson intervals,
            the paired comparisons (SFT vs untrained, RL vs SFT: improved/regressed, Δ pp with Newcombe's
            paired interval, exact McNemar p over (question, round) pairs, and with several rounds the
            same comparison with questions as the units: Wilcoxon signed-rank, bootstrap interval), how
            each stage's rounds agree (right in most rounds, in any: what sharpening alone could gain), a
            PNG and `.bcstack-speedrun/report.json` (`make speedrun` runs this through bench/speedrun.py,
            which files them, with the commit, machine and date, in bench/results/speedrun.*).

The observation sizes (snippet words, hits shown, page words) are worker settings (`--worker-setting`
of `bcstack up`), stated in the output; no code path is special to the speedrun. Every stack runs
`--replicas` worker replicas (one per core by default): the CPU engine decodes on one core, and the
gateway spreads episodes over the replicas.

Two seeds: `--world-seed` makes the world (corpus, questions, splits, which easy questions RL
keeps); `--train-seed` makes the training randomness (the tiny model's initial weights, the copy
stage, SFT's mixture order, RL's question order and rollout sampling), so one world can be run
several times for the spread between runs of one recipe.

    python -m bcstack.speedrun [--state .bcstack-speedrun] [--world-seed 1] [--train-seed 0] [--final]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bcstack.evaluation.cli import run_with_progress
from bcstack.evaluation.loaders import load_questions, tier_of
from bcstack.evaluation.report import TIERS, question_level_line, round_consistency_line
from bcstack.evaluation.runner import EvalRunError
from bcstack.stack import StackError, down, read_state, sigterm_runs_finally, up
from core.engine_client import MAX_SEED
from trainer.data import longest_trajectory

# Observations small enough for a CPU run, and a per-turn cap: every one a worker setting
# (services/worker/settings.py), passed with `bcstack up --worker-setting`.
OBSERVATION_SETTINGS = {
    "snippet_words": "24",
    "seen_snippet_words": "12",
    "page_words": "48",
    "max_topk": "3",
    "default_topk": "3",
    "reflection_nudge": "false",
    # The expert's longest turn is ~120 tokens; an untrained model would otherwise spend the whole
    # episode budget in its first turn.
    "max_new_tokens_per_turn": "192",
}


@dataclass
class Timeline:
    """Seconds per stage, kept in STATE/timeline.json so a resumed run reports every stage it ran."""

    path: Path | None = None
    started: float = field(default_factory=time.monotonic)
    seconds: dict[str, float] = field(default_factory=dict)
    _stage: str | None = None
    _at: float = 0.0

    def __post_init__(self) -> None:
        if self.path is not None and self.path.is_file():
            self.seconds = json.loads(self.path.read_text())

    def stage(self, name: str, text: str) -> None:
        self.end()
        self._stage, self._at = name, time.monotonic()
        print(f"\n== [{time.monotonic() - self.started:6.0f} s] {name}: {text}", flush=True)

    def end(self) -> None:
        if self._stage is not None:
            # A resumed run adds to a stage's seconds: the time spent in it across processes.
            spent = self.seconds.get(self._stage, 0.0) + time.monotonic() - self._at
            self.seconds[self._stage] = round(spent, 1)
            print(f"   {self._stage} took {self.seconds[self._stage]:.0f} s", flush=True)
            self._stage = None
            if self.path is not None:
                self.path.write_text(json.dumps(self.seconds, indent=2) + "\n")

    def elapsed(self) -> float:
        return time.monotonic() - self.started


def _run(args: list[str]) -> None:
    result = subprocess.run([sys.executable, "-m", "bcstack", *args], check=False)
    if result.returncode != 0:
        raise StackError(f"`bcstack {' '.join(args[:3])} …` failed (exit {result.returncode}); see above")


def _stack(
    state: Path, worker: str, world: Path, kit: Path, index: Path, settings: dict[str, str], replicas: int = 1
) -> dict:
    if read_state(state) is not None:
        down(state, say=lambda s: None)
    return up(
        state, worker=worker, world=world, kit=kit, index=index, worker_settings=settings, replicas=replicas,
        say=lambda s: None,
    )  # fmt: skip


def _serve(
    state: Path,
    model: Path,
    version: str,
    world: Path,
    kit: Path,
    index: Path,
    settings: dict[str, str],
    replicas: int = 1,
) -> dict:
    """A stack serving `model`: the tiny-model stack already running from `state` hot-reloads it
    (a second `up` costs more than the whole evaluation of a toy world), else a new one starts.

    The workers reload only from inside their checkpoint root, so a model kept elsewhere is copied
    into `state`/train/`version` first.
    """
    import asyncio

    from bcstack.stack import TRAIN_DIR, base_name, running_pids
    from services.worker.rolling import rolling_reload

    info = read_state(state)
    if info is None or not running_pids(info) or info.get("worker") in ("expert", "expert-snippets"):
        return _stack(state, str(model), world, kit, index, settings, replicas)
    root = state / TRAIN_DIR
    target = model.resolve()
    if not target.is_relative_to(root.resolve()):
        copy = root / version
        if copy.exists():
            shutil.rmtree(copy)
        shutil.copytree(model, copy)
        target = copy.resolve()
    token = Path(info["admin_token_file"]).read_text().strip()
    urls = [s["http"] for name, s in info["services"].items() if base_name(name) == "worker"]
    results = asyncio.run(rolling_reload(urls, str(target), version, token, timeout=300))
    failed = [r for r in results if r.state != "reloaded"]
    if failed:
        raise StackError(
            f"reloading {model} failed: " + "; ".join(f"{r.url}: {r.error or r.state}" for r in failed)
        )
    return info


def split_train(
    world: Path, rl_held: dict[str, int], rl_tiers: set[str], seed: int
) -> tuple[list[dict], list[dict]]:
    """The world's train split as (SFT questions, RL questions).

    For each tier in `rl_tiers` with a count in `rl_held` (`--rl-easy`, `--rl-medium`, `--rl-hard`),
    that many of its questions, a seeded sample, are kept for RL alone: the expert never answers them and
    SFT never sees them, so RL's groups are questions as new to the SFT model as the held-out ones (on
    the questions SFT trained on, nearly every group is all correct and carries no signal). A tier in
    `rl_tiers` with no count held back is asked from SFT's own questions.
    """
    import random

    rows = [json.loads(line) for line in (world / "train.jsonl").read_text().splitlines() if line]
    held: set[int] = set()
    rl_only: set[str] = set()
    for tier in sorted(rl_tiers):
        count = rl_held.get(tier, 0)
        if not count:
            continue
        pool = [i for i, r in enumerate(rows) if tier_of(r["data_source"]) == tier]
        if count > len(pool):
            raise StackError(
                f"--rl-{tier} {count} is more than the world's {len(pool)} {tier} train questions"
            )
        held |= set(random.Random(f"rl-{tier}:{seed}").sample(pool, count))
        rl_only.add(tier)
    sft = [r for i, r in enumerate(rows) if i not in held]
    rl = [r for i, r in enumerate(rows) if i in held or tier_of(r["data_source"]) in rl_tiers - rl_only]
    return sft, rl


def default_replicas() -> int:
    """One worker replica per core the process may use (the CPU engine decodes on one), at most 4."""
    import os

    return max(1, min(4, len(os.sched_getaffinity(0))))


def _urls(info: dict) -> dict[str, str]:
    return {name: s["http"] for name, s in info["services"].items()}


def build_assets(state: Path, args: argparse.Namespace) -> dict[str, Path]:
    from devkit.modelkit.build import build_tiny_kit
    from devkit.modelkit.model import TinyQwen3Shape
    from devkit.toyworld.generator import generate_world, write_world

    world, kit, index = state / "world", state / "kit", state / "index"
    if not (world / "world.json").is_file():
        made = generate_world(
            args.docs,
            args.world_seed,
            questions_per_tier=args.questions_per_tier,
            dev_per_tier=args.questions_per_tier,
            train_easy=args.train_easy + args.rl_easy,
            train_medium=args.train_medium + args.rl_medium,
            train_hard=args.train_hard + args.rl_hard,
        )
        write_world(made, world)
    if not (kit / "config.json").is_file():
        h = args.hidden_size
        shape = TinyQwen3Shape(
            hidden_size=h, num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
            head_dim=h // 4, intermediate_size=3 * h,
        )  # fmt: skip
        build_tiny_kit(kit, seed=args.train_seed, shape=shape, number_digits=args.number_digits)
    if not (index / "manifest.json").is_file():
        _run(["index", "--corpus", str(world / "corpus.jsonl"), "--index-dir", str(index), "--dense", "none"])
    return {"world": world, "kit": kit, "index": index}


def _budget_from(longest: int, turns: int, factor: float) -> dict[str, int]:
    """The tiny workers' budget: `factor` x the longest expert trajectory, and its turns + 2."""
    return {"max_tokens": int(longest * factor), "max_turns": turns + 2}


def _evaluated(eval_dir: Path, questions: int) -> bool:
    path = eval_dir / "judgements.jsonl"
    return path.is_file() and len(path.read_text().splitlines()) >= questions


def evaluate(
    label: str,
    urls: dict[str, str],
    questions: list,
    out: Path,
    budget: dict[str, int],
    concurrency: int,
    rounds: int = 1,
    worker_gold: bool = False,
    seed: int | None = None,
) -> None:
    run_with_progress(
        questions,
        out,
        urls["coordinator"],
        urls["judge"],
        concurrency=concurrency,
        rounds=rounds,
        overrides={"max_branches": 1},
        budget=budget,
        label=label,
        worker_gold=worker_gold,
        seed=seed,
    )


def summarise(state: Path, stages: list[tuple[str, Path, str | None]], seconds: dict[str, float]) -> dict:
    """report.json: per stage correct/total/tiers/Wilson and how its rounds agree (`round_consistency`:
    right in most rounds, in any, against the mean; the room sharpening alone has); the paired
    comparisons; seconds per stage."""
    from bcstack.evaluation.report import build_report, round_consistency

    dirs = {name: path for name, path, _ in stages}
    out: dict[str, Any] = {"stages": [], "paired": [], "seconds": seconds}
    for name, path, baseline in stages:
        report = build_report(path, dirs[baseline] if baseline else None)
        out["stages"].append(
            {
                "name": name,
                "correct": report.correct,
                "total": report.total,
                "tiers": {t.tier: {"correct": t.correct, "total": t.total} for t in report.tiers},
                "wilson_95": list(report.wilson_95),
                "guard": report.guard_counts,
                # build_report computes it when some question has several rounds; with one round the
                # rates are the accuracy, read here so every stage has them.
                "round_consistency": report.round_consistency or round_consistency(path),
            }
        )
        if report.paired is not None:
            p = report.paired
            out["paired"].append(
                {
                    "this": name,
                    "baseline": baseline,
                    "n": p["n"],
                    "improved": p["improved"],
                    "regressed": p["regressed"],
                    "delta_pp": p["delta_pp"],
                    "delta_ci_pp": list(p["delta_ci_pp"]),
                    "mcnemar_p": p["mcnemar_p"],
                    "by_question": p["by_question"],
                }
            )
    return out


def gold_comparison(main: Path, other: Path, main_gold: bool) -> dict | None:
    """The RL model with the gold answer sent to the workers' guard vs withheld, paired (None when the
    other evaluation was not run: without --final)."""
    from bcstack.evaluation.report import build_report

    if not (other / "judgements.jsonl").is_file():
        return None
    gold, none = (main, other) if main_gold else (other, main)
    report = build_report(gold, none)
    p = report.paired
    return {
        "this": "SFT + RL, gold to the workers' guard",
        "baseline": "SFT + RL, no gold to workers",
        "correct": [report.correct, report.baseline.correct if report.baseline else None],
        "total": report.total,
        "guard": [report.guard_counts, report.baseline.guard_counts if report.baseline else {}],
        "delta_pp": p["delta_pp"],
        "delta_ci_pp": list(p["delta_ci_pp"]),
        "mcnemar_p": p["mcnemar_p"],
        "improved": p["improved"],
        "regressed": p["regressed"],
        "n": p["n"],
    }


def seed_coupling(sft: Path, rl: Path, rl_other: Path, seed: int) -> dict | None:
    """What evaluating both models with one seed does to their paired test: the RL model against the
    SFT model with the same seeds (coupled, as the report's row) and with other seeds (independent),
    and the RL model against itself under the two seed sets (only sampling noise can split those
    pairs). None when the check was not run (--eval-seed-check)."""
    from bcstack.evaluation.report import build_report

    if not (rl_other / "judgements.jsonl").is_file():
        return None

    def paired(this: Path, baseline: Path) -> dict:
        p = build_report(this, baseline).paired
        keys = ("n", "improved", "regressed", "delta_pp", "mcnemar_p")
        return {k: p[k] for k in keys} | {"delta_ci_pp": list(p["delta_ci_pp"])}

    return {
        "seed": seed,
        "other_seed": seed + 1,
        "coupled": paired(rl, sft),
        "independent": paired(rl_other, sft),
        "rl_against_itself": paired(rl_other, rl),
    }


def training_signal(sft_metrics: list[dict], rl: list[dict], window: int = 50) -> dict:
    """How well training fitted, beside what it scored: SFT's mean loss over its first and last
    `window` steps, and per RL update the sampled groups whose episodes all got one reward (no
    advantage: dynamic sampling leaves them out and samples more, so fewer updates fit the time).
    On the tiny model the training seed alone can leave SFT's loss at ~0.13 where another seed
    reaches ~0.02 in the same steps; this puts that in the report."""

    def mean_loss(rows: list[dict]) -> float | None:
        losses = [float(r["loss"]) for r in rows if "loss" in r]
        return round(sum(losses) / len(losses), 4) if losses else None

    equal = [int(m.get("filtered_zero_variance", 0)) + int(m.get("zero_variance_groups", 0)) for m in rl]
    return {
        "sft_steps": len(sft_metrics),
        "sft_loss_first": mean_loss(sft_metrics[:window]),
        "sft_loss_last": mean_loss(sft_metrics[-window:]),
        "sft_loss_window": window,
        "rl_equal_reward_groups": equal,
    }


def render_table(summary: dict) -> str:
    lines = ["| Worker | Easy | Medium | Hard | Total | Wilson 95% |", "|---|---|---|---|---|---|"]
    for s in summary["stages"]:
        t = s["tiers"]
        cells = [f"{t[k]['correct']}/{t[k]['total']}" for k in ("easy", "medium", "hard")]
        pct = 100 * s["correct"] / s["total"] if s["total"] else float("nan")
        lo, hi = (100 * x for x in s["wilson_95"])
        lines.append(
            f"| {s['name']} | {' | '.join(cells)} | {s['correct']}/{s['total']} ({pct:.2f}%) | "
            f"{lo:.2f}–{hi:.2f}% |"
        )
    lines.append("")
    for p in summary["paired"]:
        lo, hi = p["delta_ci_pp"]
        lines.append(
            f"{p['this']} vs {p['baseline']}: {p['improved']} improved, {p['regressed']} regressed, "
            f"{p['delta_pp']:+.2f} pp (paired 95% interval {lo:+.2f} to {hi:+.2f}), "
            f"exact McNemar p = {p['mcnemar_p']:.3g}"
        )
        if p.get("by_question"):
            lines.append(f"  {question_level_line(p['by_question'])}")
    for s in summary["stages"]:
        consistency = s.get("round_consistency")
        if consistency and consistency["all"]["rounds"] > 1:
            lines.append(f"{s['name']}: {round_consistency_line(consistency)}")
    lines.append("")
    gold = summary.get("worker_gold", False)
    bounced = ", ".join(f"{s['name']} {s.get('guard', {}).get('bounced', 0)}" for s in summary["stages"])
    lines.append(
        "No-search guard: the gold answer was "
        + ("sent to the workers (FoldAgent's rule); episodes bounced: " + bounced if gold else
           "withheld from the workers (every search-free answer voided)")
    )  # fmt: skip
    c = summary.get("worker_gold_comparison")
    if c:
        lo, hi = c["delta_ci_pp"]
        lines.append(
            f"The gold bit, measured once: {c['this']} {c['correct'][0]}/{c['total']} vs {c['baseline']} "
            f"{c['correct'][1]}/{c['total']}: {c['delta_pp']:+.2f} pp ({lo:+.2f} to {hi:+.2f}), "
            f"exact McNemar p = {c['mcnemar_p']:.3g}; bounced with gold: {c['guard'][0].get('bounced', 0)}"
        )
    coupling = summary.get("seed_coupling")
    if coupling:
        c, i, a = coupling["coupled"], coupling["independent"], coupling["rl_against_itself"]
        lines.append(
            f"One seed for both models (--eval-seed {coupling['seed']}): SFT + RL vs SFT {c['improved']} "
            f"improved / {c['regressed']} regressed, p = {c['mcnemar_p']:.3g}; with the RL model's seeds "
            f"{coupling['other_seed']} instead: {i['improved']} / {i['regressed']}, "
            f"p = {i['mcnemar_p']:.3g}; "
            f"the RL model against itself under the two seeds: {a['improved']} / {a['regressed']}"
        )
    signal = summary.get("training_signal")
    if signal and signal["sft_loss_last"] is not None:
        groups = signal["rl_equal_reward_groups"]
        lines.append(
            f"Training signal: SFT loss {signal['sft_loss_first']:.4f} over its first "
            f"{signal['sft_loss_window']} steps, {signal['sft_loss_last']:.4f} over its last "
            f"({signal['sft_steps']} steps); equal-reward groups per RL update: "
            + (", ".join(str(g) for g in groups) if groups else "no update")
        )
    return "\n".join(lines)


def plot(summary: dict, rl_metrics: list[dict], path: Path) -> None:  # noqa: PLR0915
    """Accuracy per stage with Wilson intervals; the RL reward and held-out accuracy over updates."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    ax, bx = fig.subplots(1, 2)
    names = [s["name"] for s in summary["stages"]]
    acc = [100 * s["correct"] / max(1, s["total"]) for s in summary["stages"]]
    err = [
        [a - 100 * s["wilson_95"][0] for a, s in zip(acc, summary["stages"], strict=True)],
        [100 * s["wilson_95"][1] - a for a, s in zip(acc, summary["stages"], strict=True)],
    ]
    ax.bar(names, acc, yerr=err, capsize=6, color=["#999999", "#4c72b0", "#55a868"][: len(names)])
    for tier, marker in (("easy", "o"), ("medium", "s"), ("hard", "^")):
        ax.plot(
            names,
            [100 * s["tiers"][tier]["correct"] / max(1, s["tiers"][tier]["total"])
             for s in summary["stages"]],
            marker=marker, linestyle="none", color="black", label=tier,
        )  # fmt: skip
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_title(
        f"Held-out {summary.get('split', 'test')} split (world {summary.get('world_seed', 0)}, training seed "
        f"{summary.get('train_seed', 0)}), Wilson 95%",
        fontsize=9,
    )
    ax.legend(loc="upper left", fontsize=8)
    # The policy's success rate on its rollouts: every sampled group's (dynamic sampling trains only
    # the groups with unequal rewards, whose mean is pulled towards 0.5).
    rewards = [(m["update"], m.get("sampled_reward_mean", m.get("reward_mean"))) for m in rl_metrics]
    rewards = [(u, r) for u, r in rewards if r is not None]
    bx.plot([u for u, _ in rewards], [r for _, r in rewards], "o-", alpha=0.5,
            label="rollout reward (RL train questions)")  # fmt: skip
    if len(rewards) >= 5:  # one update's groups are few: the trend is the 5-update moving mean
        mean5 = [sum(r for _, r in rewards[i - 4 : i + 1]) / 5 for i in range(4, len(rewards))]
        bx.plot([u for u, _ in rewards[4:]], mean5, "-", linewidth=2.5, color="#1f4e79",
                label="moving mean of 5 updates")  # fmt: skip
    evals = [m for m in rl_metrics if m.get("eval_accuracy") is not None]
    if evals:
        bx.errorbar(
            [m["update"] for m in evals],
            [m["eval_accuracy"] for m in evals],
            yerr=[
                [m["eval_accuracy"] - m["eval_wilson_low"] for m in evals],
                [m["eval_wilson_high"] - m["eval_accuracy"] for m in evals],
            ],
            fmt="s-", capsize=4, label="held-out accuracy",
        )  # fmt: skip
    bx.set_xlabel("RL update")
    bx.set_ylim(0, 1)
    bx.set_title("bcstack train rl")
    bx.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    # SIGTERM (kill, timeout, a scheduler) stops the speedrun's stack as Ctrl-C does
    with sigterm_runs_finally():
        return _main(argv)


def _seed_option(value: str) -> int | None:
    """--eval-seed: an integer, or 'none' for fresh entropy."""
    if value.lower() == "none":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an integer or 'none', not {value!r}") from None


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--state", type=Path, default=Path(".bcstack-speedrun"), help="working folder (kept; resumable)")
    add("--fresh", action="store_true", help="remove the state folder first")
    add("--docs", type=int, default=16_000,
        help="toy world documents (16000 holds --train-hard 300 beside 2,500 easy train questions; "
        "14000 before that was chosen on dev)")  # fmt: skip
    add("--world-seed", type=int, default=0, help="the world: corpus, questions, splits")
    add("--train-seed", type=int, default=0,
        help="training randomness: initial weights, copy stage, SFT order, RL order")  # fmt: skip
    add("--questions-per-tier", type=int, default=50, help="held-out questions per tier, in test and in dev")
    add(
        "--final",
        action="store_true",
        help="evaluate on the test split (the final report; read once, after every choice was made on "
        "dev); default: the dev split",
    )
    add("--train-easy", type=int, default=2000, help="easy train questions for the expert and SFT")
    add(
        "--rl-easy",
        type=int,
        default=500,
        help="more easy train questions, kept for RL alone: SFT never sees them (0: RL on SFT's questions)",
    )
    add(
        "--replicas",
        type=int,
        default=default_replicas(),
        help="worker replicas (engine + worker) of every stack; the CPU engine decodes on one core, so one "
        "per core (default: this machine's cores, at most 4)",
    )
    add("--train-medium", type=int, default=600, help="medium train questions (with 200, medium: 0 on dev)")
    add("--rl-medium", type=int, default=0,
        help="more medium train questions, kept for RL alone as --rl-easy's are (0: RL asks SFT's medium "
        "questions, when --rl-tiers has medium)")  # fmt: skip
    add("--train-hard", type=int, default=300,
        help="hard train questions (chosen on world 0's dev split: with 50, hard stayed at 0-4 of 150 "
        "after SFT; with 300, 82: docs/research/speedrun.md)")  # fmt: skip
    add("--rl-hard", type=int, default=0,
        help="more hard train questions, kept for RL alone as --rl-easy's are (0: RL asks SFT's hard "
        "questions, when --rl-tiers has hard); the world holds --train-hard plus these, so it is another "
        "world than --train-hard alone makes")  # fmt: skip
    add("--hidden-size", type=int, default=128, help="tiny model width")
    add("--layers", type=int, default=4, help="tiny model layers")
    add("--number-digits", type=int, default=4,
        help="digit runs kept together by the tokenizer (Qwen3: 1); 4: a year is one token")  # fmt: skip
    add("--copy-steps", type=int, default=600, help="copy-stage steps (0: none)")
    add("--copy-text-fraction", type=float, default=0.75,
        help="share of copy rows that are toy text (its repeated tokens need longer matches)")  # fmt: skip
    add("--core-repeat", type=int, default=1, help="expert trajectories repeated in the mixture")
    add("--gate-fraction", type=float, default=0.002, help="gate rows' supervised tokens / the core's")
    add("--sft-lr", type=float, default=2e-3, help="SFT peak LR (seed 001: 1e-5, for a pretrained 4B)")
    add("--sft-min-lr", type=float, default=1e-4, help="SFT cosine floor")
    add("--sft-batch", type=int, default=16, help="SFT rows per step (seed 001: 32)")
    add("--sft-epochs", type=float, default=4.5,
        help="passes over the constructed mixture (chosen on world 0's dev split: at 2.75 training "
        "seeds 1 and 2 stopped short of fitting; docs/research/speedrun.md)")  # fmt: skip
    add("--sft-micro-batch-tokens", type=int, default=2048,
        help="packed micro-batch tokens (SFT and RL), at least the longest sample")  # fmt: skip
    add("--budget-factor", type=float, default=1.25, help="tiny worker budget: x the longest expert run")
    add("--rl-minutes", type=float, default=30.0,
        help="wall minutes for RL updates (with --rl-updates, only a cap)")  # fmt: skip
    add("--rl-updates", type=int, default=18,
        help="RL updates to train (0: as many as --rl-minutes allows); a budget in updates gives a "
        "weaker SFT model, whose groups more often tie and are sampled again, as many as a "
        "strong one")  # fmt: skip
    add("--rl-lr", type=float, default=3e-5,
        help="RL LR of the weight matrices (seed 000: 1e-6, for 4B; SFT here ends at 1e-4)")  # fmt: skip
    add("--rl-steps-per-update", type=int, default=4,
        help="optimizer steps per RL update, one per mini-batch of whole groups "
        "(train rl --steps-per-update)")  # fmt: skip
    add("--rl-vector-lr-scale", type=float, default=1.0,
        help="LR multiplier of the 1-D parameters, norm gains (train rl --vector-lr-scale): at 1 Adam moves "
        "a gain near 1 ~50x less, relatively, than a matrix entry near 0.03; 300 sharpens the policy, "
        "which paid on an under-fitted SFT model and cost 1.8 pp on a fitted one (dev)")  # fmt: skip
    add("--rl-groups", type=int, default=8, help="question groups per RL update")
    add("--rl-group-size", type=int, default=8, help="episodes per group")
    add(
        "--rl-tiers",
        default="easy,medium,hard",
        help="tiers of the train questions RL asks, comma-separated (on dev, easy alone lost 2.2 pp; all "
        "three after SFT on 300 hard questions gave +3.3 pp, p = 0.086, the most of any variant)",
    )
    add(
        "--rl-dynamic-sampling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="leave out groups whose rewards are all equal and sample more (train rl --dynamic-sampling)",
    )
    add(
        "--rl-negative-advantage-scale",
        type=float,
        default=0.0,
        help="negative advantages x this (train rl --negative-advantage-scale; 1: seed 000's GRPO; 0: the "
        "better-than-group samples alone, which sharpened the tiny policy most: bench/README.md)",
    )
    add(
        "--rl-loss-aggregation",
        choices=("sample-mean", "token-sum"),
        default="sample-mean",
        help="how a sample's token losses combine (train rl --loss-aggregation): each sample's token mean, "
        "or tokens summed over the worker token budget (Dr. GRPO)",
    )
    add("--rl-max-policy-lag", type=int, default=0,
        help="0: synchronous (two cores run rollouts and updates in turn either way)")  # fmt: skip
    add("--concurrency", type=int, default=16, help="episodes in flight")
    add(
        "--eval-worker-gold",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="send the gold answer to the workers' no-search guard in the evaluations (FoldAgent's rule: a "
        "right answer given before any search is bounced once, telling the worker it is right); default "
        "off: every search-free answer is voided. With --final the RL model is evaluated once more with the "
        "other setting, and the report gives the difference",
    )
    add(
        "--eval-rounds",
        type=int,
        default=3,
        help="rounds per held-out question for the SFT and RL models (the untrained one gets 1); with more "
        "than 1 the report adds a question-level test",
    )
    add(
        "--eval-seed",
        type=_seed_option,
        default=0,
        help="seed every evaluation's sampling from this, the question and the round (bcstack eval run "
        "--seed), the same for every stage: the paired tests then compare the models with common random "
        "numbers, so sampling noise alone splits fewer pairs (chosen on world 0's dev split: "
        "docs/research/speedrun.md); 'none': fresh entropy",
    )
    add(
        "--eval-seed-check",
        action="store_true",
        help="evaluate the RL model once more with --eval-seed + 1, and report its paired test against "
        "SFT with independent seeds beside the coupled one (needs --eval-seed)",
    )
    args = parser.parse_args(argv)
    if args.eval_rounds < 1:
        parser.error("--eval-rounds must be at least 1")
    if args.eval_seed is not None and not 0 <= args.eval_seed < MAX_SEED:  # the check's seed + 1 too
        parser.error(f"--eval-seed must be in [0, {MAX_SEED - 1}]: {args.eval_seed}")
    if args.eval_seed_check and args.eval_seed is None:
        parser.error("--eval-seed-check compares two seed sets: give --eval-seed")
    for name in ("train_easy", "rl_easy", "train_medium", "rl_medium", "train_hard", "rl_hard", "rl_updates"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be 0 or more: {getattr(args, name)}")
    rl_tiers = {t.strip() for t in args.rl_tiers.split(",") if t.strip()}
    if not rl_tiers or rl_tiers - set(TIERS):
        parser.error(f"--rl-tiers takes a comma-separated subset of {', '.join(TIERS)}: {args.rl_tiers!r}")
    state: Path = args.state.resolve()
    if args.fresh:
        shutil.rmtree(state, ignore_errors=True)
    state.mkdir(parents=True, exist_ok=True)
    tl = Timeline(state / "timeline.json")
    settings = dict(OBSERVATION_SETTINGS)
    print("Worker observation settings (all of them worker settings): "
          + ", ".join(f"{k}={v}" for k, v in settings.items()), flush=True)  # fmt: skip
    print(f"Every stack runs {args.replicas} worker replicas (engine + worker; the CPU engine decodes on one "
          "core)", flush=True)  # fmt: skip
    try:
        tl.stage("world", "toy world, tiny kit, lexical-only index")
        assets = build_assets(state, args)
        world, kit, index = assets["world"], assets["kit"], assets["index"]
        split = "test" if args.final else "dev"
        held_file = world / ("questions.jsonl" if args.final else "dev.jsonl")
        if not held_file.is_file():
            raise StackError(f"{world} has no {held_file.name} (made before the dev split); use --fresh")
        test_questions = load_questions(held_file)
        print(f"   evaluating on the {split} split ({held_file.name})"
              + ("" if args.final else "; --final evaluates on test"), flush=True)  # fmt: skip
        counts = {"easy": args.rl_easy, "medium": args.rl_medium, "hard": args.rl_hard}
        rl_held = {t: n for t, n in counts.items() if t in rl_tiers}
        sft_rows, rl_rows = split_train(world, rl_held, rl_tiers, args.world_seed)
        sft_questions, rl_questions = state / "sft-questions.jsonl", state / "rl-questions.jsonl"
        for path, rows in ((sft_questions, sft_rows), (rl_questions, rl_rows)):
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        train_questions = load_questions(sft_questions)
        print(f"   {len(train_questions)} train questions for the expert and SFT, {len(rl_rows)} for RL "
              f"({rl_held.get('easy', 0)} easy, {rl_held.get('medium', 0)} medium and "
              f"{rl_held.get('hard', 0)} hard ones SFT never sees), "
              f"{len(test_questions)} held-out {split} questions")  # fmt: skip

        records = state / "expert-records.jsonl"
        if not records.is_file():
            tl.stage("collect", f"the scripted expert on all {len(train_questions)} train questions")
            info = _stack(state / "stack", "expert-snippets", world, kit, index, settings, args.replicas)
            evaluate(
                "expert", _urls(info), train_questions, state / "eval-expert-train", {}, args.concurrency
            )
            _run(
                [
                    "records",
                    "export",
                    "--records",
                    str(state / "stack" / "records.sqlite"),
                    "--out",
                    str(records),
                ]
            )
            down(state / "stack", say=lambda s: None)
        longest, turns = longest_trajectory(records)
        budget = _budget_from(longest, turns, args.budget_factor)
        # At least the longest row: a micro-batch holds whole samples.
        micro_batch = max(args.sft_micro_batch_tokens, longest)
        print(f"   tiny worker budget: {budget['max_tokens']} tokens, {budget['max_turns']} turns "
              f"({args.budget_factor} x the longest expert trajectory)")  # fmt: skip
        gate = state / "gate.jsonl"
        if not gate.is_file():
            from transformers import AutoTokenizer

            from trainer.gate_rows import gate_rows_from_records

            rows, counts = gate_rows_from_records(records, AutoTokenizer.from_pretrained(kit))
            gate.write_text("".join(json.dumps(r) + "\n" for r in rows))
            print(f"   gate rows: {counts}")

        base = state / "base"
        if args.copy_steps and not (base / "config.json").is_file():
            share = f"{args.copy_text_fraction:.0%}"
            tl.stage("copy", f"copy-inducing stage, {args.copy_steps} steps ({share} of rows: toy text)")
            from devkit.modelkit.corpus import toy_world_corpus
            from trainer.copy_stage import copy_pretrain

            def show(step: int, m: dict) -> None:
                if step % 100 == 0 or step == args.copy_steps:
                    print(f"   copy step {step}: loss {m['loss']:.3f}, "
                          f"copy accuracy {m['copy_accuracy']:.3f}", flush=True)  # fmt: skip

            # The tokenizer's own text (a world no stack evaluates on): no held-out entity in it.
            texts = [d["text"] for d in toy_world_corpus().documents]
            copy_pretrain(
                kit, base, steps=args.copy_steps, texts=texts, text_fraction=args.copy_text_fraction,
                on_step=show, seed=args.train_seed,
            )  # fmt: skip
        start_model = base if args.copy_steps else kit

        sft_out = state / "sft"
        if not (sft_out / "serving" / "SHA256SUMS").is_file():
            tl.stage("sft", "SFT on expert trajectories + gate rows")
            _run([
                "train", "sft", "--model", str(start_model), "--out", str(sft_out),
                "--source", f"core={records}:repeat={args.core_repeat}",
                "--source", f"gate={gate}:match=core:fraction={args.gate_fraction}",
                "--lr", str(args.sft_lr), "--min-lr", str(args.sft_min_lr),
                "--global-batch", str(args.sft_batch), "--epochs", str(args.sft_epochs),
                "--micro-batch-tokens", str(micro_batch), "--checkpoint-every", "100",
                "--seed", str(args.train_seed),
                *(["--resume"] if (sft_out / "checkpoints").is_dir() else []),
            ])  # fmt: skip
        sft_model = sft_out / "serving"

        evals = {k: state / f"eval-{split}-{k}" for k in ("untrained", "sft", "rl")}
        if not _evaluated(evals["untrained"], len(test_questions)):
            tl.stage("eval untrained", f"the untrained model on {len(test_questions)} held-out questions")
            info = _stack(state / "stack", str(kit), world, kit, index, settings, args.replicas)
            evaluate(
            "untrained", _urls(info), test_questions, evals["untrained"], budget, args.concurrency,
            worker_gold=args.eval_worker_gold, seed=args.eval_seed,
        )  # fmt: skip
        tl.stage("eval sft", f"the SFT model on {len(test_questions)} held-out questions")
        info = _serve(state / "stack", sft_model, "sft", world, kit, index, settings, args.replicas)
        evaluate(
            "sft", _urls(info), test_questions, evals["sft"], budget, args.concurrency, args.eval_rounds,
            worker_gold=args.eval_worker_gold, seed=args.eval_seed,
        )  # fmt: skip

        n = args.rl_updates
        budget_words = f"{args.rl_minutes:g} minutes" if not n else (
            f"{n} update{'s' if n != 1 else ''} (at most {args.rl_minutes:g} minutes)"
        )  # fmt: skip
        tl.stage("rl", f"bcstack train rl from the SFT model for {budget_words}")
        rl_out = state / "stack" / "train" / "rl"
        from trainer.sinks import read_metrics

        rl_error = None
        # One process for the whole stage (a process per update reloads everything each time); it
        # stops by itself at the time limit with its last update exported and checkpointed, and a
        # resumed speedrun continues it with the minutes that were left.
        spent = tl.seconds.get("rl", 0.0)
        minutes_left = args.rl_minutes - spent / 60
        if minutes_left > 0:
            try:
                _run([
                "train", "rl", "--state", str(state / "stack"), "--questions", str(rl_questions),
                "--model", str(sft_model), "--ref", str(sft_model), "--out", str(rl_out),
                "--updates", str(args.rl_updates or 1000), "--max-minutes", f"{minutes_left:.4g}",
                "--groups", str(args.rl_groups), "--group-size", str(args.rl_group_size),
                "--max-policy-lag", str(args.rl_max_policy_lag), "--lr", str(args.rl_lr),
                "--seed", str(args.train_seed),
                "--steps-per-update", str(args.rl_steps_per_update),
                "--vector-lr-scale", str(args.rl_vector_lr_scale),
                *(["--dynamic-sampling"] if args.rl_dynamic_sampling else []),
                "--negative-advantage-scale", str(args.rl_negative_advantage_scale),
                "--loss-aggregation", args.rl_loss_aggregation,
                "--micro-batch-tokens", str(max(micro_batch, budget["max_tokens"])),
                "--worker-max-tokens", str(budget["max_tokens"]),
                "--worker-max-turns", str(budget["max_turns"]), "--max-branches", "1",
                *(["--resume"] if (rl_out / "checkpoints").is_dir() else []),
                ])  # fmt: skip
            except StackError as e:
                # Keep what it trained, and say so in the report (never a silent stop).
                rl_error = f"RL stopped: {e}"
                print(f"   {rl_error}", flush=True)
        updates = len(read_metrics(rl_out)) if (rl_out / "metrics.jsonl").is_file() else 0
        exports = sorted((rl_out / "exports").glob("u*")) if (rl_out / "exports").is_dir() else []
        rl_model = exports[-1] if exports and updates else sft_model
        tl.stage(
            "eval rl", f"the RL model (update {updates}, {rl_model.name}) on {len(test_questions)} questions"
        )
        rl_version = rl_model.name if rl_model != sft_model else "sft"
        info = _serve(state / "stack", rl_model, rl_version, world, kit, index, settings, args.replicas)
        evaluate(
            "rl", _urls(info), test_questions, evals["rl"], budget, args.concurrency, args.eval_rounds,
            worker_gold=args.eval_worker_gold, seed=args.eval_seed,
        )  # fmt: skip
        other_seeds = state / f"eval-{split}-rl-other-seeds"
        if args.eval_seed_check:
            tl.stage("eval rl, other seeds", f"the RL model again with --eval-seed {args.eval_seed + 1}")
            evaluate(
                "rl-other-seeds", _urls(info), test_questions, other_seeds, budget, args.concurrency,
                args.eval_rounds, worker_gold=args.eval_worker_gold, seed=args.eval_seed + 1,
            )  # fmt: skip
        other = state / f"eval-{split}-rl-{'no-gold' if args.eval_worker_gold else 'gold'}"
        if args.final:
            # The gold bit, measured once: the same model and questions with the other guard setting.
            how = "withheld from" if args.eval_worker_gold else "sent to"
            tl.stage("eval rl, other guard", f"the RL model again, the gold answer {how} the workers' guard")
            evaluate(
                "rl-other-guard", _urls(info), test_questions, other, budget, args.concurrency,
                args.eval_rounds, worker_gold=not args.eval_worker_gold, seed=args.eval_seed,
            )  # fmt: skip
        down(state / "stack", say=lambda s: None)

        tl.stage("report", "tables, PNG, report.json")
        tl.end()
        summary = summarise(
            state,
            [("Untrained tiny", evals["untrained"], None), ("SFT", evals["sft"], "Untrained tiny"),
             ("SFT + RL", evals["rl"], "SFT")],
            tl.seconds,
        )  # fmt: skip
        rl_metrics = read_metrics(rl_out)
        summary["worker_gold"] = args.eval_worker_gold
        summary["worker_gold_comparison"] = gold_comparison(evals["rl"], other, args.eval_worker_gold)
        summary["eval_seed"] = args.eval_seed
        summary["seed_coupling"] = (
            seed_coupling(evals["sft"], evals["rl"], other_seeds, args.eval_seed)
            if args.eval_seed_check
            else None
        )
        summary["split"] = split
        summary["world_seed"] = args.world_seed
        summary["train_seed"] = args.train_seed
        summary["settings"] = {
            "worker": settings,
            "budget": budget,
            "args": {k: str(v) for k, v in vars(args).items()},
        }
        summary["rl_updates"] = updates
        summary["training_signal"] = training_signal(read_metrics(sft_out), rl_metrics)
        summary["rl_model"] = str(rl_model)
        summary["rl_error"] = rl_error
        (state / "report.json").write_text(json.dumps(summary, indent=2) + "\n")
        plot(summary, rl_metrics, state / "speedrun.png")
        print("\n" + render_table(summary))
        if rl_error:
            print(f"\n{rl_error}")
        print(f"\nPNG: {state / 'speedrun.png'}   JSON: {state / 'report.json'}")
        print("Seconds per stage: " + ", ".join(f"{k} {v:.0f}" for k, v in tl.seconds.items()))
    except (StackError, EvalRunError) as e:  # EvalRunError: a service gone, or an eval dir of another seed
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if read_state(state / "stack") is not None:
            down(state / "stack", say=lambda s: None)
    print(f"\nspeedrun finished in {tl.elapsed():.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
