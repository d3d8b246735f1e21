"""Run one service process: its HTTP app and/or gRPC server in one event loop, stopped together.

    run_service(settings, http_app=app, grpc_server=server)   # what `bcstack serve X` calls

On SIGTERM/SIGINT both servers stop accepting work at once (gRPC health turns NOT_SERVING,
uvicorn closes its listener) and in-flight requests get `settings.shutdown_grace_seconds`.
A gRPC-only process with `metrics_port` set also serves /metrics on that port.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from core.kit.grpc_server import GrpcServer, handle_stop_signals
from core.kit.http import uvicorn_server
from core.kit.logging import setup_logging
from core.kit.metrics import start_metrics_server
from core.kit.settings import ServiceSettings

log = logging.getLogger(__name__)


async def serve(
    settings: ServiceSettings,
    *,
    http_app: Any = None,
    grpc_server: GrpcServer | None = None,
    stop_event: asyncio.Event | None = None,
) -> None:
    """Serve until a stop signal or `stop_event`, then shut down gracefully."""
    if http_app is None and grpc_server is None:
        raise ValueError("nothing to serve: pass http_app and/or grpc_server")
    stop_event = stop_event or asyncio.Event()
    metrics_server = None
    with handle_stop_signals(stop_event):
        if grpc_server is not None:
            await grpc_server.start()
        http = uvicorn_server(http_app, settings) if http_app is not None else None
        http_task = asyncio.create_task(http.serve(), name="uvicorn") if http is not None else None
        if http is None and grpc_server is not None and settings.metrics_port is not None:
            metrics_server, _ = start_metrics_server(
                grpc_server.registry, settings.host, settings.metrics_port
            )
            log.info("metrics on http://%s:%d/metrics", settings.host, metrics_server.server_port)
        stop_task = asyncio.create_task(stop_event.wait(), name="stop")
        try:
            # uvicorn exits on its own when it cannot bind; treat that as a stop too.
            await asyncio.wait({t for t in (stop_task, http_task) if t}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop_task.cancel()
            if http is not None:
                http.should_exit = True
            stopping = [grpc_server.stop()] if grpc_server is not None else []
            if http_task is not None:
                stopping.append(http_task)
            results = await asyncio.gather(*stopping, return_exceptions=True)
            if metrics_server is not None:
                metrics_server.shutdown()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    if http is not None and not http.started:
        raise OSError(f"HTTP server did not start on {settings.host}:{settings.port}")


def run_service(
    settings: ServiceSettings, *, http_app: Any = None, grpc_server: GrpcServer | None = None
) -> None:
    """Set up logging from `settings` and `serve` (blocking)."""
    setup_logging(settings.log_level, json=settings.log_json)
    asyncio.run(serve(settings, http_app=http_app, grpc_server=grpc_server))
