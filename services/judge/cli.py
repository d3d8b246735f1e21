"""`bcstack serve judge`: the judge proxy."""

from __future__ import annotations

from pathlib import Path

import typer

from core.kit.cli import fail, load_or_fail, settings_epilog
from services.judge.settings import JudgeSettings


def serve(
    backend: str = typer.Option(
        None, "--backend", help="rule (exact/numeric match, the default) or openai (an LLM grader)."
    ),
    grader_url: str = typer.Option(
        None, "--grader-url", help="OpenAI-compatible base URL of the grader, e.g. http://grader:8000/v1."
    ),
    grader_model: str = typer.Option(None, "--grader-model", help="Model id of the grader."),
    cache: Path = typer.Option(None, "--cache", help="SQLite verdict cache (default judge-cache.sqlite)."),
    host: str = typer.Option(None, "--host", help="Address to bind (default 127.0.0.1)."),
    port: int = typer.Option(None, "--port", help="HTTP port (default 8005)."),
    grpc_port: int = typer.Option(None, "--grpc-port", help="gRPC port (default 50055)."),
    config: Path = typer.Option(None, "--config", help="YAML settings file."),
) -> None:
    """Grade final answers (BrowseComp template) and worker contributions, with a cache."""
    from core.kit.runner import run_service
    from core.kit.upstream import UpstreamError
    from services.judge.cache import CacheError
    from services.judge.service import build

    settings = load_or_fail(
        JudgeSettings,
        config,
        backend=backend,
        grader_url=grader_url,
        grader_model=grader_model,
        cache_path=cache,
        host=host,
        port=port,
        grpc_port=grpc_port,
    )
    try:
        app, server, _judge = build(settings)
    except (CacheError, UpstreamError, ValueError, OSError) as e:
        fail(str(e))
    run_service(settings, http_app=app, grpc_server=server)


serve.__doc__ = (serve.__doc__ or "") + "\n\n" + settings_epilog(JudgeSettings)
