"""`bcstack serve worker`: the worker sidecar."""

from __future__ import annotations

from pathlib import Path

import typer

from core.kit.cli import fail, load_or_fail, settings_epilog
from services.worker.settings import WorkerSettings


def serve(
    tokenizer: Path = typer.Option(
        None, "--tokenizer", help="Checkpoint (or tokenizer) dir of the served model."
    ),
    engine_url: str = typer.Option(
        None, "--engine-url", help="Engine base URL (default http://127.0.0.1:30000)."
    ),
    retrieval: str = typer.Option(
        None, "--retrieval", help="Retrieval gRPC address (default 127.0.0.1:50051)."
    ),
    host: str = typer.Option(None, "--host", help="Address to bind (default 127.0.0.1)."),
    port: int = typer.Option(None, "--port", help="HTTP port (default 8002)."),
    grpc_port: int = typer.Option(None, "--grpc-port", help="gRPC port (default 50052)."),
    config: Path = typer.Option(None, "--config", help="YAML settings file."),
) -> None:
    """Run worker episodes (gRPC RunEpisode) against an SGLang-API engine and the retrieval service."""
    from core.kit.runner import run_service
    from services.worker.service import build

    settings = load_or_fail(
        WorkerSettings,
        config,
        tokenizer=tokenizer,
        engine_url=engine_url,
        retrieval_address=retrieval,
        host=host,
        port=port,
        grpc_port=grpc_port,
    )
    try:
        app, server, _clients = build(settings)
    except (ValueError, OSError) as e:
        fail(str(e))
    run_service(settings, http_app=app, grpc_server=server)


serve.__doc__ = (serve.__doc__ or "") + "\n\n" + settings_epilog(WorkerSettings)
