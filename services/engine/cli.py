"""`bcstack serve engine`: the CPU engine (SGLang's HTTP API over `transformers`, or a scripted policy).

Mounted by the root CLI as `serve_app.command("engine", cls=ServeCommand)(engine_cli.serve)`; also
runnable alone as `python -m services.engine ...`.
"""

from __future__ import annotations

from core.kit.cli import fail, serve_command
from services.engine.settings import EngineSettings


def _run(settings: EngineSettings) -> None:
    from core.kit.runner import run_service
    from services.engine.core import check_world
    from services.engine.service import build
    from services.engine.settings import source_problem

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


serve = serve_command(
    EngineSettings,
    _run,
    help="Serve SGLang's native API (/generate, weights, pause) from a CPU model or a scripted policy.\n\n"
    "Give --model DIR (an HF-format folder), or --policy expert --tokenizer DIR (and optionally "
    "--world DIR, which is checked).",
    omit=("grpc_port", "metrics_port"),  # HTTP only, as SGLang
)
