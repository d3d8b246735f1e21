"""Benchmark: `make speedrun`, the CPU learning proof, with a committed report.

    python bench/speedrun.py [--dirty-ok] [--results-dir DIR] [SPEEDRUN OPTIONS ...]
    python bench/speedrun.py --summary-only

It runs `bcstack.speedrun` (its `main`, in this process) with every other option passed through
(`python -m bcstack.speedrun --help` lists them; `--state` is read here too, to find the report),
then writes from the speedrun's `STATE/report.json`, one set of files per run, named by its world
seed, training seed and split (RUN = speedrun-w{world}-t{training}-{test|dev}):

- bench/results/RUN.md: the command, commit, machine and date, then the report's raw numbers:
  the three rows (untrained, SFT, SFT + RL: correct/total per tier and in all, Wilson intervals),
  the paired comparisons (improved/regressed, Δ pp, Newcombe's interval, exact McNemar p), the same
  with questions as the units when there were several rounds, each stage's seconds, and the RL run;
- bench/results/RUN.json: report.json itself, with the commit, machine, date and command added;
- bench/results/RUN.png: the speedrun's plot;
- bench/results/speedrun-summary.md, rewritten from every RUN.json there: per world, split and recipe
  (the training options that differ between runs, from the report's arguments), each stage's mean
  accuracy and spread over the runs, and per run its recipe and the two checks the speedrun must pass
  (SFT's easy Wilson interval above the untrained model's; SFT + RL above SFT, exact McNemar
  p < 0.05), a miss printed as a miss. `--summary-only` rewrites it without running anything.

The speedrun lives in the package (`bcstack/speedrun.py`, which knows nothing of bench/); this
script only checks the checkout first and files the report. It refuses, before the run, a checkout
with uncommitted changes unless --dirty-ok (the report then says DIRTY and lists them), exit
status 2, and a --state inside the checkout that git does not ignore (the run would dirty the tree
before the report is written). Otherwise the exit status is the speedrun's (2 when a stage
failed; nothing is written then).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from common import (  # noqa: E402
    RESULTS_DIR,
    Table,
    git_state,
    machine,
    render_results,
    require_clean_tree,
    write_results,
)

from bcstack.evaluation.report import wilson_interval  # noqa: E402

# The rows bcstack.speedrun's main summarises, in its order: a report without one is not filed.
STAGES = ("Untrained tiny", "SFT", "SFT + RL")
PAIRED = (("SFT", "Untrained tiny"), ("SFT + RL", "SFT"))
TIERS = ("easy", "medium", "hard")


def check_report(report: dict[str, Any]) -> None:
    """ValueError unless `report` holds every row and paired comparison the speedrun makes."""
    stages = [s["name"] for s in report.get("stages", [])]
    if tuple(stages) != STAGES:
        missing = [s for s in STAGES if s not in stages]
        raise ValueError(f"report.json rows {stages}, expected {list(STAGES)} (missing: {missing})")
    paired = [(p["this"], p["baseline"]) for p in report.get("paired", [])]
    if tuple(paired) != PAIRED:
        raise ValueError(f"report.json paired comparisons {paired}, expected {list(PAIRED)}")


def speedrun_tables(report: dict[str, Any]) -> list[Table]:
    """The tables of bench/results/speedrun.md: every number report.json holds, unrounded."""
    check_report(report)
    rows = []
    for s in report["stages"]:
        t = s["tiers"]
        lo, hi = s["wilson_95"]
        rows.append([
            s["name"], *(f"{t[k]['correct']}/{t[k]['total']}" for k in TIERS), s["correct"], s["total"],
            100 * s["correct"] / s["total"] if s["total"] else float("nan"), 100 * lo, 100 * hi,
        ])  # fmt: skip
    tables = [
        Table(
            f"Held-out {report.get('split', 'test')} questions per stage (world seed "
            f"{report.get('world_seed', 0)}, training seed {report.get('train_seed', 0)})",
            ["worker", *TIERS, "correct", "total", "accuracy %", "Wilson 95% low %", "Wilson 95% high %"],
            rows,
            notes=["Per tier: correct/total over (question, round) pairs; the untrained model: one round."],
        ),
        Table(
            "Paired comparisons over (question, round) pairs",
            ["this", "baseline", "pairs", "improved", "regressed", "Δ pp", "95% CI low pp", "95% CI high pp",
             "exact McNemar p"],
            [
                [p["this"], p["baseline"], p["n"], p["improved"], p["regressed"], p["delta_pp"],
                 p["delta_ci_pp"][0], p["delta_ci_pp"][1], p["mcnemar_p"]]
                for p in report["paired"]
            ],
            notes=["Δ: accuracy difference in percentage points; the interval is Newcombe's paired one."],
        ),
    ]  # fmt: skip
    by_question = [p for p in report["paired"] if p.get("by_question")]
    if by_question:
        tables.append(
            Table(
                "Paired comparisons with questions as the units (each question's mean over its rounds)",
                ["this", "baseline", "questions", "rounds per question", "improved", "regressed", "Δ pp",
                 "bootstrap 95% CI low pp", "bootstrap 95% CI high pp", "Wilcoxon signed-rank p"],
                [
                    [p["this"], p["baseline"], q["questions"],
                     "–".join(str(r) for r in q["rounds_per_question"]), q["improved"], q["regressed"],
                     q["delta_pp"], q["delta_ci_pp"][0], q["delta_ci_pp"][1], q["wilcoxon_p"]]
                    for p in by_question
                    for q in [p["by_question"]]
                ],
            )
        )  # fmt: skip
    consistency = [
        [st["name"], tier, c["questions"], c["rounds"], c["mean"], c["majority"], c["majority"] - c["mean"],
         c["any"], c["mixed"]]
        for st in report["stages"]
        if (st.get("round_consistency") or {}).get("all", {}).get("rounds", 1) > 1
        for tier, c in st["round_consistency"].items()
    ]  # fmt: skip
    if consistency:  # a report from before the speedrun recorded it has none
        tables.append(
            Table(
                "How each stage's rounds agree (what sharpening alone could gain)",
                ["stage", "tier", "questions", "rounds", "mean %", "majority %", "majority − mean, pp",
                 "any round %", "mixed questions"],
                consistency,
                notes=["majority: questions right in most of their rounds, where a policy RL only makes more "
                       "sure of itself ends; any round: pass@k over the rounds; mixed: right in some rounds "
                       "and not all (bcstack.evaluation.report.round_consistency)."],
            )
        )  # fmt: skip
    c = report.get("worker_gold_comparison")
    if c:
        tables.append(
            Table(
                "The gold bit: the RL model, the gold answer sent to the workers' guard vs withheld",
                ["this", "baseline", "this correct", "baseline correct", "pairs", "improved", "regressed",
                 "Δ pp", "95% CI low pp", "95% CI high pp", "exact McNemar p", "bounced (gold sent)"],
                [[c["this"], c["baseline"], c["correct"][0], c["correct"][1], c["n"], c["improved"],
                  c["regressed"], c["delta_pp"], c["delta_ci_pp"][0], c["delta_ci_pp"][1], c["mcnemar_p"],
                  c["guard"][0].get("bounced", 0)]],
            )
        )  # fmt: skip
    coupling = report.get("seed_coupling")
    if coupling:
        tables.append(
            Table(
                f"One seed set for both models (--eval-seed {coupling['seed']}) against independent ones "
                f"(the RL model again with seed {coupling['other_seed']})",
                ["comparison", "pairs", "improved", "regressed", "Δ pp", "95% CI low pp", "95% CI high pp",
                 "exact McNemar p"],
                [[label, c["n"], c["improved"], c["regressed"], c["delta_pp"], c["delta_ci_pp"][0],
                  c["delta_ci_pp"][1], c["mcnemar_p"]]
                 for label, key in (("SFT + RL vs SFT, one seed set (the report's row)", "coupled"),
                                    ("SFT + RL vs SFT, independent seeds", "independent"),
                                    ("SFT + RL against itself, the two seed sets", "rl_against_itself"))
                 for c in [coupling[key]]],
                notes=["Common random numbers: with one seed per (question, round) both models draw the same "
                       "uniforms token by token until their trajectories part, so pairs split where the "
                       "models differ; the last row can split only by sampling noise."],
            )
        )  # fmt: skip
    seconds = report.get("seconds", {})
    tables.append(
        Table(
            "Seconds per stage",
            ["stage", "seconds"],
            [*([k, v] for k, v in seconds.items()), ["all stages", sum(seconds.values())]],
        )
    )
    return tables


def run_name(report: dict[str, Any]) -> str:
    """speedrun-w{world seed}-t{training seed}-{split}: one run's files in bench/results."""
    world, train, split = (
        report.get("world_seed", 0),
        report.get("train_seed", 0),
        report.get("split", "test"),
    )
    return f"speedrun-w{world}-t{train}-{split}"


def checks(report: dict[str, Any]) -> dict[str, Any]:
    """The two things every speedrun must show, each with its numbers and whether it held.

    easy: the SFT model's easy-tier Wilson 95% interval lies wholly above the untrained model's;
    rl: SFT + RL above SFT on paired (question, round) pairs, exact McNemar p < 0.05.
    """
    stages = {s["name"]: s for s in report["stages"]}

    def easy(name: str) -> tuple[int, int, tuple[float, float]]:
        t = stages[name]["tiers"]["easy"]
        return t["correct"], t["total"], wilson_interval(t["correct"], t["total"])

    (uc, ut, (_, u_hi)), (sc, st, (s_lo, _)) = easy("Untrained tiny"), easy("SFT")
    rl = next(p for p in report["paired"] if (p["this"], p["baseline"]) == ("SFT + RL", "SFT"))
    return {
        "easy": {"held": s_lo > u_hi, "text": f"SFT easy {sc}/{st} (low {100 * s_lo:.1f}%) vs untrained "
                 f"{uc}/{ut} (high {100 * u_hi:.1f}%)"},
        "rl": {"held": rl["delta_pp"] > 0 and rl["mcnemar_p"] < 0.05,
               "text": f"{rl['delta_pp']:+.2f} pp, {rl['improved']} improved / {rl['regressed']} regressed, "
               f"p = {rl['mcnemar_p']:.3g}"},
    }  # fmt: skip


def recipe(report: dict[str, Any]) -> str:
    """The training recipe a run used, from its report's arguments: what separates runs of one world.

    "SFT 4.5 passes; RL 18 updates (30 min cap), LR 3e-05, gains x 1" -- a run made before
    `--rl-updates` existed had a time budget alone ("RL 12 min"). The world's size and its hard
    train questions, negative advantages, the loss aggregation and the RL tiers are named only when
    they differ from the first recipe's values (14000 docs, 50 hard; x 0; sample-mean; easy,medium;
    the defaults now are 16000, 300 and easy,medium,hard, so a run of today's recipe names them):
    "16000 docs, 300 hard train questions; SFT ...".
    """
    a = (report.get("settings") or {}).get("args") or {}
    if not a:
        return "—"
    updates, minutes = a.get("rl_updates"), a.get("rl_minutes")
    budget = f"{float(minutes or 0):g} min"
    rl = f"{updates} updates ({budget} cap)" if updates not in (None, "None", "", "0") else budget
    text = (
        f"SFT {a.get('sft_epochs', '?')} passes; RL {rl}, LR {a.get('rl_lr', '?')}, "
        f"gains x {float(a.get('rl_vector_lr_scale', 1)):g}"
    )
    if float(a.get("rl_negative_advantage_scale", 0) or 0):
        text += f", negative advantages x {float(a['rl_negative_advantage_scale']):g}"
    if a.get("rl_loss_aggregation", "sample-mean") != "sample-mean":
        text += f", {a['rl_loss_aggregation']} loss"
    if a.get("rl_tiers", "easy,medium") != "easy,medium":
        text += f", RL on {a['rl_tiers']}"
    if a.get("eval_seed", "None") != "None":  # an evaluation setting, but it changes the paired test
        text += f", eval seed {a['eval_seed']}"
    # The number of documents changes the world itself; more hard train questions change what SFT sees.
    world = []
    if int(a.get("docs", 14_000)) != 14_000:
        world.append(f"{int(a['docs'])} docs")
    if int(a.get("train_hard", 50)) != 50:
        world.append(f"{int(a['train_hard'])} hard train questions")
    for tier in ("medium", "hard"):  # questions kept for RL alone (the RL-only easy ones are in every run)
        if int(a.get(f"rl_{tier}", 0) or 0):
            world.append(f"{int(a[f'rl_{tier}'])} {tier} for RL alone")
    return "; ".join([", ".join(world), text]) if world else text


def summary_tables(reports: list[dict[str, Any]]) -> list[Table]:
    """speedrun-summary.md: per run its numbers and checks; per world, split and recipe, mean and spread."""
    runs = sorted(
        reports, key=lambda r: (r.get("split", "test"), r.get("world_seed", 0), r.get("train_seed", 0))
    )
    per_run = []
    for r in runs:
        acc = {
            s["name"]: 100 * s["correct"] / s["total"] if s["total"] else float("nan") for s in r["stages"]
        }
        c = checks(r)
        per_run.append([
            r.get("split", "test"), r.get("world_seed", 0), r.get("train_seed", 0),
            str(r.get("commit", "?"))[:10],
            "clean" if not r.get("uncommitted_changes") else "DIRTY", recipe(r), *(acc[n] for n in STAGES),
            ("held: " if c["easy"]["held"] else "MISSED: ") + c["easy"]["text"],
            ("held: " if c["rl"]["held"] else "MISSED: ") + c["rl"]["text"],
            (r.get("training_signal") or {}).get("sft_loss_last"),
        ])  # fmt: skip
    # A world's spread is over runs of one recipe: runs of two recipes are two groups.
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r.get("split", "test"), r.get("world_seed", 0), recipe(r)), []).append(r)
    spread = []
    for (split, world, how), members in groups.items():
        for name in STAGES:
            accs = [
                100 * s["correct"] / s["total"] for r in members for s in r["stages"] if s["name"] == name
            ]
            sd = statistics.stdev(accs) if len(accs) > 1 else float("nan")
            spread.append(
                [split, world, how, len(members), name, statistics.fmean(accs), sd, min(accs), max(accs)]
            )
    return [
        Table(
            "Every run: accuracy per stage and the two checks",
            ["split", "world seed", "training seed", "commit", "tree", "recipe", *(f"{n} %" for n in STAGES),
             "SFT easy above untrained (Wilson 95%)", "SFT + RL above SFT (paired, McNemar p < 0.05)",
             "SFT loss, last 50 steps"],
            per_run,
            notes=["Accuracy over (question, round) pairs of all three tiers; untrained: one round. "
                   "SFT loss: the mean training loss of SFT's last 50 steps (report.json "
                   "`training_signal`; — for a run made before the report recorded it)."],
        ),
        Table(
            "Per world and recipe: each stage's mean and spread over its runs",
            ["split", "world seed", "recipe", "runs", "stage", "mean %", "sd pp", "min %", "max %"],
            spread,
            notes=["sd: sample standard deviation over the runs (training seeds) of one world and recipe; "
                   "— for one."],
        ),
    ]  # fmt: skip


def write_summary(results_dir: Path) -> Path:
    """Rewrite results_dir/speedrun-summary.md from every speedrun-w*-t*-*.json in it."""
    reports = [json.loads(p.read_text()) for p in sorted(results_dir.glob("speedrun-w*-t*-*.json"))]
    path = results_dir / "speedrun-summary.md"
    # A derived file: every number is from a run's JSON, whose row names its commit and tree.
    lines = [
        "<!-- Written by bench/speedrun.py from the speedrun-w*-t*-*.json files beside it "
        "(--summary-only rewrites it). -->",
        "# speedrun summary",
        "",
        f"- runs: {len(reports)}; each row names the commit its run came from and whether its tree was clean",
    ]
    body = render_results("speedrun-summary", summary_tables(reports)).split("\n## ", 1)
    text = "\n".join(lines) + ("\n\n## " + body[1] if len(body) > 1 else "\n") if reports else "no runs yet\n"
    path.write_text(text, encoding="utf-8")
    return path


def speedrun_extra(report: dict[str, Any]) -> dict[str, str]:
    """The report's header lines beside the command, commit, machine and date: the RL run, the settings."""
    settings = report.get("settings", {})
    extra = {
        "RL updates": str(report.get("rl_updates")),
        "RL model": str(report.get("rl_model")),
        "RL error": str(report.get("rl_error") or "none"),
        "gold answer to the workers' no-search guard in the table above": (
            "sent (FoldAgent's rule)"
            if report.get("worker_gold")
            else "withheld (search-free answers voided)"
        ),
        "worker budget": json.dumps(settings.get("budget", {})),
        "worker settings": json.dumps(settings.get("worker", {})),
        "speedrun options": json.dumps(settings.get("args", {})),
    }
    return extra


def render_speedrun(report: dict[str, Any]) -> str:
    """bench/results/speedrun.md for `report` (a report.json): ValueError when a row is missing."""
    return render_results("speedrun", speedrun_tables(report), speedrun_extra(report))


def stamped(report: dict[str, Any]) -> dict[str, Any]:
    """report.json with where and when it was made: bench/results/speedrun.json."""
    head, changed = git_state()
    return {
        **report,
        "commit": head or "unknown",
        "uncommitted_changes": changed.splitlines(),
        "machine": machine(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join(["python", *sys.argv]),
    }


def dirties_checkout(state: Path) -> bool:
    """Whether files the speedrun writes under `state` would show in `git status` of this checkout."""
    state = state.resolve()
    if not state.is_relative_to(ROOT):
        return False
    ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", str(state / "report.json")])
    return ignored.returncode != 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # an abbreviation of a speedrun option must reach the speedrun
        epilog="Every other option is bcstack.speedrun's: python -m bcstack.speedrun --help.",
    )
    parser.add_argument("--dirty-ok", action="store_true", help="write the report from uncommitted changes")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="default bench/results")
    parser.add_argument(
        "--state", type=Path, default=Path(".bcstack-speedrun"), help="the speedrun's --state"
    )
    parser.add_argument(
        "--summary-only",
        action="store_true",
        help="rewrite speedrun-summary.md from the runs' JSON files already in --results-dir, run nothing",
    )
    args, speedrun_args = parser.parse_known_args(argv)
    if args.summary_only:
        print(f"results: {write_summary(args.results_dir)}")
        return 0
    require_clean_tree("speedrun", args.dirty_ok)  # before the hour, not after it
    if not args.dirty_ok and dirties_checkout(args.state):
        parser.error(
            f"--state {args.state} is inside the checkout and not git-ignored: the run would dirty the "
            "tree its report names (use a path outside it, or .bcstack-speedrun)"
        )

    from bcstack import speedrun

    started = time.time()
    code = speedrun.main(["--state", str(args.state), *speedrun_args])
    if code != 0:
        return code
    report_path = args.state.resolve() / "report.json"
    if not report_path.is_file() or report_path.stat().st_mtime < started:
        print(f"bench/speedrun.py: the speedrun wrote no new {report_path}", file=sys.stderr)
        return 2
    report = json.loads(report_path.read_text())
    out = args.results_dir
    name = run_name(report)
    # The JSON's git state is taken before any results file is written (after, the new files would
    # show as untracked and stamp a clean run dirty).
    stamp = stamped(report)
    # write_results checks the checkout again: the report names the commit that ran.
    md = write_results(
        "speedrun",
        speedrun_tables(report),
        speedrun_extra(report),
        out / f"{name}.md",
        dirty_ok=args.dirty_ok,
    )
    (out / f"{name}.json").write_text(json.dumps(stamp, indent=2) + "\n", encoding="utf-8")
    written = [md, out / f"{name}.json"]
    png = args.state.resolve() / "speedrun.png"
    if png.is_file():
        written.append(Path(shutil.copyfile(png, out / f"{name}.png")))
    written.append(write_summary(out))
    print("results: " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
