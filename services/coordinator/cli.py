"""`bcstack serve coordinator`: the coordinator gateway."""

from __future__ import annotations

from pathlib import Path

import typer

from core.kit.cli import fail, load_or_fail, settings_epilog
from services.coordinator.settings import CoordinatorSettings


def serve(
    coordinator_url: str = typer.Option(
        None,
        "--coordinator-url",
        help="OpenAI-compatible base URL of the coordinator LLM (an endpoint named 'default'), "
        "e.g. http://127.0.0.1:8004/v1.",
    ),
    coordinator_model: str = typer.Option(
        None, "--coordinator-model", help="Model id of that endpoint (default scripted-coordinator)."
    ),
    workers: str = typer.Option(
        None, "--workers", help="Worker gRPC addresses, comma-separated (default 127.0.0.1:50052)."
    ),
    records: Path = typer.Option(
        None, "--records", help="SQLite file of episode records (default coordinator-records.sqlite)."
    ),
    host: str = typer.Option(None, "--host", help="Address to bind (default 127.0.0.1)."),
    port: int = typer.Option(None, "--port", help="HTTP port (default 8003)."),
    grpc_port: int = typer.Option(None, "--grpc-port", help="gRPC port (default 50053)."),
    config: Path = typer.Option(None, "--config", help="YAML settings file (e.g. the endpoint registry)."),
) -> None:
    """Run coordinator episodes: the coordinator LLM branches research to workers and finishes."""
    from core.kit.runner import run_service
    from core.kit.upstream import UpstreamError
    from core.record_store import RecordStoreError
    from services.coordinator.registry import RegistryError
    from services.coordinator.service import build

    settings = load_or_fail(
        CoordinatorSettings,
        config,
        coordinator_url=coordinator_url,
        coordinator_model=coordinator_model,
        workers=workers,
        records_path=records,
        host=host,
        port=port,
        grpc_port=grpc_port,
    )
    try:
        app, server, _core = build(settings)
    except (RegistryError, RecordStoreError, UpstreamError, ValueError, OSError) as e:
        fail(str(e))
    run_service(settings, http_app=app, grpc_server=server)


serve.__doc__ = (serve.__doc__ or "") + "\n\n" + settings_epilog(CoordinatorSettings)
