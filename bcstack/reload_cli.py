"""`bcstack worker reload`: verify a checkpoint here, then hot-reload the worker replicas one at a time;
with `--canary N`, reload N of them first, evaluate them, and promote or roll back (bcstack.canary).

Exit codes: 0 every replica reloaded (a canary passed and was promoted), 1 stopped at a failure or
a canary that failed and was rolled back (the reason is printed), 2 bad input (options, a checkpoint
that fails verification, no admin token, replicas that cannot be listed or cannot take a canary).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from core.checkpoint import VerifyError, verify_checkpoint
from core.kit.cli import fail
from services.worker.rolling import (
    ReplicaDiscoveryError,
    ReplicaProgress,
    ReplicaResult,
    k8s_worker_urls,
    parse_worker_urls,
    rolling_reload,
)

TOKEN_ENV = "BCSTACK_ADMIN_TOKEN"

app = typer.Typer(add_completion=False, no_args_is_help=True)


@app.callback()
def worker() -> None:
    """Worker replicas: rolling hot reload."""  # a callback keeps `reload` a subcommand on its own too


def _results_table(results: list[ReplicaResult], target: str | None) -> Table:
    table = Table(title=f"weight_version per replica (target {target or 'as the workers name it'})")
    # Replica and version stay whole on a narrow terminal; the error wraps (it is printed in full below).
    table.add_column("replica", no_wrap=True, min_width=max(len(result.url) for result in results))
    table.add_column("state", no_wrap=True)
    table.add_column("weight_version", no_wrap=True)
    table.add_column("previous", no_wrap=True)
    table.add_column("seconds", no_wrap=True)
    errors = any(result.error for result in results)
    if errors:  # only then: an empty column would squeeze the others at 80 columns
        table.add_column("error", overflow="fold")
    style = {"reloaded": "green", "failed": "red", "skipped": "yellow"}
    for result in results:
        table.add_row(
            result.url,
            f"[{style[result.state]}]{result.state}[/]",
            result.weight_version or "?",
            result.previous_version or "",
            f"{result.seconds:.2f}" if result.seconds is not None else "",
            *([result.error or ""] if errors else []),
        )
    return table


@app.command("reload")
def reload(
    checkpoint: Path = typer.Option(
        ..., "--checkpoint", help="Exported checkpoint folder (verified here first)."
    ),
    workers: str = typer.Option(
        None, "--workers", help="Worker base URLs, comma separated, reloaded in order."
    ),
    k8s_selector: str = typer.Option(
        None,
        "--k8s-selector",
        help="Kubernetes label selector of the worker pods, listed through the Kubernetes API (in a pod "
        "as its ServiceAccount, elsewhere with KUBECONFIG or ~/.kube/config).",
    ),
    namespace: str = typer.Option(
        None,
        "--k8s-namespace",
        "-n",
        help="Kubernetes namespace (with --k8s-selector; default: the pod's own in the cluster, else the "
        "kubeconfig context's).",
    ),
    port: int = typer.Option(8002, "--k8s-port", help="Worker HTTP port (with --k8s-selector)."),
    weight_version: str = typer.Option(
        None, "--weight-version", help="Version name to report (default: the checkpoint folder's name)."
    ),
    path_on_workers: str = typer.Option(
        None,
        "--path-on-workers",
        help="The checkpoint path as the workers see it (default: --checkpoint); workers mount the volume "
        "at their own path.",
    ),
    timeout: float = typer.Option(600.0, "--timeout", min=0.1, help="Seconds per replica (reload + wait)."),
    canary: int = typer.Option(
        None,
        "--canary",
        min=1,
        help="Reload only the first N replicas, evaluate them on --eval, then promote to all or roll back.",
    ),
    eval_file: Path = typer.Option(
        None, "--eval", help="Canary questions (the files `bcstack eval run` reads), as worker episodes."
    ),
    min_accuracy: float = typer.Option(
        None, "--min-accuracy", min=0.0, max=1.0, help="Canary passes at this accuracy (0-1) or above."
    ),
    max_drop: float = typer.Option(
        None,
        "--max-drop",
        min=0.0,
        help="Canary passes when its accuracy is at most PP points below the old version's, measured at "
        "the same time on the same questions on the replicas not reloaded.",
    ),
    judge: str = typer.Option(None, "--judge", help="Judge URL that grades the canary's answers."),
    rounds: int = typer.Option(1, "--rounds", min=1, help="Episodes per canary question."),
    limit: int = typer.Option(None, "--limit", min=1, help="Only the first N canary questions."),
    password: str = typer.Option(
        None,
        "--password",
        envvar="BCSTACK_EVAL_PASSWORD",
        help="Decryption password of BrowseComp-Plus queries.",
    ),
    temperature: float = typer.Option(
        None,
        "--temperature",
        min=0.0,
        help="Sampling temperature of canary episodes (default: the workers').",
    ),
    worker_max_tokens: int = typer.Option(
        None, "--worker-max-tokens", min=1, help="Token budget of a canary episode (default: the workers')."
    ),
    worker_max_turns: int = typer.Option(
        None, "--worker-max-turns", min=1, help="Turns of a canary episode (default: the workers')."
    ),
    seed: int = typer.Option(
        None, "--seed", help="Sampling seed of canary episodes (round r uses seed + r)."
    ),
    task_template: Path = typer.Option(
        None,
        "--task-template",
        help="Text file of the worker task, with {question} where the question goes (default: the toy "
        "coordinator's task text).",
    ),
    rollback_checkpoint: str = typer.Option(
        None,
        "--rollback-checkpoint",
        help="The old weights' folder as the workers see it, for a rollback (default: the folder the "
        "canaries report they last loaded).",
    ),
    concurrency: int = typer.Option(4, "--concurrency", min=1, help="Canary episodes in flight per side."),
    report: Path = typer.Option(
        None, "--report", help="Write every canary step and the decision here (JSON)."
    ),
) -> None:
    """Verify CHECKPOINT, then reload the workers one at a time: POST /admin/reload, wait until the
    replica reports the new weight_version, then the next; stop at the first failure. The admin token
    comes from BCSTACK_ADMIN_TOKEN.

    With --canary N --eval FILE (--min-accuracy X | --max-drop PP) --judge URL: reload the first N
    replicas, run FILE's questions as worker episodes on those only (and, for --max-drop, on the others
    at the same time), grade them with the judge, then reload the rest if the canary passes, or
    reload the canaries back to the old weights if it fails."""
    if (workers is None) == (k8s_selector is None):
        fail("pass exactly one of --workers URL,... or --k8s-selector SELECTOR")
    canary_options = {
        "--eval": eval_file,
        "--min-accuracy": min_accuracy,
        "--max-drop": max_drop,
        "--judge": judge,
        "--rollback-checkpoint": rollback_checkpoint,
        "--report": report,
        "--task-template": task_template,
    }
    if canary is None:
        given = [name for name, value in canary_options.items() if value is not None]
        if given:
            fail(f"{', '.join(given)} belong(s) to a canary reload: add --canary N")
    else:
        if eval_file is None or judge is None:
            fail("--canary needs --eval QUESTIONS and --judge URL")
        if (min_accuracy is None) == (max_drop is None):
            fail("--canary needs exactly one of --min-accuracy X or --max-drop PP")
    token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        fail(f"{TOKEN_ENV} is not set; the workers' admin endpoints need the same bearer token")
    console = Console()
    questions, template = (
        _canary_inputs(eval_file, limit, password, task_template) if canary is not None else ([], "")
    )

    with console.status(f"Verifying {checkpoint}"):
        try:
            verify_checkpoint(checkpoint)
        except VerifyError as e:
            fail(f"checkpoint {checkpoint} failed verification, no replica touched: {e}")
    console.print(f"[green]verified[/] {checkpoint}")

    if workers is not None:
        urls = parse_worker_urls(workers)
    else:
        try:
            urls = k8s_worker_urls(k8s_selector, port=port, namespace=namespace)
        except ReplicaDiscoveryError as e:
            fail(str(e))
    if not urls:
        fail("no worker URLs given")
    version = weight_version or checkpoint.resolve().name
    # Workers resolve a relative path against their checkpoint root, not our working directory.
    on_workers = path_on_workers or str(checkpoint.resolve())
    if canary is not None:
        _canary(
            console,
            urls,
            token,
            canary=canary,
            checkpoint=on_workers,
            version=version,
            questions=questions,
            judge=judge.rstrip("/"),
            min_accuracy=min_accuracy,
            max_drop=max_drop,
            rounds=rounds,
            template=template,
            temperature=temperature,
            seed=seed,
            budget={
                k: v for k, v in {"max_tokens": worker_max_tokens, "max_turns": worker_max_turns}.items() if v
            },
            rollback_checkpoint=rollback_checkpoint,
            timeout=timeout,
            concurrency=concurrency,
            report_path=report,
        )
        return

    console.print(f"rolling reload of {len(urls)} replica(s) to {version!r} from {on_workers}")
    results = asyncio.run(
        rolling_reload(
            urls, on_workers, version, token, timeout=timeout, on_progress=_progress_printer(console)
        )
    )
    console.print(_results_table(results, version))
    failed = next((result for result in results if result.state == "failed"), None)
    if failed is not None:
        console.print(f"[red]stopped at {failed.url}:[/] {failed.error}")
        raise typer.Exit(1)
    console.print(f"[green]all {len(results)} replica(s) serve {version!r}[/]")


def _progress_printer(console: Console, step: str = "") -> Any:
    def show(event: ReplicaProgress) -> None:
        colour = {"reloaded": "green", "failed": "red", "skipped": "yellow"}.get(event.stage, "cyan")
        console.print(
            f"{step}[{event.index + 1}/{event.total}] {event.url} [{colour}]{event.stage}[/] {event.message}"
        )

    return show


def _canary_inputs(
    eval_file: Path, limit: int | None, password: str | None, task_template: Path | None
) -> tuple[list[Any], str]:
    """The canary's questions and task text, checked before any replica is touched."""
    from bcstack.evaluation.loaders import LoaderError, load_questions

    try:
        questions = load_questions(eval_file, password=password)
    except LoaderError as e:
        fail(str(e))
    questions = questions[:limit] if limit is not None else questions
    if not questions:
        fail(f"{eval_file}: no questions")
    if task_template is None:
        from devkit.toyworld.policies import WORKER_TASK_TEMPLATE

        template = WORKER_TASK_TEMPLATE
    else:
        try:
            template = task_template.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            fail(f"--task-template {task_template}: cannot read it ({e})")
    try:
        if "{question}" not in template or not template.format(question="?").strip():
            raise ValueError("it has no {question} placeholder")
    except (KeyError, IndexError, ValueError) as e:
        fail(
            f"--task-template {task_template or '(default)'}: {e}; write {{question}} where the question goes"
        )
    return questions, template


def _canary(console: Console, urls: list[str], token: str, **kw: Any) -> None:
    """Plan (exit 2 when the replicas cannot take a canary), run, print, write the report, exit."""
    import httpx
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from bcstack.canary import CanaryError, plan_canary, replica_statuses, run_canary

    async def statuses() -> list[Any]:
        async with httpx.AsyncClient(timeout=30.0) as client:
            return await replica_statuses(client, urls, token)

    try:
        plan = plan_canary(
            asyncio.run(statuses()),
            kw["canary"],
            checkpoint_on_workers=kw["checkpoint"],
            version=kw["version"],
            rollback_checkpoint=kw["rollback_checkpoint"],
            baseline=kw["max_drop"] is not None,
        )
    except CanaryError as e:
        fail(f"no replica touched: {e}")
    rule = (
        f"accuracy >= {100 * kw['min_accuracy']:g}%"
        if kw["min_accuracy"] is not None
        else f"at most {kw['max_drop']:g} pp below {plan.old_version!r}"
    )
    console.print(
        f"canary plan: {len(plan.canaries)} canary replica(s) {[s.url for s in plan.canaries]} load "
        f"{plan.version!r} (now {plan.old_version!r}); pass when {rule} on "
        f"{len(kw['questions'])} question(s) × {kw['rounds']}; rollback from {plan.rollback_checkpoint}"
    )
    episodes = len(kw["questions"]) * kw["rounds"]
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True,
    ) as progress:  # fmt: skip
        bars: dict[str, Any] = {}

        def on_episode(side: str) -> None:
            if side not in bars:
                bars[side] = progress.add_task(f"{side} episodes", total=episodes)
            progress.advance(bars[side])

        report = asyncio.run(
            run_canary(
                plan,
                kw["questions"],
                token=token,
                judge=kw["judge"],
                min_accuracy=kw["min_accuracy"],
                max_drop_pp=kw["max_drop"],
                rounds=kw["rounds"],
                template=kw["template"],
                temperature=kw["temperature"],
                seed=kw["seed"],
                budget=kw["budget"],
                timeout=kw["timeout"],
                concurrency=kw["concurrency"],
                say=console.print,
                on_reload=_progress_printer(console, "  "),
                on_episode=on_episode,
            )
        )
    table = Table(title="canary evaluation")
    for column in (
        "side",
        "weight_version",
        "correct",
        "accuracy",
        "Wilson 95%",
        "failed",
        "ungraded",
        "seconds",
    ):
        table.add_column(column, no_wrap=True)
    for side, summary in (("canary", report.canary), ("old", report.baseline)):
        if summary is None:
            continue
        low, high = summary["wilson_95"]
        table.add_row(
            side,
            summary["version"],
            f"{summary['correct']}/{summary['graded']}",
            f"{100 * summary['accuracy']:.1f}%" if summary["graded"] else "-",
            f"{100 * low:.1f}-{100 * high:.1f}%" if summary["graded"] else "-",
            str(len(summary["failed_episodes"])),
            str(len(summary["ungraded"])),
            f"{summary['seconds']:.1f}",
        )
    if report.canary is not None:
        console.print(table)
    if kw["report_path"] is not None:
        path = kw["report_path"]
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(report.to_json(), indent=2, default=str) + "\n")
        os.replace(tmp, path)
        console.print(f"report: {path}")
    colour = {"promoted": "green", "rolled back": "yellow", "failed": "red"}[report.decision]
    console.print(f"[{colour}]canary {report.decision}[/]: {(report.verdict or {}).get('reason', '')}")
    if report.decision != "promoted":
        raise typer.Exit(1)
