"""`bcstack serve worker`: the worker sidecar."""

from __future__ import annotations

from core.kit.cli import fail, serve_command
from services.worker.settings import WorkerSettings


def _run(settings: WorkerSettings) -> None:
    from core.kit.runner import run_service
    from services.worker.service import build

    try:
        app, server, _clients = build(settings)
    except (ValueError, OSError) as e:
        fail(str(e))
    run_service(settings, http_app=app, grpc_server=server)


serve = serve_command(
    WorkerSettings,
    _run,
    help="Run worker episodes (gRPC RunEpisode) against an SGLang-API engine and the retrieval service.",
    omit=("metrics_port",),
)
