"""`bcstack toyworld ...` (placeholder until the generator lands)."""

import typer

app = typer.Typer(help="The toy world: a fictional corpus and questions in the BrowseComp-Plus formats.", no_args_is_help=True)
