"""`bcstack serve coordinator-llm`: the stand-in coordinator LLM behind an OpenAI-compatible API.

Mounted by the root CLI as `serve_app.command("coordinator-llm", cls=ServeCommand)(...)`; also
runnable alone as `python -m services.coordinator_llm ...`.
"""

from __future__ import annotations

from core.kit.cli import serve_command
from services.coordinator_llm.settings import CoordinatorLlmSettings


def _run(settings: CoordinatorLlmSettings) -> None:
    from core.kit.runner import run_service
    from services.coordinator_llm.service import build_app

    run_service(settings, http_app=build_app(settings))


serve = serve_command(
    CoordinatorLlmSettings,
    _run,
    help="Serve an OpenAI-compatible /v1/chat/completions answered by a scripted coordinator policy.",
    omit=("grpc_port", "metrics_port"),  # HTTP only
)
