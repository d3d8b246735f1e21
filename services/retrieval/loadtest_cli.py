"""`bcstack loadtest retrieval ...`: load the retrieval service and report latency and QPS.

Mounted by the root CLI as ``app.add_typer(loadtest_app, name="loadtest")``. The work happens in
:mod:`services.retrieval.loadtest`; this file only parses options, prints and writes files.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import typer

app = typer.Typer(help="Load tests with a latency/QPS report (Locust, headless).", no_args_is_help=True)


@app.callback()
def _group() -> None:
    """Load tests with a latency/QPS report (Locust, headless)."""


@app.command()
def retrieval(
    url: str = typer.Option(
        ...,
        "--url",
        help="HTTP: base URL of the service, e.g. http://127.0.0.1:8000 (POST /search is used unless "
        "the URL has a path). With --grpc: host:port of the gRPC server.",
    ),
    concurrency: int | None = typer.Option(
        None,
        "--concurrency",
        help="Closed loop: this many users, each sending its next request as soon as the last is "
        "answered. Give exactly one of --concurrency / --qps.",
    ),
    qps: float | None = typer.Option(
        None,
        "--qps",
        help="Open loop: send requests at this constant rate (requests per second), independent of "
        "response times. Give exactly one of --concurrency / --qps.",
    ),
    duration: float = typer.Option(
        ...,
        "--duration",
        help="Length of the measured window in seconds (> 0, at most 3600). New requests stop then; "
        "those in flight get --timeout more seconds, then the run stops hard.",
    ),
    grpc: bool = typer.Option(
        False, "--grpc/--no-grpc", help="Call bcstack.v1.RetrievalService/Search over gRPC instead of HTTP."
    ),
    queries: Path | None = typer.Option(
        None,
        "--queries",
        help="Queries to send, cycled: a text file (one query per line) or JSONL with a 'query' field "
        "(e.g. a toy world's questions.jsonl). Default: a built-in list of 20 varied queries.",
    ),
    k: int = typer.Option(10, "--k", help="Hits requested per search (k in the request, >= 1)."),
    mode: str = typer.Option(
        "hybrid", "--mode", help="gRPC only: retrievers to use, hybrid | lexical | dense."
    ),
    out: Path | None = typer.Option(
        None,
        "--out",
        help="Directory for report.json and latency.png. Default: .bcstack/loadtest/<YYYYmmdd-HHMMSS> "
        "(under the local stack's state folder, never the current directory itself).",
    ),
    warmup: float = typer.Option(
        0.0,
        "--warmup",
        help="Seconds of load before the measured window; their requests are sent but reported "
        "apart (warmup_requests) and excluded from every statistic.",
    ),
    timeout: float = typer.Option(
        10.0, "--timeout", help="Per-request timeout in seconds; a slower answer counts as a timeout error."
    ),
    users: int | None = typer.Option(
        None,
        "--users",
        help="Open loop only: size of the user pool that serves the schedule. Default ceil(QPS) "
        "within [8, 1000], enough for 1 s of latency at the target rate.",
    ),
    max_requests: int | None = typer.Option(
        None, "--max-requests", help="Stop early after this many requests (warmup included)."
    ),
    quiet: bool = typer.Option(
        False, "--quiet/--no-quiet", "-q", help="No per-second progress lines on stderr."
    ),
) -> None:
    """Load-test a running retrieval service and report achieved QPS, errors and latency.

    Prints a table to stdout, a progress line per second to stderr, and writes report.json (config,
    machine, raw per-request latencies in ms, errors by message) and latency.png (latency over time
    and histogram) into --out. Exits 0 when every request succeeded, 1 when any failed or none
    completed (e.g. nothing listens at --url), 2 on a usage error.
    """
    from rich.console import Console
    from rich.markup import escape

    from services.retrieval.loadtest import (
        DEFAULT_QUERIES,
        LoadTestConfig,
        LoadTestConfigError,
        LoadTestError,
        load_queries,
        run_loadtest,
        write_latency_png,
    )

    err = Console(stderr=True, soft_wrap=True)  # soft wrap: an error stays on one line in logs
    if (concurrency is None) == (qps is None):
        raise typer.BadParameter(
            "give exactly one of them (closed loop or open loop)", param_hint="'--concurrency' / '--qps'"
        )
    if duration <= 0:
        raise typer.BadParameter(f"must be > 0 seconds, got {duration:g}", param_hint="--duration")
    try:
        query_list = load_queries(queries) if queries is not None else DEFAULT_QUERIES
        config = LoadTestConfig(
            url=url,
            duration_s=duration,
            concurrency=concurrency,
            qps=qps,
            grpc=grpc,
            queries=query_list,
            k=k,
            mode=mode,
            warmup_s=warmup,
            timeout_s=timeout,
            users=users,
            max_requests=max_requests,
            progress=not quiet,
        )
    except LoadTestConfigError as exc:
        raise typer.BadParameter(str(exc)) from None

    problem = _unreachable(url, grpc=grpc, timeout=min(timeout, 5.0))
    if problem is not None:
        # Before any load and before any folder: a dead target is one line, not thousands of
        # refused requests and a report of them.
        err.print(f"[red]error:[/red] {escape(problem)}")
        raise typer.Exit(1)

    out_dir = out or Path(".bcstack") / "loadtest" / datetime.now().strftime("%Y%m%d-%H%M%S")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise typer.BadParameter(f"cannot create {out_dir}: {exc}", param_hint="--out") from None

    load = f"{concurrency} concurrent users" if concurrency is not None else f"{qps:g} QPS target"
    err.print(
        f"load test: {'gRPC' if grpc else 'HTTP'} {escape(url)}, {load}, {duration:g} s"
        + (f" after {warmup:g} s warmup" if warmup else "")
    )
    try:
        report = run_loadtest(config)
    except LoadTestError as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(1) from None

    report.write_json(out_dir / "report.json")
    write_latency_png(report, out_dir / "latency.png")
    Console().print(_summary_table(report))
    err.print(escape(f"wrote {out_dir / 'report.json'} and {out_dir / 'latency.png'}"))
    for warning in report.warnings():
        err.print(f"[yellow]warning:[/yellow] {escape(warning)}")
    problem = report.problem()
    if problem:
        err.print(f"[red]error:[/red] {escape(problem)}")
        raise typer.Exit(1)


_START_IT = "start the retrieval service (bcstack serve retrieval) or fix --url"


def _refused(target: str, timeout: float) -> str | None:
    """The error of a TCP connect to a gRPC target "host:port" ("[v6]:port"), None when it connects
    or the target is not of that form (a name with a scheme, "dns:///...", "ipv4:...", "unix:...":
    the channel decides)."""
    import socket

    host, sep, port = target.rpartition(":")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not port.isdigit() or not bare or "/" in host or (":" in host and bare == host):
        return None
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _unreachable(url: str, *, grpc: bool, timeout: float) -> str | None:
    """Why nothing answers at the target (None: something does). HTTP: any answer to GET /health
    of its host, whatever the status; gRPC: the channel becomes ready."""
    if grpc:
        import grpc as grpc_lib

        refused = _refused(url, timeout)
        if refused is not None:
            # A gRPC channel to a closed port retries until the deadline: a refused TCP connect
            # says the same at once.
            return f"nothing answers gRPC at {url} ({refused}): {_START_IT}"
        channel = grpc_lib.insecure_channel(url)
        try:
            grpc_lib.channel_ready_future(channel).result(timeout=timeout)
        except grpc_lib.FutureTimeoutError:
            return f"nothing answers gRPC at {url} within {timeout:g} s: {_START_IT}"
        finally:
            channel.close()
        return None
    from urllib.parse import urlsplit

    import httpx

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return f"--url must be an http(s) URL such as http://127.0.0.1:8001, not {url!r}"
    try:
        httpx.get(f"{parts.scheme}://{parts.netloc}/health", timeout=timeout)
    except httpx.HTTPError as exc:
        return f"nothing answers at {url} ({type(exc).__name__}: {exc}): {_START_IT}"
    return None


def _summary_table(report):  # -> rich.table.Table; typed loosely to keep rich out of import time
    from rich.markup import escape
    from rich.table import Table

    cfg = report.config
    mode = f"closed loop, {cfg.concurrency} users" if cfg.concurrency is not None else "open loop"
    title = f"{'gRPC' if cfg.grpc else 'HTTP'} {cfg.url} ({mode}, {report.window_s:.1f} s)"
    table = Table(title=escape(title))
    table.add_column("metric")
    table.add_column("value", justify="right")

    def ms(key: str) -> str:
        value = report.latency_ms.get(key)
        return "-" if value is None else f"{value:.2f}"

    table.add_row("achieved QPS", f"{report.achieved_qps:.1f}")
    if report.target_qps is not None:
        table.add_row("target QPS", f"{report.target_qps:g}")
        table.add_row("sent QPS", f"{report.sent_qps:.1f}")
        lagging = report.late_starts or report.unsent_slots
        style = "yellow" if lagging else None
        table.add_row(
            "late starts / unsent slots", f"{report.late_starts} / {report.unsent_slots}", style=style
        )
    table.add_row("requests", str(report.requests))
    table.add_row("errors", str(report.errors), style="red" if report.errors else None)
    for kind, count in report.errors_by_kind.items():
        table.add_row(escape(f"  {kind}"), str(count), style="red")
    for key in ("p50", "p90", "p99", "max"):
        table.add_row(f"latency {key} (ms)", ms(key))
    if report.warmup_requests:
        table.add_row("warmup requests (excluded)", str(report.warmup_requests))
    if report.aborted_requests:
        table.add_row("aborted at hard stop", str(report.aborted_requests), style="red")
    table.add_row("load generator CPU (% of a core)", f"{report.client_cpu_percent:.0f}")
    return table
