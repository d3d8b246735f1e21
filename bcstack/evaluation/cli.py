"""`bcstack eval run` and `bcstack eval report`."""

from __future__ import annotations

import asyncio
from pathlib import Path

import typer

from core.kit.cli import fail

app = typer.Typer(
    help="Evaluation rounds through the gateway and the judge, and the seed-001 table.", no_args_is_help=True
)


def _urls_from_state(state: Path) -> tuple[str, str]:
    from bcstack.stack import StackError, read_state, running_pids

    try:
        info = read_state(state)
    except StackError as e:
        fail(str(e))
    if info is None or not running_pids(info):
        fail(
            f"no running stack in {state} (start one with `bcstack up --state {state}`, "
            "or pass --gateway and --judge)"
        )
    services = info["services"]
    return services["coordinator"]["http"], services["judge"]["http"]


@app.command("run")
def run(
    questions: Path = typer.Option(
        ...,
        "--questions",
        help="Questions: BrowseComp-Plus queries, a FoldAgent split, or toy world questions.",
    ),
    out: Path = typer.Option(..., "--out", help="Evaluation directory (resumed when it exists)."),
    gateway: str = typer.Option(None, "--gateway", help="Coordinator gateway URL (default: from --state)."),
    judge: str = typer.Option(None, "--judge", help="Judge proxy URL (default: from --state)."),
    state: Path = typer.Option(
        Path(".bcstack"), "--state", help="`bcstack up` state folder for default URLs."
    ),
    concurrency: int = typer.Option(8, "--concurrency", min=1, help="Episodes in flight."),
    rounds: int = typer.Option(1, "--rounds", min=1, help="Rounds over the questions."),
    limit: int = typer.Option(None, "--limit", min=1, help="Only the first N questions."),
    password: str = typer.Option(
        None,
        "--password",
        envvar="BCSTACK_EVAL_PASSWORD",
        help="Decryption password of BrowseComp-Plus queries.",
    ),
    qrels: Path = typer.Option(None, "--qrels", help="TREC qrels with the evidence documents."),
    max_turns: int = typer.Option(None, "--max-turns", min=1, help="Coordinator turns per episode."),
    max_branches: int = typer.Option(None, "--max-branches", min=1, help="Worker branches per episode."),
    worker_max_tokens: int = typer.Option(
        None, "--worker-max-tokens", min=1, help="Worker episode token budget."
    ),
    worker_max_turns: int = typer.Option(None, "--worker-max-turns", min=1, help="Worker turns per episode."),
) -> None:
    """Run every question through the gateway, grade it with the judge, write run files and judgements.

    Killed and run again with the same --out, it resumes: finished (question, round) pairs are not
    redone. Budget-exhausted and failed episodes are recorded and count as incorrect.
    """
    from bcstack.evaluation.loaders import LoaderError, load_questions
    from bcstack.evaluation.runner import EvalRunError

    if gateway is None or judge is None:
        g, j = _urls_from_state(state)
        gateway, judge = gateway or g, judge or j
    try:
        items = load_questions(questions, password=password, qrels=qrels)
    except LoaderError as e:
        fail(str(e))
    if limit is not None:
        items = items[:limit]
    if not items:
        fail(f"{questions}: no questions")
    overrides = {k: v for k, v in {"max_turns": max_turns, "max_branches": max_branches}.items() if v}
    budget = {k: v for k, v in {"max_tokens": worker_max_tokens, "max_turns": worker_max_turns}.items() if v}
    try:
        run_with_progress(
            items,
            out,
            gateway,
            judge,
            concurrency=concurrency,
            rounds=rounds,
            overrides=overrides,
            budget=budget,
        )
    except EvalRunError as e:
        fail(f"{e} (finished questions are saved; run the same command again to resume)")
    typer.echo(f"done: {out}/judgements.jsonl; the table: bcstack eval report {out}")


def run_with_progress(
    items: list,
    out: Path,
    gateway: str,
    judge: str,
    *,
    concurrency: int = 8,
    rounds: int = 1,
    overrides: dict | None = None,
    budget: dict | None = None,
    label: str = "eval",
) -> dict[str, int]:
    """Run (or resume) an evaluation with a progress bar showing the accuracy so far; the tally.

    Raises EvalRunError when the gateway or the judge cannot be used.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from bcstack.evaluation.runner import EvalRunner

    runner = EvalRunner(
        out, gateway, judge, concurrency=concurrency, overrides=overrides, worker_budget=budget
    )
    run_id, tasks = runner.prepare(items, rounds)
    total = len(items) * rounds
    done_before = total - len(tasks)
    tally = {"correct": 0, "graded": 0, "total": total}
    typer.echo(
        f"{label}: {len(items)} question(s) x {rounds} round(s) -> {out} (gateway {gateway}, judge {judge})"
        + (f"; resuming, {done_before} already done" if done_before else "")
    )
    with Progress(
        TextColumn(f"[bold]{label}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[accuracy]}"),
        TimeElapsedColumn(),
    ) as progress:
        bar = progress.add_task(label, total=total, completed=done_before, accuracy="")

        def on_done(row: dict) -> None:
            tally["graded"] += 1
            tally["correct"] += row["correct"] is True
            share = 100 * tally["correct"] / tally["graded"]
            acc = f"accuracy so far {tally['correct']}/{tally['graded']} ({share:.1f}%)"
            progress.update(bar, advance=1, accuracy=acc)

        asyncio.run(runner.run(run_id, tasks, on_done))
    return tally


@app.command("report")
def report(
    eval_dir: Path = typer.Argument(..., help="An evaluation directory written by `bcstack eval run`."),
    baseline: Path = typer.Option(None, "--baseline", help="Another evaluation directory to compare with."),
    name: str = typer.Option(None, "--name", help="Row name for this run (default: the directory name)."),
    baseline_name: str = typer.Option(None, "--baseline-name", help="Row name for the baseline."),
) -> None:
    """Print the seed-001 table (per-tier counts, total, Wilson 95% interval, paired comparison).

    Writes report.md, report.json and report.png into the evaluation directory.
    """
    from bcstack.evaluation.report import ReportError, build_report, render_markdown, write_report

    names = {
        "name": name or eval_dir.resolve().name,
        "baseline_name": baseline_name or (baseline.resolve().name if baseline else "baseline"),
    }
    try:
        result = build_report(eval_dir, baseline)
        paths = write_report(result, eval_dir, **names)
    except ReportError as e:
        fail(str(e))
    typer.echo(render_markdown(result, **names))
    typer.echo("\n" + "  ".join(f"{kind}: {path}" for kind, path in paths.items()))
