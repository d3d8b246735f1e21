"""`bcstack eval run` and `bcstack eval report`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import typer

from core.kit.cli import fail

app = typer.Typer(
    help="Evaluation rounds through the gateway and the judge, and the seed-001 table.", no_args_is_help=True
)


def _urls_from_state(state: Path) -> tuple[str, str]:
    from bcstack.stack import StackError, gateway_url, read_state, running_pids

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
    return gateway_url(info) or "", services["judge"]["http"]


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
    worker_gold: bool = typer.Option(
        True,
        "--worker-gold/--no-worker-gold",
        help="Send the gold answer to the workers' no-search guard, which bounces a right answer given "
        "before any search once (FoldAgent's rule: it tells the worker the answer is right). "
        "--no-worker-gold: no gold reaches a worker; every search-free answer is voided.",
    ),
    seed: int = typer.Option(
        None,
        "--seed",
        min=0,
        max=2**53 - 1,
        help="Seed every episode's sampling from this, the question and the round (default: fresh "
        "entropy). Two models evaluated with one seed are compared with common random numbers: "
        "fewer of the paired test's pairs split on the sampling draw alone.",
    ),
    service_wait: float = typer.Option(
        120.0,
        "--service-wait",
        min=0,
        help="Seconds to wait for a gateway or judge that cannot be reached (crashed, restarting) "
        "before the run stops (resumable).",
    ),
) -> None:
    """Run every question through the gateway, grade it with the judge, write run files and judgements.

    Killed and run again with the same --out, it resumes: finished (question, round) pairs are not
    redone. Budget-exhausted and failed episodes are recorded and count as incorrect. A gateway or
    judge that crashes and comes back within --service-wait is waited for; one still away stops the run.
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
            service_wait=service_wait,
            worker_gold=worker_gold,
            seed=seed,
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
    service_wait: float | None = None,
    after_each: Callable[[int], None] | None = None,
    worker_gold: bool = True,
    seed: int | None = None,
) -> dict[str, int]:
    """Run (or resume) an evaluation with a progress bar showing the accuracy so far; the tally.

    after_each: called with the number of questions graded so far after each one (on the event
    loop: it must not block).

    Raises EvalRunError when the gateway or the judge cannot be used.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from bcstack.evaluation.runner import EvalRunner

    waits = {} if service_wait is None else {"service_wait": service_wait}
    runner = EvalRunner(
        out, gateway, judge, concurrency=concurrency, overrides=overrides, worker_budget=budget,
        worker_gold=worker_gold, seed=seed, **waits,
    )  # fmt: skip
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
            if after_each is not None:
                after_each(tally["graded"])

        asyncio.run(runner.run(run_id, tasks, on_done))
    return tally


@app.command("decrypt")
def decrypt(
    questions: Path = typer.Option(
        ..., "--questions", help="BrowseComp-Plus queries, obfuscated (JSON lines or Parquet)."
    ),
    out: Path = typer.Option(..., "--out", help="The clear JSON lines file to write (mode 600)."),
    password: str = typer.Option(
        ...,
        "--password",
        envvar="BCSTACK_EVAL_PASSWORD",
        help="The benchmark's canary string (BrowseComp-Plus' README gives it); better from the env var.",
    ),
) -> None:
    """Decrypt BrowseComp-Plus queries into clear JSON lines (query_id, query, answer, evidence_docs,
    gold_docs): what `bcstack eval run --questions` and the trainer read without a password. Keep the
    file off the web: it holds the benchmark's answers."""
    from bcstack.evaluation.loaders import LoaderError, decrypt_file

    try:
        count = decrypt_file(questions, out, password=password)
    except LoaderError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot write {out}: {exc.strerror or exc}")
    typer.echo(f"decrypted {count} queries into {out}", err=True)


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


@app.command("passk")
def passk(
    model: list[str] = typer.Option(
        [],
        "--model",
        help="A model, repeatable: NAME=DIR (a model folder; a CPU engine is started for it) or NAME=URL "
        "(a running SGLang or `bcstack serve engine`). DIR or URL alone names it after the folder.",
    ),
    engine: list[str] = typer.Option(
        [],
        "--engine",
        help="A model served by a running engine, repeatable: NAME=URL (the same as --model NAME=URL).",
    ),
    prompts: list[str] = typer.Option(
        ...,
        "--prompts",
        help="A benchmark, repeatable: NAME=FILE[:verifier=math|code|if][:greedy]. FILE is JSONL of prompt + "
        "label rows (DAPO-Math-17k's form). greedy: one greedy response per prompt (instruction following).",
    ),
    out: Path = typer.Option(
        ..., "--out", help="Folder for responses.jsonl, results.json, table.md/.csv, passk.png."
    ),
    samples: int = typer.Option(4, "--samples", min=1, help="Sampled responses per prompt (seed 004: 4)."),
    temperature: float = typer.Option(
        0.7, "--temperature", min=0.0, help="Sampling temperature (seed 004: 0.7)."
    ),
    top_p: float = typer.Option(0.8, "--top-p", min=0.0, max=1.0, help="Nucleus sampling (seed 004: 0.8)."),
    top_k: int = typer.Option(20, "--top-k", min=-1, help="Top-k, -1 for off (seed 004: 20)."),
    max_new_tokens: int = typer.Option(
        16_384, "--max-response-tokens", min=1, help="Response cap (seed 004: 16,384)."
    ),
    baseline: str | None = typer.Option(
        None,
        "--baseline",
        help="Model NAME the others are compared with (paired intervals, length ratio).",
        show_default=False,
    ),
    seed: int = typer.Option(
        0, "--seed", help="Sampling seeds derive from it, the prompt and the sample index."
    ),
    limit: int | None = typer.Option(
        None, "--limit", min=1, help="First N prompts of each benchmark.", show_default=False
    ),
    concurrency: int = typer.Option(64, "--concurrency", min=1, help="Prompts in flight per model."),
) -> None:
    """Single-turn pass@k of every model on every benchmark (seed 004's protocol and table).

    pass@1 is the mean success over the sampled responses, pass@k the unbiased estimator; with
    --baseline, paired 95% intervals (bootstrap over prompts) and response-length ratios. A killed run
    resumes from OUT/responses.jsonl without redoing finished prompts.
    """
    from rich.console import Console
    from rich.markdown import Markdown
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from bcstack.evaluation.passk import PasskError, parse_benchmark, parse_model, run_passk
    from core.single_turn import PromptError, SamplingSettings
    from core.verifiers import VerifierError

    console = Console(stderr=True)
    try:
        for e in engine:
            if not e.partition("=")[2].startswith(("http://", "https://")) and not e.startswith("http"):
                raise PasskError(f"--engine {e!r}: expected NAME=URL (http or https)")
        models = [parse_model(m) for m in [*model, *engine]]
        benches = [parse_benchmark(p) for p in prompts]
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        ) as bar:

            def progress(name: str, total: int, done: int):  # type: ignore[no-untyped-def]
                task = bar.add_task(f"{name}: prompts", total=total, completed=done)
                return lambda n: bar.advance(task, n)

            results = run_passk(
                models,
                benches,
                out,
                samples=samples,
                sampling=SamplingSettings(temperature, top_p, top_k, max_new_tokens),
                baseline=baseline,
                seed=seed,
                concurrency=concurrency,
                limit=limit,
                progress=progress,
            )
    except (PasskError, PromptError, VerifierError, OSError) as error:
        fail(" ".join(str(error).split()))
    from bcstack.evaluation.passk import render_table

    Console().print(Markdown(render_table(results)))
    console.print(f"wrote {out}/results.json, table.md, table.csv, passk.png")
