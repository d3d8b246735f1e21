"""`bcstack serve coordinator`: the coordinator gateway."""

from __future__ import annotations

from core.kit.cli import fail, serve_command
from services.coordinator.settings import CoordinatorSettings


def _run(settings: CoordinatorSettings) -> None:
    from core.kit.runner import run_service
    from core.kit.upstream import UpstreamError
    from core.record_store import RecordStoreError
    from services.coordinator.registry import RegistryError
    from services.coordinator.service import build

    try:
        app, server, _core = build(settings)
    except (RegistryError, RecordStoreError, UpstreamError, ValueError, OSError) as e:
        fail(str(e))
    run_service(settings, http_app=app, grpc_server=server)


serve = serve_command(
    CoordinatorSettings,
    _run,
    help="Run coordinator episodes: the coordinator LLM branches research to workers and finishes.\n\n"
    "The endpoint registry is `endpoints` (a YAML list in --config, or JSON) and/or the one-endpoint "
    "shorthand --coordinator-url / --coordinator-model, an endpoint named 'default'.",
    names={"records_path": "--records"},  # as every command that reads records calls it
    omit=("metrics_port",),
)
