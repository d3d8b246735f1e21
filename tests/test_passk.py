"""pass@k evaluation (bcstack.evaluation.passk): the estimator, the paired interval, the table files,
resuming, and the command's one-line errors. A run against live engines is in
tests/test_specialists.py; bench/specialists.py evaluates trained specialists with it."""

from __future__ import annotations

import csv
import itertools
import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bcstack.cli import app
from bcstack.evaluation import passk as pk
from core.single_turn import load_prompts
from core.verifiers import MathVerifier

runner = CliRunner()


@pytest.mark.parametrize(("n", "c", "k"), [(4, 0, 1), (4, 1, 1), (4, 2, 2), (5, 3, 4), (8, 1, 8), (6, 6, 3)])
def test_pass_at_k_is_the_chance_a_random_k_subset_holds_a_right_sample(n, c, k):
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    brute = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
    assert pk.pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)
    assert pk.pass_at_k(n, c, 1) == pytest.approx(c / n)  # pass@1 is the mean success rate


def test_paired_bootstrap_covers_the_mean_difference_and_is_reproducible():
    diffs = [0.25, 0.0, 0.5, 0.25, -0.25, 0.0, 0.75, 0.25] * 5
    lo, hi = pk.paired_bootstrap(diffs)
    mean = sum(diffs) / len(diffs)
    assert lo < mean < hi and lo > 0
    assert (lo, hi) == pk.paired_bootstrap(diffs)
    assert pk.paired_bootstrap([0.0] * 10) == (0.0, 0.0)
    assert math.isnan(pk.paired_bootstrap([])[0])
    assert pk.wilcoxon_p([0.0, 0.0]) == 1.0 and pk.wilcoxon_p(diffs) < 0.05


def _prompts(tmp_path: Path, name: str, n: int) -> Path:
    path = tmp_path / f"{name}.jsonl"
    path.write_text(
        "".join(json.dumps({"id": f"{name}{i}", "prompt": f"q{i}", "label": str(i)}) + "\n" for i in range(n))
    )
    return path


def _responses(model: str, bench: str, rows, right: dict[str, int], samples: int, tokens: int) -> list[dict]:
    out = []
    for row in rows:
        for s in range(samples):
            ok = s < right.get(row.id, 0)
            out.append(
                {"model": model, "benchmark": bench, "prompt_id": row.id, "sample": s, "correct": ok,
                 "extracted": None, "response_tokens": tokens, "finish_reason": "stop", "text": ""}
            )  # fmt: skip
    return out


def test_summary_table_csv_and_plot_in_the_seeds_shape(tmp_path):
    a_rows = load_prompts(_prompts(tmp_path, "a", 20))
    b_rows = load_prompts(_prompts(tmp_path, "b", 10))
    benches = [
        (pk.BenchmarkSpec("math", tmp_path / "a.jsonl"), a_rows, MathVerifier()),
        (pk.BenchmarkSpec("ifs", tmp_path / "b.jsonl", greedy=True), b_rows, MathVerifier()),
    ]
    done: dict = {}
    lines = (
        _responses("base", "math", a_rows, {r.id: 1 for r in a_rows[:10]}, 4, 10)
        + _responses("spec", "math", a_rows, {r.id: 3 for r in a_rows[:15]}, 4, 21)
        + _responses("base", "ifs", b_rows, {r.id: 1 for r in b_rows[:5]}, 1, 7)
        + _responses("spec", "ifs", b_rows, {r.id: 1 for r in b_rows[:4]}, 1, 7)
    )
    for line in lines:
        done.setdefault((line["model"], line["benchmark"], line["prompt_id"]), []).append(line)
    models = [pk.ModelSpec("base", "http://x"), pk.ModelSpec("spec", "http://y")]
    results = pk.summarise(done, models, benches, 4, "base")
    base, spec = results["cells"]["base"], results["cells"]["spec"]
    assert base["math"]["pass_at_1"] == pytest.approx(100 * 10 / 80)
    assert spec["math"]["pass_at_1"] == pytest.approx(100 * 45 / 80)
    assert spec["math"]["pass_at_k"]["4"] == pytest.approx(75.0)  # 15 of 20 prompts have a right sample
    assert base["ifs"]["mode"] == "greedy" and base["ifs"]["samples"] == 1
    assert spec["math"]["length_ratio"] == pytest.approx(2.1)
    vs = spec["math"]["vs_baseline"]
    assert vs["delta_pp"] == pytest.approx(100 * (45 - 10) / 80)
    assert vs["ci_pp"][0] > 0 and vs["prompts_better"] == 15 and vs["prompts_worse"] == 0
    assert spec["ifs"]["vs_baseline"]["delta_pp"] == pytest.approx(-10.0)

    pk.write_outputs(tmp_path / "out", results)
    table = (tmp_path / "out" / "table.md").read_text()
    assert table.splitlines()[0] == "| Model | math pass@1 | ifs pass@1 |"
    assert "| spec | 56.25 (+43.75," in table
    with (tmp_path / "out" / "table.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["model"], r["benchmark"]) for r in rows] == [
        ("base", "math"),
        ("base", "ifs"),
        ("spec", "math"),
        ("spec", "ifs"),
    ]
    assert (tmp_path / "out" / "passk.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    short = dict(done)
    short.pop(("spec", "math", a_rows[0].id))
    with pytest.raises(pk.PasskError, match="0 of 4 responses"):
        pk.summarise(short, models, benches, 4, "base")


def test_a_torn_last_line_is_dropped_and_finished_prompts_are_kept(tmp_path):
    path = tmp_path / "responses.jsonl"
    good = {"model": "m", "benchmark": "b", "prompt_id": "p1", "sample": 0, "correct": True}
    path.write_text(json.dumps(good) + "\n" + '{"model": "m", "bench')
    done, torn = pk._done_keys(path)
    assert torn == 1 and list(done) == [("m", "b", "p1")]
    assert path.read_text() == json.dumps(good) + "\n"


def test_passk_command_errors_are_one_line(tmp_path):
    prompts = _prompts(tmp_path, "a", 3)
    cases = [
        (
            ["--model", str(tmp_path / "nope"), "--prompts", str(prompts)],
            "neither an http URL nor a model folder",
        ),
        (["--model", "m=http://127.0.0.1:9", "--prompts", f"x={tmp_path / 'missing.jsonl'}"], "no such file"),
        (["--model", "m=http://127.0.0.1:9", "--prompts", f"x={prompts}:verifier=chess"], "unknown option"),
        (
            ["--model", "m=http://127.0.0.1:9", "--prompts", str(prompts), "--baseline", "other"],
            "is not one of the models",
        ),
        (
            ["--model", "m=http://127.0.0.1:9", "--model", "m=http://127.0.0.1:8", "--prompts", str(prompts)],
            "model names repeat",
        ),
        (["--model", "m=http://127.0.0.1:9", "--prompts", str(prompts)], "does not answer /health"),
    ]
    for args, message in cases:
        result = runner.invoke(app, ["eval", "passk", *args, "--out", str(tmp_path / "o")])
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output and "Traceback" not in result.output
