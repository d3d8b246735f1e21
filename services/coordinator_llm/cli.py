"""`bcstack serve coordinator-llm`: the stand-in coordinator LLM behind an OpenAI-compatible API.

Mounted by the root CLI as `serve_app.command("coordinator-llm")(coordinator_llm_cli.serve)`; also
runnable alone as `python -m services.coordinator_llm ...`.
"""

from __future__ import annotations

from pathlib import Path

import typer

from core.kit.cli import load_or_fail, settings_epilog
from services.coordinator_llm.settings import CoordinatorLlmSettings


def serve(
    policy: str = typer.Option(
        None, "--policy", help="What answers: scripted (the toy world's scripted coordinator)."
    ),
    host: str = typer.Option(None, "--host", help="Address to bind (default 127.0.0.1)."),
    port: int = typer.Option(None, "--port", help="HTTP port (default 8004)."),
    fanout: int = typer.Option(None, "--fanout", help="Workers branched per question (default 1)."),
    max_rounds: int = typer.Option(
        None, "--max-rounds", help="Rounds of branching before giving up (default 2)."
    ),
    model_name: str = typer.Option(
        None, "--model-name", help="Model id served (default scripted-coordinator)."
    ),
    config: Path = typer.Option(None, "--config", help="YAML settings file."),
) -> None:
    """Serve an OpenAI-compatible /v1/chat/completions answered by a scripted coordinator policy."""
    from core.kit.runner import run_service
    from services.coordinator_llm.service import build_app

    settings = load_or_fail(
        CoordinatorLlmSettings,
        config,
        policy=policy,
        host=host,
        port=port,
        fanout=fanout,
        max_rounds=max_rounds,
        model_name=model_name,
    )
    run_service(settings, http_app=build_app(settings))


serve.__doc__ = (serve.__doc__ or "") + "\n\n" + settings_epilog(CoordinatorLlmSettings)
