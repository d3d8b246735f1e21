"""`bcstack serve judge`: the judge proxy."""

from __future__ import annotations

from core.kit.cli import fail, serve_command
from services.judge.settings import JudgeSettings


def _run(settings: JudgeSettings) -> None:
    from core.kit.runner import run_service
    from core.kit.upstream import UpstreamError
    from services.judge.cache import CacheError
    from services.judge.service import build

    try:
        app, server, _judge = build(settings)
    except (CacheError, UpstreamError, ValueError, OSError) as e:
        fail(str(e))
    run_service(settings, http_app=app, grpc_server=server)


serve = serve_command(
    JudgeSettings,
    _run,
    help="Grade final answers (BrowseComp template) and worker contributions, with a cache.",
    omit=("metrics_port",),
)
