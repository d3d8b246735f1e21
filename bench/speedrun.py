"""Benchmark: `make speedrun`, the CPU learning proof, with a committed report.

    python bench/speedrun.py [--dirty-ok] [--results-dir DIR] [SPEEDRUN OPTIONS ...]

It runs `bcstack.speedrun` (its `main`, in this process) with every other option passed through
(`python -m bcstack.speedrun --help` lists them; `--state` is read here too, to find the report),
then writes from the speedrun's `STATE/report.json`:

- bench/results/speedrun.md: the command, commit, machine and date, then the report's raw numbers:
  the three rows (untrained, SFT, SFT + RL: correct/total per tier and in all, Wilson intervals),
  the paired comparisons (improved/regressed, Δ pp, Newcombe's interval, exact McNemar p), the same
  with questions as the units when there were several rounds, each stage's seconds, and the RL run;
- bench/results/speedrun.json: report.json itself, with the commit, machine, date and command added;
- bench/results/speedrun.png: the speedrun's plot.

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
            "Held-out test questions per stage",
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
    seconds = report.get("seconds", {})
    tables.append(
        Table(
            "Seconds per stage",
            ["stage", "seconds"],
            [*([k, v] for k, v in seconds.items()), ["all stages", sum(seconds.values())]],
        )
    )
    return tables


def speedrun_extra(report: dict[str, Any]) -> dict[str, str]:
    """The report's header lines beside the command, commit, machine and date: the RL run, the settings."""
    settings = report.get("settings", {})
    extra = {
        "RL updates": str(report.get("rl_updates")),
        "RL model": str(report.get("rl_model")),
        "RL error": str(report.get("rl_error") or "none"),
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
    args, speedrun_args = parser.parse_known_args(argv)
    require_clean_tree("speedrun", args.dirty_ok)  # before the ~45 minutes, not after them
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
    # write_results checks the checkout again: the report names the commit that ran.
    md = write_results(
        "speedrun",
        speedrun_tables(report),
        speedrun_extra(report),
        out / "speedrun.md",
        dirty_ok=args.dirty_ok,
    )
    (out / "speedrun.json").write_text(json.dumps(stamped(report), indent=2) + "\n", encoding="utf-8")
    written = [md, out / "speedrun.json"]
    png = args.state.resolve() / "speedrun.png"
    if png.is_file():
        written.append(Path(shutil.copyfile(png, out / "speedrun.png")))
    print("results: " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
