"""`bcstack eval report`: the seed 001 table, pinned on evaluation directories built by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from scipy.stats import binomtest, norm, wilcoxon

from bcstack.evaluation.report import (
    ReportError,
    build_report,
    calibration_error,
    paired_comparison,
    paired_difference_interval,
    question_level_comparison,
    render_markdown,
    report_figure,
    round_consistency,
    wilson_interval,
    write_report,
)
from bcstack.evaluation.runner import run_file_name

TABLE_HEADER = "| Worker | Easy | Medium | Hard | Total |"


def write_eval_dir(
    root: Path, rows: list[dict[str, Any]], questions: list[dict[str, Any]] | None = None
) -> Path:
    """An evaluation directory in the DESIGN.md §8 layout: judgements.jsonl plus one run file per row.

    A row gives ``query_id`` and optionally ``round`` (0), ``tier``, ``correct``, ``confidence``,
    ``status`` ("finish"), ``tools`` (tool_call_counts) and ``retrieved`` (retrieved_docids).
    """
    root.mkdir(parents=True, exist_ok=True)
    lines = []
    for row in rows:
        rnd = row.get("round", 0)
        judgement = {
            "query_id": row["query_id"],
            "round": rnd,
            "tier": row.get("tier"),
            "correct": row.get("correct"),
            "confidence": row.get("confidence"),
            "status": row.get("status", "finish"),
            **({"guard": row["guard"]} if "guard" in row else {}),
        }
        lines.append(json.dumps(judgement))
        run = {
            "query_id": row["query_id"],
            "tool_call_counts": row.get("tools", {"search": 0, "open_page": 0, "finish": 1}),
            "status": "completed",
            "retrieved_docids": row.get("retrieved", []),
            "result": [{"type": "output_text", "output": "Explanation: …\nExact Answer: x\nConfidence: 50%"}],
        }
        run_path = root / "runs" / str(rnd) / f"{run_file_name(str(row['query_id']))}.json"
        run_path.parent.mkdir(parents=True, exist_ok=True)
        run_path.write_text(json.dumps(run))
    (root / "judgements.jsonl").write_text("\n".join(lines) + "\n")
    if questions is not None:
        (root / "questions.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    return root


# The card's table: tier -> (this run correct, baseline correct, improved, regressed), 50 per tier.
# Improved/regressed are split so that they total 31 and 6 and every tier is consistent.
CARD = {"easy": (49, 43, 7, 1), "medium": (41, 29, 14, 2), "hard": (18, 11, 10, 3)}


def card_dirs(tmp_path: Path) -> tuple[Path, Path]:
    this_rows, base_rows = [], []
    qid = 0
    for tier, (this_correct, _, improved, regressed) in CARD.items():
        outcomes = [(True, False)] * improved + [(False, True)] * regressed
        outcomes += [(True, True)] * (this_correct - improved)
        outcomes += [(False, False)] * (50 - len(outcomes))
        for this_ok, base_ok in outcomes:
            qid += 1
            this_rows.append({"query_id": str(qid), "tier": tier, "correct": this_ok})
            base_rows.append({"query_id": str(qid), "tier": tier, "correct": base_ok})
    return write_eval_dir(tmp_path / "sft", this_rows), write_eval_dir(tmp_path / "base", base_rows)


def test_card_checks_print_exactly(tmp_path):
    this_dir, base_dir = card_dirs(tmp_path)
    report = build_report(this_dir, base_dir)
    for tier, (this_correct, base_correct, _, _) in CARD.items():
        assert (report.tier(tier).correct, report.tier(tier).total) == (this_correct, 50)
        assert report.baseline.tier(tier).correct == base_correct

    md = render_markdown(report, name="This SFT model", baseline_name="Original Qwen3-4B")
    assert TABLE_HEADER in md
    assert "| Original Qwen3-4B | 43/50 | 29/50 | 11/50 | 83/150 (55.33%) |" in md
    assert "| This SFT model | 49/50 | 41/50 | 18/50 | 108/150 (72.00%) |" in md
    assert "Wilson 95% interval: 64.33–78.57%" in md
    assert "Paired improvement: 31 questions improved, 6 regressed, +16.67 percentage points" in md
    lo, hi = paired_difference_interval(77, 31, 6, 36)
    assert f"(95% CI {100 * lo:+.2f} to {100 * hi:+.2f}, Newcombe score;" in md

    paired = report.paired
    assert (paired["improved"], paired["regressed"], paired["n"]) == (31, 6, 150)
    assert (paired["both_correct"], paired["both_wrong"]) == (77, 36)
    assert paired["delta_pp"] == pytest.approx(100 * 25 / 150)
    assert paired["only_in_this"] == paired["only_in_baseline"] == []


def test_wilson_interval_matches_scipy_and_edges():
    lo, hi = wilson_interval(108, 150)
    assert f"{100 * lo:.2f}–{100 * hi:.2f}" == "64.33–78.57"
    ci = binomtest(83, 150).proportion_ci(method="wilson")
    assert wilson_interval(83, 150) == pytest.approx((ci.low, ci.high))
    z2 = norm.ppf(0.975) ** 2
    assert wilson_interval(0, 50) == pytest.approx((0.0, z2 / (50 + z2)))
    assert wilson_interval(0, 50)[0] == 0.0
    assert wilson_interval(50, 50) == pytest.approx((50 / (50 + z2), 1.0))
    assert wilson_interval(50, 50)[1] == 1.0
    assert all(math.isnan(x) for x in wilson_interval(0, 0))


def test_zero_and_all_correct_tiers_reach_the_bounds(tmp_path):
    rows = [{"query_id": f"e{i}", "tier": "easy", "correct": True} for i in range(50)]
    rows += [{"query_id": f"h{i}", "tier": "hard", "correct": False} for i in range(50)]
    rows += [{"query_id": f"m{i}", "tier": "medium", "correct": i < 25} for i in range(50)]
    report = build_report(write_eval_dir(tmp_path / "run", rows))
    assert report.tier("easy").wilson_95[1] == 1.0
    assert report.tier("hard").wilson_95[0] == 0.0
    md = render_markdown(report)
    assert "| this run | 50/50 | 25/50 | 0/50 | 75/150 (50.00%) |" in md
    assert "Easy 100.00% (Wilson 95%: 92.87–100.00%)" in md
    assert "Hard 0.00% (Wilson 95%: 0.00–7.13%)" in md


def test_missing_tier_is_shown_empty_not_dropped(tmp_path):
    rows = [
        {"query_id": "1", "tier": "easy", "correct": True},
        {"query_id": "2", "tier": "hard", "correct": False},
    ]
    report = build_report(write_eval_dir(tmp_path / "run", rows))
    assert [t.tier for t in report.tiers] == ["easy", "medium", "hard"]
    medium = report.tier("medium")
    assert (medium.correct, medium.total) == (0, 0)
    assert math.isnan(medium.accuracy)
    md = render_markdown(report)
    assert "| this run | 1/1 | 0/0 (—) | 0/1 | 1/2 (50.00%) |" in md
    assert "Medium — (Wilson 95%: —)" in md
    as_json = report.to_dict()
    assert as_json["tiers"][1] == {
        "tier": "medium",
        "correct": 0,
        "total": 0,
        "accuracy": None,
        "wilson_95": [None, None],
    }


def test_ungraded_failed_and_untiered_stay_in_the_denominator(tmp_path):
    rows = [
        {"query_id": "1", "tier": "easy", "correct": True, "status": "finish"},
        {"query_id": "2", "tier": "easy", "correct": None, "status": "ungraded"},
        {"query_id": "3", "tier": "medium", "correct": False, "status": "turns"},
        {"query_id": "4", "tier": "hard", "correct": None, "status": "error"},
        {"query_id": "5", "tier": None, "correct": True, "status": "finish"},
        {"query_id": "6", "tier": "bc_test_other", "correct": False, "status": "budget"},
    ]
    report = build_report(write_eval_dir(tmp_path / "run", rows))
    assert (report.correct, report.total) == (2, 6)
    assert (report.tier("easy").correct, report.tier("easy").total) == (1, 2)
    assert report.unknown_tier == 2
    assert report.status_counts == {"finish": 2, "budget": 1, "error": 1, "turns": 1, "ungraded": 1}
    assert report.wilson_95 == pytest.approx(wilson_interval(2, 6))
    md = render_markdown(report)
    assert "| this run | 1/2 | 0/1 | 0/1 | 2/6 (33.33%) |" in md
    assert "Without a known tier: 2 judgements" in md


def test_the_report_counts_the_episodes_the_no_search_guard_bounced_or_voided(tmp_path):
    from bcstack.evaluation.runner import guard_of
    from core.records import EpisodeRecord, WorkerRecord, WorkerTrajectory

    rows = [
        {"query_id": "1", "tier": "easy", "correct": True, "guard": "bounced"},
        {"query_id": "2", "tier": "easy", "correct": True, "guard": "bounced"},
        {"query_id": "3", "tier": "easy", "correct": False, "guard": "voided"},
        {"query_id": "4", "tier": "easy", "correct": True, "guard": None},
    ]
    report = build_report(write_eval_dir(tmp_path / "run", rows))
    assert report.guard_counts == {"bounced": 2, "voided": 1}
    assert "- No-search guard: 2 episode(s) had a search-free answer bounced" in render_markdown(report)
    with pytest.raises(ReportError, match="guard must be"):
        build_report(write_eval_dir(tmp_path / "bad", [{"query_id": "1", "correct": True, "guard": "x"}]))

    def record(*events: list[str]) -> EpisodeRecord:
        workers = [WorkerRecord(trajectory=WorkerTrajectory(events=list(e))) for e in events]
        return EpisodeRecord(episode_id="e", workers=workers)

    assert guard_of(record([])) is None
    assert guard_of(record(["finish_without_search"], [])) == "voided"
    # Bounced, then voided on the second search-free answer: the gold bit reached the worker.
    assert guard_of(record(["finish_without_search_bounced", "finish_without_search"])) == "bounced"


def test_evidence_recall_and_tool_call_averages_from_run_files(tmp_path):
    rows = [
        {
            "query_id": "1",
            "correct": True,
            "tools": {"search": 4, "open_page": 2},
            "retrieved": ["a", "b", "x"],
        },
        {"query_id": "2", "correct": False, "tools": {"search": 2, "open_page": 0}, "retrieved": ["c"]},
        {"query_id": "3", "correct": False, "tools": {"search": 6}, "retrieved": ["z"]},
        {
            "query_id": "1",
            "round": 1,
            "correct": True,
            "tools": {"search": 0, "open_page": 1},
            "retrieved": [],
        },
    ]
    questions = [
        {"query_id": "1", "evidence_docs": [{"docid": "a", "text": "…", "url": "u"}, {"docid": "b"}]},
        {"query_id": "2", "evidence_docs": ["c", "d", "e", "f"]},
        {"query_id": "3", "evidence_docs": []},  # no evidence: left out of the mean
    ]
    report = build_report(write_eval_dir(tmp_path / "run", rows, questions))
    assert report.rounds == [0, 1]
    assert report.avg_search_calls == pytest.approx(12 / 4)
    assert report.avg_open_page_calls == pytest.approx(3 / 4)
    # query 1 round 0: 2/2, query 2: 1/4, query 1 round 1: 0/2
    assert report.evidence_recall == pytest.approx((1 + 0.25 + 0) / 3)
    assert report.evidence_recall_n == 3
    md = render_markdown(report)
    assert "search 3.00, open_page 0.75" in md
    assert "Evidence recall: 41.67% (mean over 3 episodes" in md


def test_run_files_of_unsafe_ids_are_found_under_the_runners_name(tmp_path):
    rows = [{"query_id": "a/b c", "correct": True, "tools": {"search": 2}}, {"query_id": 7, "correct": False}]
    root = write_eval_dir(tmp_path / "run", rows)
    assert not (root / "runs" / "0" / "a").exists()
    report = build_report(root)
    assert (report.correct, report.total, report.avg_search_calls) == (1, 2, 1.0)


def test_optional_metrics_are_omitted_when_absent(tmp_path):
    report = build_report(
        write_eval_dir(tmp_path / "run", [{"query_id": "1", "tier": "easy", "correct": True}])
    )
    assert report.evidence_recall is None and report.calibration_error is None
    md = render_markdown(report)
    assert "Evidence recall" not in md and "Paired" not in md
    # No stated confidence: no calibration number, and the one judgement is counted as without one.
    assert (
        "- Calibration error (HLE-style RMS, β=100): — (calibration over 0 judgements with a stated "
        "confidence; 1 without one)"
    ) in md


def test_calibration_error_hand_computed():
    # sorted: (.1, 0) (.3, 1) | (.6, 1) (.8, 0) (.9, 1) -- the last bin takes the remainder.
    # bin 1: conf .2, acc .5; bin 2: conf 2.3/3, acc 2/3 -> sqrt(2/5 * .09 + 3/5 * .01)
    err = calibration_error([0.9, 0.1, 0.8, 0.3, 0.6], [True, False, False, True, True], beta=2)
    assert err == pytest.approx(math.sqrt(0.4 * 0.09 + 0.6 * 0.01))
    # Fewer items than beta: one bin.
    assert calibration_error([0.8, 0.6], [True, False]) == pytest.approx(0.2)


def test_calibration_error_is_zero_when_perfectly_calibrated():
    assert calibration_error([1.0, 1.0, 0.0, 0.0], [True, True, False, False], beta=2) == 0.0
    assert calibration_error([0.5] * 4, [True, False, True, False], beta=4) == 0.0
    assert (
        calibration_error([0.25] * 4 + [0.75] * 4, [True] + [False] * 3 + [True] * 3 + [False], beta=4) == 0.0
    )
    with pytest.raises(ValueError):
        calibration_error([1.5], [True])


def test_calibration_error_in_the_report_uses_confidence_percent(tmp_path):
    rows = [
        {"query_id": "1", "correct": True, "confidence": 90},
        {"query_id": "2", "correct": None, "confidence": 60},  # ungraded: incorrect here too
        {"query_id": "3", "correct": False, "confidence": None},  # no confidence: not in the metric
    ]
    report = build_report(write_eval_dir(tmp_path / "run", rows))
    assert (report.calibration_n, report.calibration_unstated) == (2, 1)
    assert report.calibration_error == pytest.approx(calibration_error([0.9, 0.6], [True, False]))
    assert report.calibration_error == pytest.approx(0.25)
    assert (
        "Calibration error (HLE-style RMS, β=100): 25.00% (calibration over 2 judgements with a "
        "stated confidence; 1 without one)"
    ) in render_markdown(report)


def test_unfinished_episodes_without_a_confidence_are_left_out_of_calibration(tmp_path):
    # The untrained model of the demo: nothing finished, so nothing states a confidence. Read as
    # 0% confidence it would score a perfect 0.00% calibration error; it has no calibration at all.
    rows = [{"query_id": str(i), "correct": False, "status": "branches"} for i in range(150)]
    report = build_report(write_eval_dir(tmp_path / "tiny", rows))
    assert report.calibration_error is None
    assert (report.calibration_n, report.calibration_unstated) == (0, 150)
    md = render_markdown(report)
    assert "Calibration error (HLE-style RMS, β=100): — (calibration over 0 judgements" in md
    assert "0.00% (calibration" not in md
    data = report.to_dict()
    assert (data["calibration_error"], data["calibration_n"], data["calibration_unstated"]) == (None, 0, 150)

    # Mixed: only the stated confidences are binned; an old file's 0 still reads as stated.
    rows[0].update(correct=True, confidence=90)
    rows[1].update(confidence=0)
    report = build_report(write_eval_dir(tmp_path / "mixed", rows))
    assert (report.calibration_n, report.calibration_unstated) == (2, 148)
    assert report.calibration_error == pytest.approx(calibration_error([0.9, 0.0], [True, False]))


# Published 95% limits of Newcombe's method 10, (a both, b run 1 only, c run 2 only, d neither):
# Newcombe 1998 (Stat. Med. 17:2635) worked examples, the first also pinned in the ratesci R
# package's tests as "Newcombe's method 10 result"; Tang, Ling & Tian 2010's example as ratesci
# reproduces it; Fagerland, Lydersen & Laake 2014 (Stat. Med. 33:2850) Table II, to 3 decimals.
NEWCOMBE_PUBLISHED = [
    ((20, 12, 2, 16), (0.0562, 0.3292), 4),
    ((36, 12, 2, 0), (0.0569, 0.3404), 4),
    ((27, 0, 0, 27), (-0.0351, 0.0351), 4),
    ((8, 3, 1, 2), (-0.1574, 0.4136), 4),
    ((1, 1, 7, 12), (-0.507, -0.026), 3),
]


@pytest.mark.parametrize(("counts", "limits", "places"), NEWCOMBE_PUBLISHED)
def test_paired_interval_reproduces_published_newcombe_limits(counts, limits, places):
    lo, hi = paired_difference_interval(*counts)
    assert (round(lo, places), round(hi, places)) == limits
    # Swapping the runs mirrors the interval.
    a, b, c, d = counts
    assert paired_difference_interval(a, c, b, d) == pytest.approx((-hi, -lo))


def test_paired_interval_at_the_boundary_is_not_a_point():
    # 0 improved, 150 regressed: the Wald interval was -100.00 to -100.00.
    lo, hi = paired_difference_interval(0, 0, 150, 0)
    assert lo == pytest.approx(-1.0)
    z2 = norm.ppf(0.975) ** 2
    assert hi == pytest.approx(-1 + math.sqrt(2) * z2 / (150 + z2))  # both Wilson limits 150/150 apart
    assert hi - lo > 0.03
    base = {(str(i), 0): True for i in range(150)}
    paired = paired_comparison(dict.fromkeys(base, False), base)
    assert paired["delta_pp"] == -100.0
    assert paired["delta_ci_pp"] == pytest.approx((100 * lo, 100 * hi))
    assert paired["mcnemar_p"] == pytest.approx(2 * 0.5**150)
    assert all(math.isnan(x) for x in paired_difference_interval(0, 0, 0, 0))


def test_paired_mcnemar_p_and_interval_against_scipy_and_the_formula():
    # b = 9 improved, c = 3 regressed, 20 concordant pairs (10 both right, 10 both wrong).
    base = {(str(i), 0): 9 <= i < 12 or i >= 22 for i in range(32)}
    this = {(str(i), 0): i < 9 or i >= 22 for i in range(32)}
    paired = paired_comparison(this, base)
    b, c, n = 9, 3, 32
    assert (paired["improved"], paired["regressed"], paired["n"]) == (b, c, n)
    assert paired["mcnemar_p"] == pytest.approx(binomtest(min(b, c), b + c, 0.5).pvalue)
    assert paired["delta_pp"] == pytest.approx(100 * (b - c) / n)
    lo, hi = paired_difference_interval(10, b, c, 10)
    assert paired["delta_ci_pp"] == pytest.approx((100 * lo, 100 * hi))
    assert lo < (b - c) / n < hi


def test_paired_with_no_discordant_pairs_has_p_one_and_a_real_interval():
    same = {("1", 0): True, ("2", 0): False}
    paired = paired_comparison(same, dict(same))
    assert paired["mcnemar_p"] == 1.0 and paired["delta_pp"] == 0.0
    lo, hi = paired["delta_ci_pp"]
    assert lo == pytest.approx(-hi) and hi > 0


def test_several_rounds_are_also_compared_with_questions_as_the_units():
    # 6 questions x 4 rounds. Question 0 goes 0/4 -> 4/4, questions 1-4 go 1/4 -> 2/4, question 5
    # goes 3/4 -> 2/4: per-question mean differences +1, +.25 x 4, -.25.
    base, this = {}, {}
    for r in range(4):
        base[("0", r)], this[("0", r)] = False, True
        for q in "1234":
            base[(q, r)], this[(q, r)] = r == 0, r <= 1
        base[("5", r)], this[("5", r)] = r < 3, r < 2
    q = paired_comparison(this, base)["by_question"]
    d = [1.0, 0.25, 0.25, 0.25, 0.25, -0.25]
    assert (q["questions"], q["rounds_per_question"], q["improved"], q["regressed"]) == (6, [4, 4], 5, 1)
    assert q["delta_pp"] == pytest.approx(100 * sum(d) / 6)
    assert q["wilcoxon_p"] == pytest.approx(wilcoxon(d).pvalue)
    lo, hi = q["delta_ci_pp"]
    assert lo < q["delta_pp"] < hi and lo >= -25 and hi <= 100
    assert paired_comparison(this, base)["by_question"] == q  # seeded: the same report twice
    # The question-level test is weaker than McNemar over the 24 pairs, as it should be.
    assert q["wilcoxon_p"] > paired_comparison(this, base)["mcnemar_p"]
    # One round per question: nothing to add to McNemar.
    one = {k: v for k, v in this.items() if k[1] == 0}
    assert question_level_comparison(one, {k: base[k] for k in one}) is None


def test_keys_in_only_one_run_are_reported(tmp_path):
    this = write_eval_dir(tmp_path / "a", [{"query_id": q, "correct": True} for q in ("1", "2", "3", "4")])
    rows = [{"query_id": q, "correct": False} for q in ("2", "3", "4", "5")]
    rows.append({"query_id": "2", "round": 1, "correct": False})
    base = write_eval_dir(tmp_path / "b", rows)
    report = build_report(this, base)
    assert report.paired["n"] == 3 and report.paired["improved"] == 3
    assert report.paired["only_in_this"] == [["1", 0]]
    assert report.paired["only_in_baseline"] == [["2", 1], ["5", 0]]
    md = render_markdown(report)
    assert "Only in this run (not paired): 1 (round 0)." in md
    assert "Only in baseline (not paired): 2 (round 1), 5 (round 0)." in md


def test_write_report_writes_markdown_json_and_png(tmp_path):
    this_dir, base_dir = card_dirs(tmp_path)
    report = build_report(this_dir, base_dir)
    paths = write_report(report, this_dir)
    assert set(paths) == {"markdown", "json", "png"}
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert TABLE_HEADER in paths["markdown"].read_text(encoding="utf-8")

    def no_nan(token: str) -> None:
        raise AssertionError(f"report.json holds {token}")

    data = json.loads(paths["json"].read_text(encoding="utf-8"), parse_constant=no_nan)
    assert data["correct"] == 108 and data["baseline"]["correct"] == 83
    assert data["paired"]["improved"] == 31
    assert data["paired"]["delta_ci_pp"] == pytest.approx(list(report.paired["delta_ci_pp"]))
    assert data["paired"]["delta_ci_method"].startswith("Newcombe")
    # The card's judgements state no confidence: no calibration, and the count says why.
    assert (data["calibration_error"], data["calibration_n"], data["calibration_unstated"]) == (None, 0, 150)

    # The PNG carries each run's calibration line under the bars (wrapped to the figure's width).
    footer = " ".join(" ".join(t.get_text().split()) for t in report_figure(report, "SFT", "Base").texts)
    for label in ("SFT", "Base"):
        assert (
            f"{label}: Calibration error (HLE-style RMS, β=100): — (calibration over 0 judgements "
            "with a stated confidence; 150 without one)"
        ) in footer

    # Two empty tiers still plot (no bar, a dash).
    small = build_report(
        write_eval_dir(tmp_path / "small", [{"query_id": "1", "tier": "easy", "correct": True}])
    )
    png = write_report(small, tmp_path / "small")["png"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_corrupt_judgement_line_names_the_line(tmp_path):
    root = write_eval_dir(tmp_path / "run", [{"query_id": str(i), "correct": True} for i in range(3)])
    path = root / "judgements.jsonl"
    lines = path.read_text().splitlines()
    lines.insert(2, '{"query_id": "9", "round": 0, "correct": tru')
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ReportError, match=r"judgements\.jsonl:3: not valid JSON") as info:
        build_report(root)
    assert info.value.line == 3 and info.value.path == path


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ('{"query_id": "9", "round": "0", "correct": true}', "round must be an integer"),
        ('{"query_id": "9", "round": 0, "correct": "yes"}', "correct must be true, false or null"),
        ('{"query_id": "9", "round": 0, "correct": true, "confidence": 140}', "confidence must lie in"),
        ('{"round": 0, "correct": true}', "no 'query_id'"),
        ('{"query_id": "0", "round": 0, "correct": false}', "already judged on line 1"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_bad_judgement_lines_are_rejected(tmp_path, line, reason):
    root = write_eval_dir(tmp_path / "run", [{"query_id": "0", "correct": True}])
    with (root / "judgements.jsonl").open("a") as fh:
        fh.write(line + "\n")
    with pytest.raises(ReportError, match=rf"judgements\.jsonl:2: .*{reason}"):
        build_report(root)


def test_missing_or_bad_files_are_named(tmp_path):
    with pytest.raises(ReportError, match=r"judgements\.jsonl: missing"):
        build_report(tmp_path)
    root = write_eval_dir(
        tmp_path / "run", [{"query_id": "1", "correct": True}, {"query_id": "2", "correct": True}]
    )
    run = root / "runs" / "0" / "2.json"
    run.write_text('{\n "query_id": "2",\n "tool_call_counts": {"search": 1},\n')
    with pytest.raises(ReportError, match=r"runs/0/2\.json:4: not valid JSON"):
        build_report(root)
    run.unlink()
    with pytest.raises(ReportError, match=r"runs/0/2\.json: missing run file"):
        build_report(root)
    (root / "questions.jsonl").write_text('{"query_id": "1", "evidence_docs": []}\n{oops\n')
    write_eval_dir(root, [{"query_id": "1", "correct": True}])
    with pytest.raises(ReportError, match=r"questions\.jsonl:2"):
        build_report(root)


def test_round_consistency_counts_mean_majority_any_and_mixed_per_tier(tmp_path):
    outcomes = {
        ("1", "easy"): [True, True, True],
        ("2", "easy"): [True, False, True],  # right in most rounds
        ("3", "hard"): [False, True, False],  # right in fewer than half
        ("4", "hard"): [False, False, False],
    }
    rows = [
        {"query_id": q, "tier": tier, "round": r, "correct": ok}
        for (q, tier), results in outcomes.items()
        for r, ok in enumerate(results)
    ]
    c = round_consistency(write_eval_dir(tmp_path / "e", rows))
    assert set(c) == {"easy", "hard", "all"}  # a tier nobody asked is left out, not a 0/0
    assert c["easy"] == {
        "questions": 2,
        "rounds": 3,
        "mean": 100 * 5 / 6,
        "majority": 100.0,
        "any": 100.0,
        "mixed": 1,
    }
    assert c["hard"]["mean"] == pytest.approx(100 / 6) and c["hard"]["majority"] == 0.0
    assert c["hard"]["any"] == 50.0 and c["hard"]["mixed"] == 1
    assert c["all"]["mean"] == pytest.approx(50.0) and c["all"]["majority"] == 50.0 and c["all"]["mixed"] == 2
    # mean is over (question, round) pairs, as the report's accuracy; a 1-of-2 question is no majority
    uneven = [{"query_id": "1", "tier": "easy", "round": 0, "correct": True},
              {"query_id": "1", "tier": "easy", "round": 1, "correct": False},
              {"query_id": "2", "tier": None, "round": 0, "correct": None}]  # fmt: skip
    c = round_consistency(write_eval_dir(tmp_path / "u", uneven))
    assert c["easy"] == {"questions": 1, "rounds": 2, "mean": 50.0, "majority": 0.0, "any": 100.0, "mixed": 1}
    assert c["all"]["questions"] == 2  # the untiered question: in "all" only
    assert c["all"]["mean"] == pytest.approx(100 / 3)
    assert build_report(tmp_path / "u").accuracy == pytest.approx(1 / 3)
    with pytest.raises(ReportError, match="judgements.jsonl: missing"):
        round_consistency(tmp_path / "nothing")


def test_the_report_says_how_the_rounds_of_each_question_agree_when_there_are_several(tmp_path):
    rows = [
        {"query_id": q, "tier": "easy", "round": r, "correct": ok}
        for q, results in {"1": [True, True, True], "2": [True, False, False]}.items()
        for r, ok in enumerate(results)
    ]
    report = build_report(write_eval_dir(tmp_path / "three", rows))
    assert report.round_consistency == round_consistency(tmp_path / "three")
    assert report.to_dict()["round_consistency"]["easy"]["mixed"] == 1
    line = next(x for x in render_markdown(report).splitlines() if "Over the rounds" in x)
    assert line == (
        "- Over the rounds of each question (up to 3): right in most rounds 50.0%, in any round 100.0%, "
        "against 66.7% of pairs; 1 of 2 questions right in some rounds and not all "
        "(most / any by tier: Easy 50.0% / 100.0%)"
    )
    one = build_report(write_eval_dir(tmp_path / "one", [r for r in rows if r["round"] == 0]))
    assert one.round_consistency is None and "Over the rounds" not in render_markdown(one)
