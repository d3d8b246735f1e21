"""`bcstack eval report`: the seed 001 evaluation table from an evaluation directory (DESIGN.md §8).

An evaluation directory holds ``judgements.jsonl`` (one line per question and round: ``query_id``,
``round``, ``tier``, ``correct``, ``confidence``, ``status``), ``runs/<round>/<query_id>.json``
(BrowseComp-Plus run files) and, optionally, ``questions.jsonl`` with each question's
``evidence_docs``. Nothing else is read.

The denominator is always every judgement line (questions x rounds): an ungraded (``correct:
null``), failed or budget-exhausted episode counts as incorrect, as BrowseComp-Plus scores an
incomplete run as wrong and seed 001 keeps budget-exhausted episodes in the denominator.

Metrics (REFERENCE.md, BrowseComp-Plus): accuracy per tier and in total with a Wilson 95% interval,
average ``search`` / ``open_page`` calls, evidence recall over ``retrieved_docids``, HLE-style RMS
calibration error, stop-reason counts, and with a baseline directory the paired comparison of the
card (improved / regressed, percentage-point difference with Newcombe's paired score interval,
exact McNemar test).

Calibration is measured only over judgements with a stated confidence (``confidence`` not null):
an episode that never finished states none, and scoring it at 0% would make an untrained model
look perfectly calibrated (0% confidence, 0% correct). Those judgements are counted separately
(``calibration_unstated``). Files written before the runner recorded null hold 0 there; they are
read as stated.
"""

from __future__ import annotations

import json
import math
import textwrap
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from scipy.stats import binomtest, bootstrap, wilcoxon

# The runner names run files; ids with unsafe characters get a sanitised, hashed name.
from bcstack.evaluation.runner import run_file_name

TIERS = ("easy", "medium", "hard")
CONFIDENCE_LEVEL = 0.95
CALIBRATION_BIN_SIZE = 100  # BrowseComp-Plus reports HLE's calibration error with beta = 100
JUDGEMENTS_FILE = "judgements.jsonl"
QUESTIONS_FILE = "questions.jsonl"
RUNS_DIR = "runs"
REPORT_FILES = {"markdown": "report.md", "json": "report.json", "png": "report.png"}
NOT_AVAILABLE = "—"
PAIRED_INTERVAL_METHOD = "Newcombe hybrid score (1998, method 10)"
QUESTION_TEST_METHOD = (
    "Wilcoxon signed-rank over per-question mean differences; percentile bootstrap interval"
)
BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0

Key = tuple[str, int]  # (query_id, round)


class ReportError(ValueError):
    """A missing or malformed file in an evaluation directory; the message names the file and line."""

    def __init__(self, path: Path, reason: str, line: int | None = None) -> None:
        self.path = path
        self.line = line
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {reason}")


# --- statistics: pure functions ---------------------------------------------------------------


def wilson_interval(correct: int, total: int, confidence: float = CONFIDENCE_LEVEL) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion, as fractions; ``(nan, nan)`` when total is 0.

    scipy's ``binomtest(...).proportion_ci(method="wilson")`` (no continuity correction, Newcombe
    1998 method 3); its bounds are exactly 0 when nothing is correct and exactly 1 when all is.
    """
    if total == 0:
        return (math.nan, math.nan)
    ci = binomtest(correct, total).proportion_ci(confidence_level=confidence, method="wilson")
    return (float(ci.low), float(ci.high))


def paired_difference_interval(
    both: int, improved: int, regressed: int, neither: int, confidence: float = CONFIDENCE_LEVEL
) -> tuple[float, float]:
    """Newcombe's hybrid score interval for a difference of paired proportions, as fractions.

    Pairs: a = ``both`` right, b = ``improved`` (right in run 1 only), c = ``regressed`` (right in
    run 2 only), d = ``neither``; n = a + b + c + d, p1 = (a + b)/n, p2 = (a + c)/n and the
    difference is theta = p1 - p2 = (b - c)/n. With (l1, u1) and (l2, u2) the Wilson score
    intervals of p1 and p2 (``wilson_interval``, scipy) and phi their estimated correlation,

        L = theta - sqrt((p1 - l1)^2 - 2 phi (p1 - l1)(u2 - p2) + (u2 - p2)^2)
        U = theta + sqrt((u1 - p1)^2 - 2 phi (u1 - p1)(p2 - l2) + (p2 - l2)^2)

    phi = C / sqrt((a + b)(c + d)(a + c)(b + d)), with C = ad - bc - n/2 when ad - bc > n/2, 0 when
    0 <= ad - bc <= n/2, ad - bc when it is negative, and phi = 0 when a margin is empty.
    Source: Newcombe 1998, "Improved confidence intervals for the difference between binomial
    proportions based on paired data", Stat. Med. 17:2635-2650, method 10 (the same interval is
    ratesci's ``pairbinci(method_RD="MOVER_newc", moverbase="wilson")`` and the "Newcombe
    square-and-add" interval of Fagerland, Lydersen & Laake 2014, Stat. Med. 33:2850). Written by
    hand: scipy has no paired-difference interval and statsmodels' score intervals are for
    independent samples. Unlike the Wald interval it does not collapse to a point when b or c is
    0 or n, and it stays inside [-1, 1]. ``(nan, nan)`` when n is 0.
    """
    a, b, c, d = both, improved, regressed, neither
    n = a + b + c + d
    if n == 0:
        return (math.nan, math.nan)
    p1, p2 = (a + b) / n, (a + c) / n
    l1, u1 = wilson_interval(a + b, n, confidence)
    l2, u2 = wilson_interval(a + c, n, confidence)
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    excess = a * d - b * c
    corrected = excess - n / 2 if excess > n / 2 else min(excess, 0)
    phi = corrected / math.sqrt(margins) if margins else 0.0
    below = (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2
    above = (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2
    theta = p1 - p2
    return (theta - math.sqrt(max(below, 0.0)), theta + math.sqrt(max(above, 0.0)))


def paired_comparison(
    this: dict[Key, bool], baseline: dict[Key, bool], confidence: float = CONFIDENCE_LEVEL
) -> dict[str, Any]:
    """Compare two runs on the (query_id, round) keys present in both.

    ``improved`` (b) = baseline wrong and this right, ``regressed`` (c) = the reverse,
    ``delta_pp`` = 100 (b - c) / n with Newcombe's hybrid score interval
    (``paired_difference_interval``, this run as run 1). The p-value is the exact (binomial)
    McNemar test, ``binomtest(min(b, c), b + c, 0.5)``, 1.0 when no pair is discordant.
    Keys present in only one run are listed, not silently dropped.
    """
    common = sorted(this.keys() & baseline.keys())
    counts = Counter((baseline[k], this[k]) for k in common)
    b, c = counts[(False, True)], counts[(True, False)]
    both, neither = counts[(True, True)], counts[(False, False)]
    n = len(common)
    lo, hi = paired_difference_interval(both, b, c, neither, confidence)
    return {
        "n": n,
        "improved": b,
        "regressed": c,
        "both_correct": both,
        "both_wrong": neither,
        "delta_pp": 100 * (b - c) / n if n else math.nan,
        "delta_ci_pp": (100 * lo, 100 * hi),
        "delta_ci_method": PAIRED_INTERVAL_METHOD,
        "confidence_level": confidence,
        "mcnemar_p": float(binomtest(min(b, c), b + c, 0.5).pvalue) if b + c else 1.0,
        "only_in_this": [list(k) for k in sorted(this.keys() - baseline.keys())],
        "only_in_baseline": [list(k) for k in sorted(baseline.keys() - this.keys())],
        "by_question": question_level_comparison(this, baseline, confidence),
    }


def question_level_comparison(
    this: dict[Key, bool], baseline: dict[Key, bool], confidence: float = CONFIDENCE_LEVEL
) -> dict[str, Any] | None:
    """The paired comparison with questions as the units, when some question has several rounds.

    McNemar's test treats every (question, round) pair as independent, but rounds of one question
    share its difficulty, so with several rounds it overstates the evidence. Here each question q
    contributes one number, d_q = (mean correct over its common rounds in this run) - (the same in
    the baseline); the test is Wilcoxon's signed-rank test on the d_q (zeros dropped, two-sided;
    scipy), and the interval is a percentile bootstrap of mean(d_q) over questions (seeded, so the
    report is reproducible). None when every question has at most one common round (McNemar is
    then exactly the question-level test).
    """
    rounds: dict[str, list[int]] = {}
    for query_id, round_ in sorted(this.keys() & baseline.keys()):
        rounds.setdefault(query_id, []).append(round_)
    if not rounds or max(len(r) for r in rounds.values()) < 2:
        return None
    d = np.array(
        [
            np.mean([this[(q, r)] for r in rs]) - np.mean([baseline[(q, r)] for r in rs])
            for q, rs in rounds.items()
        ]
    )
    nonzero = d[d != 0]
    p_value = float(wilcoxon(nonzero).pvalue) if nonzero.size else 1.0
    if np.all(d == d[0]):
        lo = hi = float(d[0])
    else:
        ci = bootstrap(
            (d,), np.mean, confidence_level=confidence, n_resamples=BOOTSTRAP_RESAMPLES,
            method="percentile", random_state=BOOTSTRAP_SEED,
        ).confidence_interval  # fmt: skip
        lo, hi = float(ci.low), float(ci.high)
    return {
        "questions": len(rounds),
        "rounds_per_question": [min(len(r) for r in rounds.values()), max(len(r) for r in rounds.values())],
        "improved": int((d > 0).sum()),
        "regressed": int((d < 0).sum()),
        "delta_pp": 100 * float(d.mean()),
        "delta_ci_pp": (100 * lo, 100 * hi),
        "wilcoxon_p": p_value,
        "method": QUESTION_TEST_METHOD,
    }


def round_consistency_line(c: dict[str, dict[str, float | int]]) -> str:
    """One line of `round_consistency`: how often the questions' rounds agree, in all and per tier."""
    a = c["all"]
    tiers = "; ".join(
        f"{t.capitalize()} {c[t]['majority']:.1f}% / {c[t]['any']:.1f}%" for t in TIERS if t in c
    )
    return (
        f"Over the rounds of each question (up to {a['rounds']}): right in most rounds {a['majority']:.1f}%, "
        f"in any round {a['any']:.1f}%, against {a['mean']:.1f}% of pairs; {a['mixed']} of {a['questions']} "
        f"questions right in some rounds and not all (most / any by tier: {tiers})"
    )


def question_level_line(q: dict[str, Any]) -> str:
    """One sentence for `question_level_comparison`'s result."""
    lo, hi = q["delta_ci_pp"]
    return (
        f"By question ({q['questions']} questions, {q['rounds_per_question'][0]}–"
        f"{q['rounds_per_question'][1]} rounds each): {q['improved']} improved, {q['regressed']} regressed "
        f"on their mean over rounds, {q['delta_pp']:+.2f} pp (bootstrap 95% CI {lo:+.2f} to {hi:+.2f}), "
        f"Wilcoxon signed-rank p = {_p_value(q['wilcoxon_p'])}."
    )


def calibration_error(
    confidences: list[float], correct: list[bool], beta: int = CALIBRATION_BIN_SIZE
) -> float:
    """HLE-style RMS calibration error with adaptive bins of ``beta`` items; confidences in [0, 1].

    Sort by confidence, cut into bins of ``beta`` consecutive items, the last bin taking the
    remainder (fewer than ``beta`` items make one bin), and return
    sqrt(sum_bins |bin|/n * (mean confidence in bin - accuracy in bin)^2).
    Source: ``calib_err`` in Hendrycks et al.'s outlier-exposure ``utils/calibration_tools.py``,
    used by Humanity's Last Exam (``hle_eval/run_judge_results.py``) and BrowseComp-Plus. Those
    scripts loop ``for i in range(len(bins) - 1)``, which leaves the last bin out (so they report 0
    for beta to 2*beta - 1 items); here every bin counts, as the formula says. Ties are broken by
    input order (stable sort).
    """
    if len(confidences) != len(correct):
        raise ValueError(f"{len(confidences)} confidences but {len(correct)} outcomes")
    if not confidences:
        raise ValueError("calibration error of no items")
    if beta < 1:
        raise ValueError(f"bin size must be at least 1, got {beta}")
    conf = np.asarray(confidences, dtype=float)
    if np.any((conf < 0) | (conf > 1)) or np.any(np.isnan(conf)):
        raise ValueError("confidences must lie in [0, 1]")
    order = np.argsort(conf, kind="stable")
    conf, acc = conf[order], np.asarray(correct, dtype=float)[order]
    n = len(conf)
    edges = [i * beta for i in range(max(1, n // beta))] + [n]
    total = 0.0
    for start, stop in zip(edges[:-1], edges[1:], strict=True):
        total += (stop - start) / n * (conf[start:stop].mean() - acc[start:stop].mean()) ** 2
    return float(math.sqrt(total))


# --- the report --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TierResult:
    """Correct/total for one tier; accuracy and Wilson bounds are fractions (nan for an empty tier)."""

    tier: str
    correct: int
    total: int
    accuracy: float
    wilson_95: tuple[float, float]


@dataclass
class Report:
    """Everything `bcstack eval report` prints; fractions in [0, 1] unless a name ends in ``_pp``."""

    eval_dir: str
    tiers: list[TierResult]  # always easy, medium, hard, in that order
    correct: int
    total: int  # every judgement line: questions x rounds
    accuracy: float
    wilson_95: tuple[float, float]
    unknown_tier: int  # lines with no or an unrecognised tier: in `total` only
    rounds: list[int]
    avg_search_calls: float
    avg_open_page_calls: float
    evidence_recall: float | None  # None when no question lists evidence docs
    evidence_recall_n: int
    calibration_error: float | None  # None when no judgement states a confidence
    calibration_n: int  # judgements with a stated confidence: the calibration error's items
    calibration_unstated: int  # judgements without one: in no calibration bin
    status_counts: dict[str, int]
    # Episodes where the workers' no-search guard fired: "bounced" (a right answer given before any
    # search was sent back: the worker learnt it was right, FoldAgent's rule, gold sent to workers),
    # "voided" (a search-free answer given up); gold_to_workers: how many episodes sent the gold.
    guard_counts: dict[str, int] = field(default_factory=dict)
    # With several rounds of some question: `round_consistency` of these judgements (per tier and
    # "all": the mean, majority-of-rounds and any-round rates in percent, the mixed questions).
    round_consistency: dict[str, dict[str, float | int]] | None = None
    paired: dict[str, Any] | None = None
    baseline: Report | None = None

    def tier(self, name: str) -> TierResult:
        return next(t for t in self.tiers if t.tier == name)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types: tuples become lists and nan becomes null."""
        return _json_safe(asdict(self))


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


@dataclass(frozen=True)
class _Judgement:
    query_id: str
    round: int
    tier: str | None
    correct: bool | None
    confidence: float | None
    status: str | None
    guard: str | None = None  # the no-search guard on this episode: "bounced", "voided" or None

    @property
    def key(self) -> Key:
        return (self.query_id, self.round)


def _jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    if not path.is_file():
        raise ReportError(path, "missing")
    with path.open(encoding="utf-8") as fh:
        for lineno, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ReportError(path, f"not valid JSON ({exc.msg})", lineno) from None
            if not isinstance(obj, dict):
                raise ReportError(path, "expected a JSON object", lineno)
            yield lineno, obj


def _as_id(value: Any) -> str | None:
    if isinstance(value, str) and value:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # BrowseComp-Plus ids are numeric strings; accept a bare number
    return None


def _parse_judgement(obj: dict[str, Any], path: Path, lineno: int) -> _Judgement:
    def bad(reason: str) -> ReportError:
        return ReportError(path, reason, lineno)

    for key in ("query_id", "round", "correct"):
        if key not in obj:
            raise bad(f"no {key!r}")
    query_id = _as_id(obj["query_id"])
    if query_id is None:
        raise bad(f"query_id must be a non-empty string, got {obj['query_id']!r}")
    rnd = obj["round"]
    if not isinstance(rnd, int) or isinstance(rnd, bool):
        raise bad(f"round must be an integer, got {rnd!r}")
    correct = obj["correct"]
    if correct is not None and not isinstance(correct, bool):
        raise bad(f"correct must be true, false or null, got {correct!r}")
    confidence = obj.get("confidence")
    if confidence is not None:
        if isinstance(confidence, bool) or not isinstance(confidence, int | float):
            raise bad(f"confidence must be a number or null, got {confidence!r}")
        if not 0 <= confidence <= 100:
            raise bad(f"confidence must lie in [0, 100], got {confidence!r}")
    tier, status = obj.get("tier"), obj.get("status")
    if tier is not None and not isinstance(tier, str):
        raise bad(f"tier must be a string or null, got {tier!r}")
    if status is not None and not isinstance(status, str):
        raise bad(f"status must be a string or null, got {status!r}")
    guard = obj.get("guard")
    if guard not in (None, "bounced", "voided"):
        raise bad(f"guard must be bounced, voided or null, got {guard!r}")
    return _Judgement(
        guard=guard,
        query_id=query_id,
        round=rnd,
        tier=tier.lower() if tier else None,
        correct=correct,
        confidence=None if confidence is None else float(confidence),
        status=status,
    )


def _load_judgements(eval_dir: Path) -> list[_Judgement]:
    path = eval_dir / JUDGEMENTS_FILE
    seen: dict[Key, int] = {}
    judgements = []
    for lineno, obj in _jsonl(path):
        j = _parse_judgement(obj, path, lineno)
        if j.key in seen:
            raise ReportError(
                path, f"query {j.query_id!r} round {j.round} already judged on line {seen[j.key]}", lineno
            )
        seen[j.key] = lineno
        judgements.append(j)
    if not judgements:
        raise ReportError(path, "no judgements")
    return judgements


@dataclass(frozen=True)
class _Run:
    tool_call_counts: dict[str, int]
    retrieved_docids: frozenset[str]


def _load_run(eval_dir: Path, j: _Judgement) -> _Run:
    path = eval_dir / RUNS_DIR / str(j.round) / f"{run_file_name(j.query_id)}.json"
    if not path.is_file():
        raise ReportError(path, f"missing run file for query {j.query_id!r} round {j.round}")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ReportError(path, f"not valid JSON ({exc.msg})", exc.lineno) from None
    if not isinstance(obj, dict):
        raise ReportError(path, "expected a JSON object")
    if _as_id(obj.get("query_id")) != j.query_id:
        raise ReportError(path, f"query_id {obj.get('query_id')!r} does not match the file name")
    counts = obj.get("tool_call_counts")
    if not isinstance(counts, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in counts.values()
    ):
        raise ReportError(path, "tool_call_counts must map tool names to non-negative integers")
    docids = obj.get("retrieved_docids")
    ids = _as_ids(docids) if isinstance(docids, list) else None
    if ids is None:
        raise ReportError(path, "retrieved_docids must be a list of docids")
    return _Run(tool_call_counts=counts, retrieved_docids=frozenset(ids))


def _as_ids(values: list[Any]) -> list[str] | None:
    ids = [_as_id(v) for v in values]
    return None if any(i is None for i in ids) else ids  # type: ignore[return-value]


def _load_evidence(eval_dir: Path) -> dict[str, frozenset[str]]:
    """query_id -> evidence docids; FoldAgent rows carry docs as {docid, text, url} or bare ids."""
    path = eval_dir / QUESTIONS_FILE
    if not path.is_file():
        return {}
    evidence: dict[str, frozenset[str]] = {}
    for lineno, obj in _jsonl(path):
        info = obj.get("extra_info") if isinstance(obj.get("extra_info"), dict) else {}
        query_id = _as_id(obj.get("query_id", info.get("query_id")))
        docs = obj.get("evidence_docs", info.get("evidence_docs")) or []
        if query_id is None or not isinstance(docs, list):
            raise ReportError(path, "expected query_id and a list of evidence_docs", lineno)
        ids = _as_ids([d.get("docid") if isinstance(d, dict) else d for d in docs])
        if ids is None:
            raise ReportError(path, "evidence_docs must be docids or {docid, ...} objects", lineno)
        evidence[query_id] = frozenset(ids)
    return evidence


def _tier_result(tier: str, correct: int, total: int) -> TierResult:
    return TierResult(
        tier=tier,
        correct=correct,
        total=total,
        accuracy=correct / total if total else math.nan,
        wilson_95=wilson_interval(correct, total),
    )


def round_consistency(eval_dir: Path) -> dict[str, dict[str, float | int]]:
    """How consistent a model is over the rounds of each question, per tier and in "all" (a tier no
    question has is left out): questions, rounds (the most any question had), and in percent of the
    questions or pairs

    - ``mean``: right (question, round) pairs, the accuracy the report gives;
    - ``majority``: questions right in more than half of their rounds, what the model would score if
      it always gave its most frequent outcome (a policy sharpened with nothing new learnt);
    - ``any``: questions right in at least one round (pass@k over the rounds);

    and ``mixed``, the questions right in some rounds and not all. ``majority - mean`` bounds what
    sharpening alone can gain; with one round all three rates are the accuracy (bench/rl_headroom.py).
    """
    return _round_consistency(_load_judgements(Path(eval_dir)))


def _round_consistency(judgements: list[_Judgement]) -> dict[str, dict[str, float | int]]:
    rounds: dict[tuple[str, str], list[bool]] = {}
    for j in judgements:
        rounds.setdefault((j.tier or "", j.query_id), []).append(j.correct is True)
    out: dict[str, dict[str, float | int]] = {}
    for tier in (*TIERS, "all"):
        asked = [v for (t, _), v in rounds.items() if tier in ("all", t)]
        if not asked:
            continue
        n = len(asked)
        out[tier] = {
            "questions": n,
            "rounds": max(len(v) for v in asked),
            "mean": 100.0 * sum(sum(v) for v in asked) / sum(len(v) for v in asked),
            "majority": 100.0 * sum(2 * sum(v) > len(v) for v in asked) / n,
            "any": 100.0 * sum(any(v) for v in asked) / n,
            "mixed": sum(0 < sum(v) < len(v) for v in asked),
        }
    return out


def build_report(eval_dir: Path, baseline_dir: Path | None = None) -> Report:
    """Read an evaluation directory (and optionally a baseline one) into a :class:`Report`."""
    report, outcomes = _summarise(Path(eval_dir))
    if baseline_dir is not None:
        report.baseline, baseline_outcomes = _summarise(Path(baseline_dir))
        report.paired = paired_comparison(outcomes, baseline_outcomes)
    return report


def _summarise(eval_dir: Path) -> tuple[Report, dict[Key, bool]]:
    """One directory's report (without a baseline) and its (query_id, round) -> correct outcomes."""
    judgements = _load_judgements(eval_dir)
    runs = [_load_run(eval_dir, j) for j in judgements]
    evidence = _load_evidence(eval_dir)

    tiers = [
        _tier_result(
            tier,
            sum(j.correct is True for j in judgements if j.tier == tier),
            sum(j.tier == tier for j in judgements),
        )
        for tier in TIERS
    ]
    total, correct = len(judgements), sum(j.correct is True for j in judgements)

    recalls = [
        len(run.retrieved_docids & evidence[j.query_id]) / len(evidence[j.query_id])
        for j, run in zip(judgements, runs, strict=True)
        if evidence.get(j.query_id)
    ]
    calibrated = [j for j in judgements if j.confidence is not None]
    statuses = Counter(j.status or "unknown" for j in judgements)

    report = Report(
        eval_dir=str(eval_dir),
        tiers=tiers,
        correct=correct,
        total=total,
        accuracy=correct / total,
        wilson_95=wilson_interval(correct, total),
        unknown_tier=sum(j.tier not in TIERS for j in judgements),
        rounds=sorted({j.round for j in judgements}),
        avg_search_calls=sum(r.tool_call_counts.get("search", 0) for r in runs) / total,
        avg_open_page_calls=sum(r.tool_call_counts.get("open_page", 0) for r in runs) / total,
        evidence_recall=sum(recalls) / len(recalls) if recalls else None,
        evidence_recall_n=len(recalls),
        calibration_error=(
            calibration_error(
                [j.confidence / 100 for j in calibrated], [j.correct is True for j in calibrated]
            )
            if calibrated
            else None
        ),
        calibration_n=len(calibrated),
        calibration_unstated=total - len(calibrated),
        status_counts=dict(sorted(statuses.items(), key=lambda kv: (-kv[1], kv[0]))),
        guard_counts={k: sum(j.guard == k for j in judgements) for k in ("bounced", "voided")},
        round_consistency=(
            _round_consistency(judgements)
            if len({j.key for j in judgements}) > len({j.query_id for j in judgements})
            else None
        ),
    )
    return report, {j.key: j.correct is True for j in judgements}


# --- rendering ---------------------------------------------------------------------------------


def _pct(fraction: float) -> str:
    return NOT_AVAILABLE if math.isnan(fraction) else f"{100 * fraction:.2f}%"


def _interval(bounds: tuple[float, float]) -> str:
    lo, hi = bounds
    return NOT_AVAILABLE if math.isnan(lo) else f"{100 * lo:.2f}–{100 * hi:.2f}%"


def _tier_cell(t: TierResult) -> str:
    return f"{t.correct}/{t.total}" if t.total else f"0/0 ({NOT_AVAILABLE})"


def _p_value(p: float) -> str:
    return f"{p:.3f}" if p >= 0.001 else f"{p:.1e}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def calibration_line(r: Report) -> str:
    """The calibration error and what it is over, as the Markdown and the PNG print it."""
    value = NOT_AVAILABLE if r.calibration_error is None else _pct(r.calibration_error)
    return (
        f"Calibration error (HLE-style RMS, β={CALIBRATION_BIN_SIZE}): {value} (calibration over "
        f"{r.calibration_n} judgements with a stated confidence; {r.calibration_unstated} without one)"
    )


def _table_row(name: str, r: Report) -> str:
    cells = [_cell(name), *(_tier_cell(t) for t in r.tiers), f"{r.correct}/{r.total} ({_pct(r.accuracy)})"]
    return "| " + " | ".join(cells) + " |"


def _keys(keys: list[list[Any]], limit: int = 10) -> str:
    shown = ", ".join(f"{q} (round {r})" for q, r in keys[:limit])
    return shown + (f", … ({len(keys) - limit} more)" if len(keys) > limit else "")


def render_markdown(report: Report, name: str = "this run", baseline_name: str = "baseline") -> str:
    """The seed-001-style table, the Wilson interval, the other metrics and the paired line."""
    r = report
    rounds = ", ".join(str(x) for x in r.rounds)
    lines = [
        "# Evaluation report",
        "",
        f"{r.total} judgements ({len(r.rounds)} round(s): {rounds}) from `{r.eval_dir}`. Ungraded, failed "
        "and budget-exhausted episodes stay in the denominator as incorrect.",
        "",
        "| Worker | Easy | Medium | Hard | Total |",
        "|---|---|---|---|---|",
    ]
    if r.baseline is not None:
        lines.append(_table_row(baseline_name, r.baseline))
    lines += [_table_row(name, r), "", f"Wilson 95% interval: {_interval(r.wilson_95)}", ""]

    per_tier = "; ".join(
        f"{t.tier.capitalize()} {_pct(t.accuracy)} (Wilson 95%: {_interval(t.wilson_95)})" for t in r.tiers
    )
    lines.append(f"- Per-tier accuracy: {per_tier}")
    if r.unknown_tier:
        lines.append(f"- Without a known tier: {r.unknown_tier} judgements (counted in Total only)")
    lines.append(
        f"- Average tool calls per episode: search {r.avg_search_calls:.2f}, "
        f"open_page {r.avg_open_page_calls:.2f}"
    )
    if r.evidence_recall is not None:
        lines.append(
            f"- Evidence recall: {_pct(r.evidence_recall)} (mean over {r.evidence_recall_n} episodes "
            "whose question lists evidence docs)"
        )
    lines.append(f"- {calibration_line(r)}")
    statuses = ", ".join(f"{status} {count}" for status, count in r.status_counts.items())
    lines.append(f"- Status: {statuses}")
    if r.guard_counts:
        lines.append(
            f"- No-search guard: {r.guard_counts.get('bounced', 0)} episode(s) had a search-free answer "
            f"bounced (the gold answer reached the worker, which then knew it was right), "
            f"{r.guard_counts.get('voided', 0)} voided"
        )
    if r.round_consistency:
        lines.append(f"- {round_consistency_line(r.round_consistency)}")
    if r.baseline is not None:
        lines.append(f"- {_cell(baseline_name)} Wilson 95% interval: {_interval(r.baseline.wilson_95)}")

    if r.paired is not None:
        p = r.paired
        lines.append("")
        if p["n"]:
            lo, hi = p["delta_ci_pp"]
            lines.append(
                f"Paired improvement: {p['improved']} questions improved, {p['regressed']} regressed, "
                f"{p['delta_pp']:+.2f} percentage points ({100 * p['confidence_level']:g}% CI "
                f"{lo:+.2f} to {hi:+.2f}, Newcombe score; exact McNemar p = {_p_value(p['mcnemar_p'])})"
            )
            lines.append(
                f"Paired over {p['n']} (question, round) pairs: both correct {p['both_correct']}, "
                f"both wrong {p['both_wrong']}."
            )
            if p.get("by_question"):
                lines.append(question_level_line(p["by_question"]))
        else:
            lines.append(f"Paired comparison: no (question, round) in common with {baseline_name}.")
        if p["only_in_this"]:
            lines.append(f"Only in {name} (not paired): {_keys(p['only_in_this'])}.")
        if p["only_in_baseline"]:
            lines.append(f"Only in {baseline_name} (not paired): {_keys(p['only_in_baseline'])}.")
    return "\n".join(lines) + "\n"


def _bar_values(r: Report) -> tuple[list[float], list[float], list[float], list[bool]]:
    """Heights and error-bar extents in percent for easy, medium, hard, total; empty tiers at 0."""
    groups = [(t.total, t.accuracy, t.wilson_95) for t in r.tiers] + [(r.total, r.accuracy, r.wilson_95)]
    heights, below, above, empty = [], [], [], []
    for total, acc, (lo, hi) in groups:
        empty.append(total == 0)
        heights.append(0.0 if total == 0 else 100 * acc)
        below.append(0.0 if total == 0 else 100 * (acc - lo))
        above.append(0.0 if total == 0 else 100 * (hi - acc))
    return heights, below, above, empty


def report_figure(report: Report, name: str, baseline_name: str) -> Any:
    """The PNG's figure: accuracy bars with Wilson intervals, each run's calibration line below."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    series = [(baseline_name, report.baseline)] if report.baseline is not None else []
    series.append((name, report))
    footer = [
        line
        for label, r in series
        for line in textwrap.wrap(f"{label}: {calibration_line(r)}", 118, subsequent_indent="    ")
    ]
    footer_in = 0.13 * len(footer) + 0.15
    fig = Figure(figsize=(6.4, 4.0 + footer_in), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    labels = [t.capitalize() for t in TIERS] + ["Total"]
    width = 0.8 / len(series)
    for i, (label, r) in enumerate(series):
        heights, below, above, empty = _bar_values(r)
        xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(labels))]
        ax.bar(xs, heights, width, yerr=[below, above], capsize=3, label=label)
        for x, is_empty in zip(xs, empty, strict=True):
            if is_empty:
                ax.text(x, 1, NOT_AVAILABLE, ha="center", va="bottom")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylim(0, 118)  # headroom above 100% for the legend
    ax.set_yticks(range(0, 101, 20))
    ax.set_ylabel("accuracy (%)")
    ax.set_title("Accuracy with Wilson 95% intervals")
    ax.legend(loc="upper center", ncols=len(series), frameon=False)
    height = fig.get_figheight()
    fig.text(0.01, 0.08 / height, "\n".join(footer), fontsize=6.5, ha="left", va="bottom")
    fig.tight_layout(rect=(0, footer_in / height, 1, 1))
    return fig


def write_report(
    report: Report, eval_dir: Path, name: str = "this run", baseline_name: str = "baseline"
) -> dict[str, Path]:
    """Write report.md, report.json and report.png into ``eval_dir``; returns their paths by kind."""
    eval_dir = Path(eval_dir)
    paths = {kind: eval_dir / filename for kind, filename in REPORT_FILES.items()}
    paths["markdown"].write_text(render_markdown(report, name, baseline_name), encoding="utf-8")
    paths["json"].write_text(
        json.dumps(report.to_dict(), indent=2, ensure_ascii=False, allow_nan=False) + "\n", encoding="utf-8"
    )
    report_figure(report, name, baseline_name).savefig(paths["png"], format="png")
    return paths
