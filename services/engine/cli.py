"""`bcstack serve engine`: the CPU engine (SGLang's HTTP API over `transformers`, or a scripted policy).

Mounted by the root CLI as `serve_app.command("engine")(engine_cli.serve)`; also runnable alone as
`python -m services.engine ...`.
"""

from __future__ import annotations

from pathlib import Path

import typer

from core.kit.cli import fail, load_or_fail, settings_epilog
from services.engine.settings import EngineSettings


def serve(
    model: Path = typer.Option(None, "--model", help="HF-format model folder (`bcstack model tiny`)."),
    policy: str = typer.Option(
        None, "--policy", help="Serve a scripted policy instead of a model: expert (the toy world's expert)."
    ),
    tokenizer: Path = typer.Option(
        None, "--tokenizer", help="Tokenizer folder (default: the model folder; required with --policy)."
    ),
    world: Path = typer.Option(None, "--world", help="Toy world folder; checked, not needed, with --policy."),
    host: str = typer.Option(None, "--host", help="Address to bind (default 127.0.0.1)."),
    port: int = typer.Option(None, "--port", help="HTTP port (default 30000, SGLang's)."),
    context_length: int = typer.Option(
        None, "--context-length", help="Context window (default: the model's max_position_embeddings)."
    ),
    max_running_requests: int = typer.Option(
        None, "--max-running-requests", help="Sequences decoded together (default 16)."
    ),
    weight_version: str = typer.Option(None, "--weight-version", help="Initial weight version (default)."),
    config: Path = typer.Option(None, "--config", help="YAML settings file."),
) -> None:
    """Serve SGLang's native API (/generate, weights, pause) from a CPU model or a scripted policy."""
    from core.kit.runner import run_service
    from services.engine.core import check_world
    from services.engine.service import build
    from services.engine.settings import source_problem

    settings = load_or_fail(
        EngineSettings,
        config,
        model=model,
        policy=policy,
        tokenizer=tokenizer,
        world=world,
        host=host,
        port=port,
        context_length=context_length,
        max_running_requests=max_running_requests,
        weight_version=weight_version,
    )
    problem = source_problem(settings)
    if problem:
        fail(problem)
    if settings.model is not None and not (settings.model / "config.json").is_file():
        fail(f"--model {settings.model} is not a model folder (no config.json)")
    if settings.tokenizer is not None and not settings.tokenizer.is_dir():
        fail(f"--tokenizer {settings.tokenizer} is not a folder")
    if settings.world is not None:
        problem = check_world(settings.world)
        if problem:
            fail(problem)
    app, _core = build(settings)
    run_service(settings, http_app=app)


serve.__doc__ = (serve.__doc__ or "") + "\n\n" + settings_epilog(EngineSettings)
