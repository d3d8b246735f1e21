"""Command-line entry points of retrieval: `bcstack index`, `bcstack serve retrieval`, `bcstack search`."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from core.kit.cli import fail, load_or_fail, serve_command
from services.retrieval.settings import RetrievalSettings


def index(
    corpus: Path = typer.Option(
        ..., "--corpus", help="Corpus file: JSONL or Parquet rows of docid, text, url."
    ),
    index_dir: Path = typer.Option(
        ..., "--index-dir", help="Where the index goes (created; an existing one resumes)."
    ),
    lexical: str = typer.Option(None, "--lexical", help="embedded (bm25s, default) or elasticsearch."),
    dense: str = typer.Option(
        None,
        "--dense",
        help="edge (Qdrant Edge in-process, default), qdrant, or none: a lexical-only index, built "
        "without loading or running the embedder (hybrid search then serves the lexical ranking).",
    ),
    embedder: str = typer.Option(
        None, "--embedder", help="sentence-transformers model (default all-MiniLM-L6-v2)."
    ),
    batch_size: int = typer.Option(None, "--batch-size", help="Documents per ingest batch (default 256)."),
    on_duplicate: str = typer.Option(
        "error", "--on-duplicate", help="A repeated docid: error (stop) or skip."
    ),
    config: Path = typer.Option(
        None, "--config", help="YAML settings file (see `bcstack serve retrieval --help`)."
    ),
) -> None:
    """Build the lexical index, the dense index and the doc store in one pass over the corpus.

    With --dense none only the lexical index and the doc store are built: no document is
    embedded, which makes a world built to collect training data many times faster to index.

    Interrupted, it resumes where it stopped when run again with the same arguments, and never
    stores a document twice. Elasticsearch and Qdrant connection settings come from the
    BCSTACK_RETRIEVAL_* environment variables or --config.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from services.retrieval.corpus import CorpusError
    from services.retrieval.index import RetrievalIndexError, ingest

    if on_duplicate not in ("error", "skip"):
        fail("--on-duplicate is error or skip")
    if dense == "none" and embedder:
        fail("--embedder has no use with --dense none (a lexical-only index embeds nothing)")
    settings = load_or_fail(
        RetrievalSettings,
        config,
        lexical=lexical,
        dense=dense,
        embedder_model=embedder,
        ingest_batch_size=batch_size,
        index_dir=index_dir,
    )
    console = Console(stderr=True, soft_wrap=True)  # paths and messages stay on one line
    columns = (
        TextColumn("[bold]indexing"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]:>8} docs/s"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("index", total=None, rate="-")

        def progress(done: int, total: int | None) -> None:
            elapsed = bar.tasks[0].elapsed or 1e-9
            bar.update(task, completed=done, total=total, rate=f"{done / elapsed:,.0f}")

        try:
            report = ingest(corpus, index_dir, settings, on_duplicate=on_duplicate, progress=progress)
        except (CorpusError, RetrievalIndexError) as e:
            fail(str(e))
        except KeyboardInterrupt:
            fail("interrupted; run the same command again to resume")
    if report.up_to_date:
        console.print(f"{index_dir}: already complete ({report.total:,} documents); nothing to do")
        return
    console.print(
        f"{index_dir}: {report.total:,} documents ({report.added:,} added, {report.resumed:,} resumed) "
        f"in {report.seconds:.1f}s"
    )
    for line in report.duplicates[:10]:
        console.print(f"[yellow]skipped[/yellow] {line}")
    if len(report.duplicates) > 10:
        console.print(f"[yellow]... and {len(report.duplicates) - 10} more duplicate docids skipped[/yellow]")


def _run(settings: RetrievalSettings) -> None:
    from core.kit.runner import run_service
    from services.retrieval.index import RetrievalIndexError
    from services.retrieval.service import build

    try:
        app, server, core = build(settings)
    except RetrievalIndexError as e:
        fail(str(e))
    try:
        run_service(settings, http_app=app, grpc_server=server)
    finally:
        core.close()


serve = serve_command(
    RetrievalSettings,
    _run,
    help="Serve search and open_page over HTTP (FoldAgent-compatible /search, /open; /v1/search) and gRPC."
    "\n\n--index-dir is the folder `bcstack index` wrote; the backends default to those it was built with.",
    omit=("metrics_port",),
)


def search(
    query: str = typer.Argument(..., help="The query."),
    k: int = typer.Option(5, "-k", "--k", help="Number of results."),
    mode: str = typer.Option("hybrid", "--mode", help="hybrid, lexical or dense."),
    url: str = typer.Option("http://127.0.0.1:8001", "--url", help="Retrieval service base URL."),
    as_json: bool = typer.Option(False, "--json/--no-json", help="Print the raw JSON response."),
    words: int = typer.Option(40, "--words", help="Words of each hit's text to show."),
) -> None:
    """Query a running retrieval service and print the hits."""
    import httpx

    try:
        resp = httpx.post(
            url.rstrip("/") + "/v1/search",
            json={"query": query, "k": k, "mode": mode, "snippet_words": words},
            timeout=30,
        )
    except httpx.HTTPError as e:
        fail(f"cannot reach {url}: {e}")
    if resp.status_code != 200:
        try:
            detail = resp.json().get("detail")
        except ValueError:
            detail = resp.text[:200]
        fail(f"{url} answered {resp.status_code}: {detail}")
    body = resp.json()
    if as_json:
        typer.echo(json.dumps(body, indent=2))
        return
    if body.get("degraded"):
        typer.echo(f"(degraded: {', '.join(body['failed_backends'])} unavailable)", err=True)
    for i, hit in enumerate(body["results"], 1):
        ranks = " ".join(f"{n}#{r['rank']}" for n, r in hit["ranks"].items())
        typer.echo(f"{i:>2}. [{hit['docid']}] {hit['title']}  (score {hit['score']:.4f}; {ranks})")
        typer.echo(f"    {hit['text']}")
