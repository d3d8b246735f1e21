"""The committed benchmark reports: bench/speedrun.py files a speedrun's report.json with its three
rows, its paired comparisons and the commit that made it; a bench refuses a dirty checkout in one
line with exit status 2, and every bench that writes a results file takes --dirty-ok (issue 35).
On a hand-made report: the speedrun itself is tests/test_speedrun.py's."""

from __future__ import annotations

import ast
import copy
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import bench_module

ROOT = Path(__file__).resolve().parents[1]


_bench = bench_module


def _stage(name: str, easy: tuple[int, int], wilson: tuple[float, float]) -> dict:
    return {
        "name": name,
        "correct": easy[0],
        "total": 3 * easy[1],
        "tiers": {"easy": {"correct": easy[0], "total": easy[1]}, "medium": {"correct": 0, "total": easy[1]},
                  "hard": {"correct": 0, "total": easy[1]}},
        "wilson_95": list(wilson),
    }  # fmt: skip


REPORT = {
    "stages": [
        _stage("Untrained tiny", (0, 50), (0.0, 0.025)),
        _stage("SFT", (92, 150), (0.1698, 0.2441)),
        _stage("SFT + RL", (108, 150), (0.2028, 0.2816)),
    ],
    "paired": [
        {"this": "SFT", "baseline": "Untrained tiny", "n": 150, "improved": 29, "regressed": 0,
         "delta_pp": 19.33, "delta_ci_pp": [13.27, 26.39], "mcnemar_p": 3.73e-09, "by_question": None},
        {"this": "SFT + RL", "baseline": "SFT", "n": 450, "improved": 22, "regressed": 6, "delta_pp": 3.56,
         "delta_ci_pp": [1.23, 5.95], "mcnemar_p": 0.00372,
         "by_question": {"questions": 150, "rounds_per_question": [3, 3], "improved": 14, "regressed": 4,
                         "delta_pp": 3.56, "delta_ci_pp": [1.11, 6.22], "wilcoxon_p": 0.004}},
    ],
    "seconds": {"world": 11.0, "sft": 765.0, "rl": 745.0},
    "settings": {"worker": {"page_words": "48"}, "budget": {"max_tokens": 900, "max_turns": 8}, "args": {}},
    "rl_updates": 16,
    "rl_model": "/state/stack/train/rl/exports/u16",
    "rl_error": None,
}  # fmt: skip


def _table(text: str, title: str) -> list[list[str]]:
    """The body rows of the Markdown table under `## title`."""
    lines = text.splitlines()
    start = lines.index(f"## {title}") + 4  # title, blank, header, rule
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_the_speedrun_report_holds_the_three_rows_the_comparisons_and_the_commit():
    text = _bench("speedrun").render_speedrun(copy.deepcopy(REPORT))
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert any(line.startswith(f"- commit: {head.stdout.strip()}") for line in text.splitlines())
    rows = _table(text, "Held-out test questions per stage (world seed 0, training seed 0)")
    assert [r[:6] for r in rows] == [
        ["Untrained tiny", "0/50", "0/50", "0/50", "0", "150"],
        ["SFT", "92/150", "0/150", "0/150", "92", "450"],
        ["SFT + RL", "108/150", "0/150", "0/150", "108", "450"],
    ]
    assert [float(x) for x in rows[2][6:]] == pytest.approx([24.0, 20.28, 28.16])
    paired = _table(text, "Paired comparisons over (question, round) pairs")
    assert [r[:5] for r in paired] == [
        ["SFT", "Untrained tiny", "150", "29", "0"],
        ["SFT + RL", "SFT", "450", "22", "6"],
    ]
    assert float(paired[1][-1]) == pytest.approx(0.00372)
    by_question = _table(
        text, "Paired comparisons with questions as the units (each question's mean over its rounds)"
    )
    assert [r[:6] for r in by_question] == [["SFT + RL", "SFT", "150", "3–3", "14", "4"]]
    assert "How each stage's rounds agree" not in text  # a report from before it recorded them
    # A report that records them: a table row per tier of each stage with several rounds.
    report = copy.deepcopy(REPORT)
    rates = {"questions": 50, "rounds": 3, "mean": 60.0, "majority": 62.0, "any": 70.0, "mixed": 9}
    report["stages"][0]["round_consistency"] = {"all": {**rates, "rounds": 1}}
    report["stages"][1]["round_consistency"] = {"easy": rates, "all": {**rates, "questions": 150}}
    agree = _table(
        _bench("speedrun").render_speedrun(report),
        "How each stage's rounds agree (what sharpening alone could gain)",
    )
    assert [r[:4] for r in agree] == [["SFT", "easy", "50", "3"], ["SFT", "all", "150", "3"]]
    assert [float(x) for x in agree[0][4:]] == [60.0, 62.0, 2.0, 70.0, 9.0]
    seconds = dict(_table(text, "Seconds per stage"))
    assert {k: float(v) for k, v in seconds.items()} == {
        "world": 11,
        "sft": 765,
        "rl": 745,
        "all stages": 1521,
    }


def test_a_seeded_run_files_its_coupled_and_independent_paired_tests_and_names_the_seed():
    speedrun = _bench("speedrun")
    report = copy.deepcopy(REPORT)
    pair = {"n": 450, "delta_ci_pp": [0.5, 4.0], "delta_pp": 2.0}
    report["seed_coupling"] = {
        "seed": 0,
        "other_seed": 1,
        "coupled": {**pair, "improved": 14, "regressed": 5, "mcnemar_p": 0.064},
        "independent": {**pair, "improved": 40, "regressed": 31, "mcnemar_p": 0.34},
        "rl_against_itself": {**pair, "improved": 30, "regressed": 30, "delta_pp": 0.0, "mcnemar_p": 1.0},
    }
    rows = _table(
        speedrun.render_speedrun(report),
        "One seed set for both models (--eval-seed 0) against independent ones "
        "(the RL model again with seed 1)",
    )
    assert [r[:4] for r in rows] == [
        ["SFT + RL vs SFT, one seed set (the report's row)", "450", "14", "5"],
        ["SFT + RL vs SFT, independent seeds", "450", "40", "31"],
        ["SFT + RL against itself, the two seed sets", "450", "30", "30"],
    ]
    # The seed is part of the recipe's name (it groups runs), and a run without one names none.
    args = {"sft_epochs": "4.5", "rl_updates": "18", "rl_minutes": "30.0", "rl_lr": "3e-05"}
    seeded = {"settings": {"args": {**args, "eval_seed": "0"}}}
    assert speedrun.recipe(seeded).endswith(", eval seed 0")
    assert "eval seed" not in speedrun.recipe({"settings": {"args": {**args, "eval_seed": "None"}}})
    assert "eval seed" not in speedrun.recipe({"settings": {"args": args}})


@pytest.mark.parametrize("missing", ["Untrained tiny", "SFT", "SFT + RL"])
def test_a_report_without_one_of_the_rows_is_not_filed(missing):
    report = copy.deepcopy(REPORT)
    report["stages"] = [s for s in report["stages"] if s["name"] != missing]
    with pytest.raises(ValueError, match="missing"):
        _bench("speedrun").render_speedrun(report)


def test_the_json_copy_keeps_the_report_and_adds_where_and_when():
    stamped = _bench("speedrun").stamped(copy.deepcopy(REPORT))
    assert stamped["stages"] == REPORT["stages"] and stamped["paired"] == REPORT["paired"]
    assert stamped["commit"] == _bench("speedrun").git_state()[0]
    assert {"machine", "date", "command", "uncommitted_changes"} <= stamped.keys()


def test_a_dirty_checkout_is_refused_in_one_line_with_status_2(monkeypatch, capsys):
    _bench("speedrun")  # puts bench/ on sys.path, as every bench does
    common = sys.modules["common"]
    monkeypatch.setattr(common, "git_state", lambda: ("f" * 40, " M bench/speedrun.py\n?? notes.txt"))
    with pytest.raises(SystemExit) as refused:
        common.require_clean_tree("speedrun", dirty_ok=False)
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--dirty-ok" in err and "bench/speedrun.py" in err
    common.require_clean_tree("speedrun", dirty_ok=True)  # no refusal


def test_a_state_folder_that_would_dirty_the_checkout_is_refused(tmp_path):
    speedrun = _bench("speedrun")
    assert not speedrun.dirties_checkout(ROOT / ".bcstack-speedrun")  # the default, git-ignored
    assert not speedrun.dirties_checkout(tmp_path / "state")  # outside the checkout
    assert speedrun.dirties_checkout(ROOT / "speedrun-state-not-ignored")


def _run(world: int, seed: int, rl_improved: int, commit: str = "c" * 40) -> dict:
    report = copy.deepcopy(REPORT)
    report.update(split="test", world_seed=world, train_seed=seed, commit=commit, uncommitted_changes=[])
    rl = report["paired"][1]
    rl.update(improved=rl_improved, regressed=6, delta_pp=100 * (rl_improved - 6) / 450)
    rl["mcnemar_p"] = 0.00372 if rl_improved == 22 else 0.5
    report["stages"][2]["correct"] = 92 + rl_improved - 6
    return report


def test_the_summary_gives_each_worlds_spread_and_prints_a_missed_check_as_missed(tmp_path):
    speedrun = _bench("speedrun")
    assert speedrun.run_name(_run(1, 2, 22)) == "speedrun-w1-t2-test"
    for world, seed, improved in ((1, 0, 22), (1, 1, 22), (1, 2, 8), (2, 0, 22)):
        report = _run(world, seed, improved)
        if (world, seed) == (1, 1):  # a report that records how SFT fitted (older ones do not)
            report["training_signal"] = {"sft_steps": 480, "sft_loss_first": 4.99, "sft_loss_last": 0.1313}
        (tmp_path / f"{speedrun.run_name(report)}.json").write_text(json.dumps(report))
    text = speedrun.write_summary(tmp_path).read_text()
    runs = _table(text, "Every run: accuracy per stage and the two checks")
    assert [(r[0], r[1], r[2]) for r in runs] == [("test", "1", "0"), ("test", "1", "1"), ("test", "1", "2"),
                                                  ("test", "2", "0")]  # fmt: skip
    # Untrained easy 0/50 (Wilson high 7.1%) vs SFT easy 92/150 (low 53.4%): held in every run.
    assert all(r[-3].startswith("held: SFT easy 92/150") for r in runs)
    assert [r[-2].split(":")[0] for r in runs] == ["held", "held", "MISSED", "held"]
    assert [r[-1] for r in runs] == ["—", "0.1313", "—", "—"]  # SFT's loss over its last 50 steps
    spread = {
        (r[1], r[4]): r
        for r in _table(text, "Per world and recipe: each stage's mean and spread over its runs")
    }
    rl = spread[("1", "SFT + RL")]
    accs = [100 * (92 + i - 6) / 450 for i in (22, 22, 8)]
    assert int(rl[3]) == 3 and float(rl[5]) == pytest.approx(statistics.fmean(accs), abs=0.01)
    assert float(rl[6]) == pytest.approx(statistics.stdev(accs), abs=0.01)
    assert spread[("2", "SFT")][6] == "—"  # one run: no spread to give


def test_the_summary_keeps_runs_of_two_recipes_on_one_world_apart(tmp_path):
    speedrun = _bench("speedrun")
    old = {
        "sft_epochs": "2.75",
        "rl_updates": "None",
        "rl_minutes": "12.0",
        "rl_lr": "3e-05",
        "rl_vector_lr_scale": "300.0",
        "rl_negative_advantage_scale": "0.0",
        "rl_tiers": "easy,medium",
    }
    new = {**old, "sft_epochs": "4.5", "rl_updates": "18", "rl_minutes": "30.0", "rl_vector_lr_scale": "1.0"}
    for seed, args in ((0, old), (1, old), (2, new)):
        report = _run(3, seed, 22 if seed else 8)
        report["settings"] = {**report["settings"], "args": args}
        (tmp_path / f"{speedrun.run_name(report)}.json").write_text(json.dumps(report))
    text = speedrun.write_summary(tmp_path).read_text()
    recipes = [r[5] for r in _table(text, "Every run: accuracy per stage and the two checks")]
    assert recipes[:2] == ["SFT 2.75 passes; RL 12 min, LR 3e-05, gains x 300"] * 2
    assert recipes[2] == "SFT 4.5 passes; RL 18 updates (30 min cap), LR 3e-05, gains x 1"
    spread = _table(text, "Per world and recipe: each stage's mean and spread over its runs")
    groups = {(r[2], r[4]): int(r[3]) for r in spread}
    assert groups[(recipes[0], "SFT + RL")] == 2 and groups[(recipes[2], "SFT + RL")] == 1


def test_the_recipe_names_a_bigger_world_and_more_hard_train_questions():
    speedrun = _bench("speedrun")
    args = {"sft_epochs": "4.5", "rl_updates": "18", "rl_minutes": "30.0", "rl_lr": "3e-05",
            "rl_vector_lr_scale": "1.0", "rl_tiers": "easy,medium"}  # fmt: skip
    base = "SFT 4.5 passes; RL 18 updates (30 min cap), LR 3e-05, gains x 1"
    # A report from before --docs and --train-hard were recorded, and one at their defaults, read alike.
    assert speedrun.recipe({"settings": {"args": args}}) == base
    assert speedrun.recipe({"settings": {"args": {**args, "docs": "14000", "train_hard": "50"}}}) == base
    bigger = {**args, "docs": "16000", "train_hard": "300", "rl_tiers": "easy,medium,hard"}
    assert speedrun.recipe({"settings": {"args": bigger}}) == (
        "16000 docs, 300 hard train questions; " + base + ", RL on easy,medium,hard"
    )
    held = {**bigger, "rl_hard": "200", "rl_medium": "0"}  # hard questions kept for RL alone are named
    assert speedrun.recipe({"settings": {"args": held}}) == (
        "16000 docs, 300 hard train questions, 200 hard for RL alone; " + base + ", RL on easy,medium,hard"
    )
    # Dr. GRPO's token-sum loss is named; the default sample mean (or a report from before it) is not.
    assert speedrun.recipe({"settings": {"args": {**args, "rl_loss_aggregation": "sample-mean"}}}) == base
    token_sum = speedrun.recipe({"settings": {"args": {**args, "rl_loss_aggregation": "token-sum"}}})
    assert token_sum == base + ", token-sum loss"


def test_the_rl_variants_read_dev_and_test_only_with_final(tmp_path):
    import argparse

    from devkit.toyworld.generator import generate_world, write_world

    variants = _bench("rl_variants")
    write_world(generate_world(600, 0, questions_per_tier=2, dev_per_tier=2, train_medium=0, train_hard=0),
                tmp_path / "w")  # fmt: skip
    rows = {name: [json.loads(x) for x in (tmp_path / "w" / name).read_text().splitlines()]
            for name in ("dev.jsonl", "questions.jsonl")}  # fmt: skip

    def ids(final: bool) -> set[str]:
        args = argparse.Namespace(split="test" if final else "dev", tiers={"easy", "medium", "hard"})
        return {q.query_id for q in variants.held_out(tmp_path / "w", args)}

    assert ids(final=False) == {r["query_id"] for r in rows["dev.jsonl"]}
    assert ids(final=True) == {r["query_id"] for r in rows["questions.jsonl"]}
    assert not ids(final=False) & ids(final=True)
    help_text = subprocess.run([sys.executable, str(ROOT / "bench" / "rl_variants.py"), "--help"],
                               capture_output=True, text=True).stdout  # fmt: skip
    assert "--final" in help_text and "default: dev" in help_text
    assert "--eval-seed" in help_text
    # The SFT baseline is the speedrun's own evaluation when it was seeded as asked, else its own.
    sft = tmp_path / "state" / "eval-dev-sft"
    assert variants.baseline_dir(tmp_path / "state", "dev", 3) == sft  # none made yet: made there
    sft.mkdir(parents=True)
    (sft / "judgements.jsonl").write_text("{}\n")
    (sft / "eval.json").write_text(json.dumps({"seed": 0}))
    assert variants.baseline_dir(tmp_path / "state", "dev", 0) == sft
    assert variants.baseline_dir(tmp_path / "state", "dev", 3) == sft.with_name("eval-dev-sft-seed3")
    (sft / "eval.json").write_text(json.dumps({"run_id": "r"}))  # from before --seed: unseeded
    assert variants.baseline_dir(tmp_path / "state", "dev", None) == sft


def test_write_results_refuses_a_dirty_checkout_unless_dirty_ok(monkeypatch, capsys, tmp_path):
    _bench("speedrun")  # puts bench/ on sys.path, as every bench does
    common = sys.modules["common"]
    monkeypatch.setattr(common, "git_state", lambda: ("f" * 40, " M bench/common.py"))
    table = common.Table("t", ["a"], [[1]])
    refused = tmp_path / "refused.md"
    with pytest.raises(SystemExit) as exit_:
        common.write_results("worker", [table], path=refused, dirty_ok=False)
    assert exit_.value.code == 2 and not refused.exists()
    assert "bench/worker.py" in capsys.readouterr().err
    written = common.write_results("worker", [table], path=tmp_path / "dirty.md", dirty_ok=True)
    text = written.read_text()
    assert f"- commit: {'f' * 40} (DIRTY" in text and "  - ` M bench/common.py`" in text
    with pytest.raises(TypeError):  # no default: a bench cannot forget to pass its flag
        common.write_results("worker", [table], path=tmp_path / "no-flag.md")


def _writes_results(tree: ast.AST) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "write_results"
    ]


WRITERS = sorted(
    p.stem
    for p in (ROOT / "bench").glob("*.py")
    if p.stem != "common" and _writes_results(ast.parse(p.read_text(encoding="utf-8")))
)


def _is_args_dirty_ok(node: ast.AST) -> bool:
    return ast.unparse(node) == "args.dirty_ok"


def test_every_bench_that_writes_results_checks_the_checkout_with_its_dirty_ok_flag():
    assert {"worker", "gateway", "retrieval", "trainer", "speedrun"} <= set(WRITERS)
    for name in WRITERS:
        tree = ast.parse((ROOT / "bench" / f"{name}.py").read_text(encoding="utf-8"))
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
        flag = [
            c
            for c in calls
            if c.args and isinstance(c.args[0], ast.Constant) and c.args[0].value == "--dirty-ok"
            and any(k.arg == "action" and ast.unparse(k.value) == "'store_true'" for k in c.keywords)
        ]  # fmt: skip
        assert flag, f"bench/{name}.py: no --dirty-ok flag (action store_true)"
        writes = _writes_results(tree)
        for call in writes:
            assert isinstance(call.args[0], ast.Constant) and call.args[0].value == name, name
            kw = {k.arg: k.value for k in call.keywords}
            assert "dirty_ok" in kw and _is_args_dirty_ok(kw["dirty_ok"]), (
                f"bench/{name}.py:{call.lineno}: write_results without dirty_ok=args.dirty_ok"
            )
        checks = [
            c
            for c in calls
            if isinstance(c.func, ast.Name) and c.func.id == "require_clean_tree"
            and ast.unparse(c) == f"require_clean_tree('{name}', args.dirty_ok)"
        ]  # fmt: skip
        assert checks and min(c.lineno for c in checks) < min(w.lineno for w in writes), (
            f"bench/{name}.py: no require_clean_tree({name!r}, args.dirty_ok) before the run"
        )


def _help_of(script: Path) -> str:
    """`python bench/NAME.py --help`'s output, run in this process (`runpy`, as `__main__`, with bench/
    first on sys.path as a script has it): a process per bench spent ~1 s of CPU each on imports this
    one has made already. test_the_rl_variants_read_dev_and_test_only_with_final runs one bench's --help
    as a process of its own."""
    import contextlib
    import io
    import runpy

    out = io.StringIO()
    with (
        pytest.MonkeyPatch.context() as patch,
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(out),
    ):
        patch.setattr(sys, "argv", [str(script), "--help"])
        patch.syspath_prepend(str(script.parent))
        with pytest.raises(SystemExit) as exit_:
            runpy.run_path(str(script), run_name="__main__")
    assert exit_.value.code in (0, None), f"{script.name} --help: {out.getvalue()[-2000:]}"
    return out.getvalue()


def test_every_bench_that_writes_results_lists_dirty_ok_in_its_help():
    for name in WRITERS:
        out = _help_of(ROOT / "bench" / f"{name}.py")
        options = out.split("\noptions:\n", 1)[-1]  # past the description, which may name the flag too
        assert re.search(r"^\s+--dirty-ok\s", options, re.M), f"bench/{name}.py --help lists no --dirty-ok"


def _judgements(path: Path, rows: list[tuple[str, str, bool]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(
            json.dumps({"query_id": q, "round": r, "tier": t, "correct": c}) + "\n"
            for r, (q, t, c) in enumerate(rows)
        )
    )


def test_the_headroom_reads_each_evaluation_of_a_state_and_says_what_is_missing(tmp_path):
    headroom = _bench("rl_headroom")  # the rates themselves: tests/test_eval_report.py (round_consistency)
    state = tmp_path / "w9-t1"
    state.mkdir()
    with pytest.raises(SystemExit, match="no report.json"):
        headroom.run_rows(state)
    (state / "report.json").write_text("{")
    with pytest.raises(SystemExit, match="report.json: not JSON"):
        headroom.run_rows(state)
    (state / "report.json").write_text(json.dumps({"split": "dev", "world_seed": 9, "train_seed": 1}))
    _judgements(state / "eval-dev-sft" / "judgements.jsonl", [("1", "easy", True), ("1", "easy", False)])
    with pytest.raises(SystemExit, match=r"eval-dev-rl/judgements.jsonl: missing"):
        headroom.run_rows(state)
    _judgements(state / "eval-dev-rl" / "judgements.jsonl", [("1", "easy", True), ("1", "easy", True)])
    rows = headroom.run_rows(state)
    assert [r[:3] for r in rows] == [
        ["w9-t1 (world 9, training seed 1, dev)", stage, tier]
        for stage in ("SFT", "SFT + RL")
        for tier in ("easy", "all")
    ]
    assert rows[0][3:] == [
        1,
        2,
        50.0,
        0.0,
        -50.0,
        100.0,
        1,
    ]  # questions, rounds, rates, majority - mean, mixed
    _judgements(state / "eval-dev-rl-u18" / "judgements.jsonl", [("1", "easy", False)])
    assert [r[1] for r in headroom.run_rows(state)][-2:] == ["SFT + RL (eval-dev-rl-u18)"] * 2
    (state / "eval-dev-rl" / "judgements.jsonl").write_text('{"query_id": "1"}\n')
    with pytest.raises(SystemExit, match=r"eval-dev-rl/judgements.jsonl:1: no 'round'"):
        headroom.run_rows(state)
