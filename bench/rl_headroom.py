"""How much a finished speedrun's SFT model left for RL to gain by sharpening, per tier, from its
evaluations' rounds.

Each held-out question is asked `--eval-rounds` times (3 by default), so every evaluation says per
question how often the model was right. Three rates per stage and tier, from the same judgements:

    mean       right answers over all (question, round) pairs: the rate the speedrun reports
    majority   questions right in more than half of their rounds: what the model would score if
               it always gave its most frequent outcome, i.e. a policy sharpened with no new
               knowledge (the "blind sharpening" an RL that only lowers entropy buys; it can
               also lose, on questions right in fewer than half of their rounds)
    any        questions right in at least one round (pass@k): the most that sharpening toward
               answers the model can already reach could give

and how many questions were mixed (right in some rounds, not all). `majority - mean` is how far
sharpening alone moves a tier; where it is ~0 the SFT model is already as deterministic as its
majority vote and an RL gain must come from answers it could not give before.

    python bench/rl_headroom.py STATE [STATE ...] [--results FILE] [--dirty-ok]

STATE is a speedrun state folder (`python -m bcstack.speedrun --state STATE`): its report.json
names the world, training seed and split, and its `eval-<split>-sft`/`eval-<split>-rl` folders
hold the judgements (one JSON object per (question, round): query_id, tier, correct); any other
`eval-<split>-rl-*` folder (a final's evaluation with the other guard setting, an RL model kept
from an earlier update count) gets rows of its own, named by the folder. The states
are the runs' working folders, not committed; the report names each run so it can be made again.
The rates are `bcstack.evaluation.report.round_consistency` of each evaluation folder (the
evaluation report's own judgement loader, so a malformed line is named as `bcstack eval report`
names it). The table, with the command, commit, machine and date, goes to
bench/results/rl_headroom.md (--results); refused from a checkout with uncommitted changes unless
--dirty-ok.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from common import Table, print_machine, require_clean_tree, write_results  # noqa: E402

from bcstack.evaluation.report import ReportError, round_consistency  # noqa: E402

STAGES = (("sft", "SFT"), ("rl", "SFT + RL"))


def run_rows(state: Path) -> list[list]:
    """The table rows of one speedrun state: a row per stage and tier."""
    report_path = state / "report.json"
    if not report_path.is_file():
        raise SystemExit(f"bench/rl_headroom.py: {state}: no report.json (not a finished speedrun state)")
    try:
        report = json.loads(report_path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise SystemExit(f"bench/rl_headroom.py: {report_path}: not JSON ({exc})") from None
    split = report.get("split", "dev")
    run = (
        f"{state.name} (world {report.get('world_seed')}, training seed {report.get('train_seed')}, {split})"
    )
    stages = [(f"eval-{split}-{stage}", label) for stage, label in STAGES]
    for path in sorted(state.glob(f"eval-{split}-rl-*")):  # more evaluations of RL models, by folder
        stages.append((path.name, f"SFT + RL ({path.name})"))
    rows = []
    for folder, label in stages:
        try:
            consistency = round_consistency(state / folder)
        except ReportError as exc:  # names the file and line: missing, not JSON, a field wrong
            raise SystemExit(f"bench/rl_headroom.py: {exc}") from None
        for tier, c in consistency.items():
            rows.append([
                run, label, tier, c["questions"], c["rounds"], round(c["mean"], 1), round(c["majority"], 1),
                round(c["majority"] - c["mean"], 1), round(c["any"], 1), c["mixed"],
            ])  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench/rl_headroom.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("states", nargs="+", type=Path, help="finished speedrun state folders")
    parser.add_argument(
        "--results", type=Path, default=None, help="results file (default bench/results/rl_headroom.md)"
    )
    parser.add_argument(
        "--dirty-ok", action="store_true", help="write the results from a dirty checkout, marked DIRTY"
    )
    args = parser.parse_args(argv)
    require_clean_tree("rl_headroom", args.dirty_ok)
    print_machine()
    rows = [row for state in args.states for row in run_rows(state)]
    columns = [
        "run", "stage", "tier", "questions", "rounds", "mean %", "majority %", "majority − mean, pp",
        "any round %", "mixed questions",
    ]  # fmt: skip
    for row in rows:
        print(" | ".join(str(v) for v in row))
    table = Table(
        "Sharpening headroom per run, stage and tier",
        columns,
        rows,
        notes=(
            "mean: right (question, round) pairs; majority: questions right in more than half of their "
            "rounds (a policy sharpened to its most frequent outcome); any round: pass@k; mixed: right in "
            "some rounds, not all.",
        ),
    )
    path = write_results("rl_headroom", [table], path=args.results, dirty_ok=args.dirty_ok)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
