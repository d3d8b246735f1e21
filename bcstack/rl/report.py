"""`bcstack train report OUT`: what an RL run did, from OUT/metrics.jsonl alone.

Writes OUT/report.png, four panels over the updates (reward; accuracy with its Wilson 95% band
and the held-out evaluation points with theirs; KL to the reference; policy lag, max and mean),
and OUT/report.md (first, last, mean, min and max of the main metrics, the count totals).

The accuracy band of an update is the Wilson score interval of ``accuracy`` over its
``graded_episodes`` (the correct count is ``round(accuracy * graded_episodes)``): the same
interval `bcstack eval report` prints, so a training curve and an evaluation read alike. An
update that appears more than once (a resumed run whose file was not trimmed) counts once, with
its last line.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from core.kit.cli import fail
from trainer.sinks import METRICS_FILE, MetricsFileError, read_metrics

REPORT_FILES = {"png": "report.png", "markdown": "report.md"}
# The rows of report.md's table, when present; both spellings of the throughput keys are read.
SUMMARY_METRICS = (
    "reward_mean",
    "accuracy",
    "kl",
    "policy_lag_max",
    "policy_lag_mean",
    "sampled_token_nll",
    "grad_norm",
    "rollout_tokens_per_s",
    "rollout_tokens_per_second",
    "train_tokens_per_s",
    "train_tokens_per_second",
    "export_seconds",
    "reload_seconds",
    "eval_accuracy",
)
# Per-update counts summed over the run.
COUNT_TOTALS = (
    "graded_episodes",
    "dropped_stale",
    "excluded_episodes",
    "zero_variance_groups",
    "rejected_trajectories",
    "dropped_mixed",
    "failed_branches",
    "discarded_inflight",
)
NOT_AVAILABLE = "—"


class RunReportError(ValueError):
    """An output folder with no metrics to report; the message names the file."""


@dataclass(frozen=True)
class MetricSummary:
    first: float
    last: float
    mean: float
    min: float
    max: float
    points: int


def _number(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def load_updates(out_dir: Path) -> list[dict[str, Any]]:
    """One record per update, in update order; RunReportError when there is none."""
    path = Path(out_dir) / METRICS_FILE
    if not path.is_file():
        raise RunReportError(f"{path}: no such file (is {out_dir} an output folder of `bcstack train rl`?)")
    by_update = {r["update"]: r for r in read_metrics(out_dir)}
    if not by_update:
        raise RunReportError(f"{path}: no complete metrics line yet")
    return [by_update[u] for u in sorted(by_update)]


def series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(updates, values) of the records where ``key`` holds a finite number."""
    points = [(r["update"], v) for r in records if (v := _number(r.get(key))) is not None]
    return [u for u, _ in points], [v for _, v in points]


def summarise(records: Sequence[dict[str, Any]], key: str) -> MetricSummary | None:
    _updates, values = series(records, key)
    if not values:
        return None
    return MetricSummary(
        first=values[0],
        last=values[-1],
        mean=math.fsum(values) / len(values),
        min=min(values),
        max=max(values),
        points=len(values),
    )


def count_total(records: Sequence[dict[str, Any]], key: str) -> int | None:
    values = [r[key] for r in records if isinstance(r.get(key), int) and not isinstance(r[key], bool)]
    return sum(values) if values else None


def accuracy_interval(accuracy: float, graded: int) -> tuple[float, float]:
    """Wilson 95% interval of an accuracy measured over ``graded`` episodes; (nan, nan) for none."""
    from bcstack.evaluation.report import wilson_interval

    return wilson_interval(round(accuracy * graded), graded)


def accuracy_band(records: Sequence[dict[str, Any]]) -> tuple[list[int], list[float], list[float]]:
    """(updates, low, high): the Wilson band of the updates with both accuracy and graded_episodes."""
    updates, lows, highs = [], [], []
    for r in records:
        accuracy, graded = _number(r.get("accuracy")), r.get("graded_episodes")
        if accuracy is not None and isinstance(graded, int) and graded > 0:
            low, high = accuracy_interval(accuracy, graded)
            updates.append(r["update"])
            lows.append(low)
            highs.append(high)
    return updates, lows, highs


def _fmt(value: float | None) -> str:
    if value is None or math.isnan(value):
        return NOT_AVAILABLE
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"  # throughputs: no 2e+04


def render_markdown(records: Sequence[dict[str, Any]], name: str) -> str:
    first, last = records[0]["update"], records[-1]["update"]
    lines = [
        f"# RL run report: {name}",
        "",
        f"{len(records)} updates ({first} to {last}) in {METRICS_FILE}; the curves are in "
        f"{REPORT_FILES['png']}.",
        "",
        "| metric | first | last | mean | min | max |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key in SUMMARY_METRICS:
        s = summarise(records, key)
        if s is not None:
            lines.append(
                f"| {key} | {' | '.join(_fmt(v) for v in (s.first, s.last, s.mean, s.min, s.max))} |"
            )
    lines.append("")
    band_updates, lows, highs = accuracy_band(records)
    if band_updates:
        final = next(r for r in records if r["update"] == band_updates[-1])
        lines.append(
            f"Accuracy at update {final['update']}: {_fmt(final['accuracy'])} over "
            f"{final['graded_episodes']} graded episodes (Wilson 95%: {_fmt(lows[-1])} to {_fmt(highs[-1])})."
        )
    eval_updates, eval_values = series(records, "eval_accuracy")
    if eval_updates:
        final = next(r for r in records if r["update"] == eval_updates[-1])
        interval = ""
        if (
            _number(final.get("eval_wilson_low")) is not None
            and _number(final.get("eval_wilson_high")) is not None
        ):
            interval = f" (Wilson 95%: {_fmt(final['eval_wilson_low'])} to {_fmt(final['eval_wilson_high'])})"
        lines.append(f"Held-out accuracy at update {eval_updates[-1]}: {_fmt(eval_values[-1])}{interval}.")
    if band_updates or eval_updates:
        lines.append("")
    totals = [(key, total) for key in COUNT_TOTALS if (total := count_total(records, key)) is not None]
    if totals:
        lines += ["| count | total over the run |", "| --- | ---: |"]
        lines += [f"| {key} | {total} |" for key, total in totals]
        lines.append("")
    return "\n".join(lines)


def _no_data(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in {METRICS_FILE}", ha="center", va="center", transform=ax.transAxes)


def report_figure(records: Sequence[dict[str, Any]], name: str) -> Any:
    """The PNG's figure: reward, accuracy (Wilson band, held-out points), KL and policy lag."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(11, 7.5), dpi=100)
    FigureCanvasAgg(fig)
    (reward_ax, acc_ax), (kl_ax, lag_ax) = fig.subplots(2, 2, sharex=True)
    marker = "o" if len(records) <= 40 else None

    updates, values = series(records, "reward_mean")
    reward_ax.plot(updates, values, marker=marker, markersize=3)
    reward_ax.set_title("Mean reward")
    if not updates:
        _no_data(reward_ax, "reward_mean")

    updates, values = series(records, "accuracy")
    acc_ax.plot(updates, values, marker=marker, markersize=3, label="rollouts")
    band_updates, lows, highs = accuracy_band(records)
    if band_updates:
        acc_ax.fill_between(band_updates, lows, highs, alpha=0.25, label="Wilson 95%")
    eval_updates, eval_values = series(records, "eval_accuracy")
    if eval_updates:
        by_update = {r["update"]: r for r in records}
        below, above = [], []
        for u, v in zip(eval_updates, eval_values, strict=True):
            low, high = (
                _number(by_update[u].get("eval_wilson_low")),
                _number(by_update[u].get("eval_wilson_high")),
            )
            below.append(0.0 if low is None else v - low)
            above.append(0.0 if high is None else high - v)
        acc_ax.errorbar(
            eval_updates,
            eval_values,
            yerr=[below, above],
            fmt="s",
            capsize=3,
            color="C3",
            label="held-out eval",
        )
    acc_ax.set_ylim(-0.02, 1.02)
    acc_ax.set_title("Accuracy")
    if updates or eval_updates:
        acc_ax.legend(loc="best", frameon=False, fontsize=8)
    else:
        _no_data(acc_ax, "accuracy")

    updates, values = series(records, "kl")
    kl_ax.plot(updates, values, marker=marker, markersize=3, color="C2")
    kl_ax.set_title("KL to the reference (k3)")
    kl_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    if not updates:
        _no_data(kl_ax, "kl")

    highest = None
    for key, label in (("policy_lag_max", "max"), ("policy_lag_mean", "mean")):
        updates, values = series(records, key)
        if updates:
            lag_ax.plot(updates, values, marker=marker, markersize=3, label=label)
            highest = max(values) if highest is None else max(highest, *values)
    lag_ax.set_title("Policy lag (versions)")
    lag_ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    if highest is not None:
        lag_ax.set_ylim(-0.1, highest * 1.3 + 0.4)  # headroom for the legend above the lines
        lag_ax.legend(loc="upper left", ncols=2, frameon=False, fontsize=8)
    else:
        _no_data(lag_ax, "policy_lag_max")

    for ax in (reward_ax, acc_ax, kl_ax, lag_ax):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (kl_ax, lag_ax):
        ax.set_xlabel("update")
    fig.suptitle(f"{name}: {len(records)} updates ({records[0]['update']} to {records[-1]['update']})")
    fig.tight_layout()
    return fig


def write_report(out_dir: Path) -> dict[str, Path]:
    """Write OUT/report.png and OUT/report.md; returns their paths by kind."""
    out_dir = Path(out_dir)
    records = load_updates(out_dir)
    name = out_dir.resolve().name
    paths = {kind: out_dir / filename for kind, filename in REPORT_FILES.items()}
    report_figure(records, name).savefig(paths["png"], format="png")
    paths["markdown"].write_text(render_markdown(records, name), encoding="utf-8")
    return paths


def report(
    out: Path = typer.Argument(..., help="An output folder of `bcstack train rl` (it holds metrics.jsonl)."),
) -> None:
    """Plot and summarise an RL run from OUT/metrics.jsonl: OUT/report.png and OUT/report.md.

    The PNG plots reward, accuracy (Wilson 95% band, held-out points), KL and policy lag over the
    updates; the Markdown has first, last and mean of the main metrics and the count totals.
    """
    try:
        paths = write_report(out)
    except (RunReportError, MetricsFileError) as e:
        fail(str(e), code=1)
    typer.echo(paths["markdown"].read_text(encoding="utf-8"))
    typer.echo("  ".join(f"{kind}: {path}" for kind, path in paths.items()))
