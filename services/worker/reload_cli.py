"""`bcstack worker reload`: verify a checkpoint here, then hot-reload the worker replicas one at a time.

Exit codes: 0 every replica reloaded, 1 stopped at a failure (the reason is printed), 2 bad input
(options, a checkpoint that fails verification, no admin token, replicas that cannot be listed).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

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
    table.add_column("seconds")
    table.add_column("error", overflow="fold")
    style = {"reloaded": "green", "failed": "red", "skipped": "yellow"}
    for result in results:
        table.add_row(
            result.url,
            f"[{style[result.state]}]{result.state}[/]",
            result.weight_version or "?",
            result.previous_version or "",
            f"{result.seconds:.2f}" if result.seconds is not None else "",
            result.error or "",
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
        "--namespace",
        "-n",
        help="Kubernetes namespace (with --k8s-selector; default: the pod's own in the cluster, else the "
        "kubeconfig context's).",
    ),
    port: int = typer.Option(8002, "--port", help="Worker HTTP port (with --k8s-selector)."),
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
) -> None:
    """Verify CHECKPOINT, then reload the workers one at a time: POST /admin/reload, wait until the
    replica reports the new weight_version, then the next; stop at the first failure. The admin token
    comes from BCSTACK_ADMIN_TOKEN."""
    if (workers is None) == (k8s_selector is None):
        fail("pass exactly one of --workers URL,... or --k8s-selector SELECTOR")
    token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        fail(f"{TOKEN_ENV} is not set; the workers' admin endpoints need the same bearer token")
    console = Console()

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
    on_workers = path_on_workers or str(checkpoint)

    def show(event: ReplicaProgress) -> None:
        colour = {"reloaded": "green", "failed": "red", "skipped": "yellow"}.get(event.stage, "cyan")
        console.print(
            f"[{event.index + 1}/{event.total}] {event.url} [{colour}]{event.stage}[/] {event.message}"
        )

    console.print(f"rolling reload of {len(urls)} replica(s) to {version!r} from {on_workers}")
    results = asyncio.run(rolling_reload(urls, on_workers, version, token, timeout=timeout, on_progress=show))
    console.print(_results_table(results, version))
    failed = next((result for result in results if result.state == "failed"), None)
    if failed is not None:
        console.print(f"[red]stopped at {failed.url}:[/] {failed.error}")
        raise typer.Exit(1)
    console.print(f"[green]all {len(results)} replica(s) serve {version!r}[/]")
