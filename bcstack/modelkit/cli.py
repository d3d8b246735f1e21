"""`bcstack model ...` (placeholder until the tiny model kit lands)."""

import typer

app = typer.Typer(help="Model kits: build the tiny Qwen3-architecture model for the embedded default.", no_args_is_help=True)
