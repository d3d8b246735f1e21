"""The one `bcstack` entry point (DESIGN.md §8).

Each command group lives beside the code it drives and is only imported here; heavy imports
(torch, transformers, grpc) stay inside the commands so that `bcstack --help` is instant.
"""

from __future__ import annotations

import typer

from bcstack import __version__
from bcstack.modelkit.cli import app as model_app
from bcstack.toyworld.cli import app as toyworld_app
from services.coordinator import cli as coordinator_cli
from services.coordinator_llm import cli as coordinator_llm_cli
from services.engine import cli as engine_cli
from services.judge import cli as judge_cli
from services.retrieval import cli as retrieval_cli
from services.retrieval.loadtest_cli import app as loadtest_app
from services.worker import cli as worker_cli

app = typer.Typer(
    name="bcstack",
    help=(
        "browsecomp-stack: deploy, evaluate and train BrowseComp research workers "
        "(Qwen3-4B under a frozen coordinator LLM). On a machine with no GPU every command "
        "runs on embedded defaults: a toy world, a tiny Qwen3 model on the CPU, in-process indexes."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
serve_app = typer.Typer(
    help="Start one service of the stack (each has --help with its settings).", no_args_is_help=True
)
serve_app.command("retrieval")(retrieval_cli.serve)
serve_app.command("worker")(worker_cli.serve)
serve_app.command("engine")(engine_cli.serve)
serve_app.command("coordinator")(coordinator_cli.serve)
serve_app.command("coordinator-llm")(coordinator_llm_cli.serve)
serve_app.command("judge")(judge_cli.serve)

app.add_typer(toyworld_app, name="toyworld")
app.add_typer(model_app, name="model")
app.command("index")(retrieval_cli.index)
app.add_typer(serve_app, name="serve")
app.command("search")(retrieval_cli.search)
app.add_typer(loadtest_app, name="loadtest")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"bcstack {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version."
    ),
) -> None:
    pass


def main() -> None:
    app()


if __name__ == "__main__":
    main()
