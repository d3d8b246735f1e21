"""`python -m services.coordinator_llm ...` = `bcstack serve coordinator-llm ...`."""

import typer

from core.kit.cli import ServeCommand
from services.coordinator_llm.cli import serve

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
app.command(cls=ServeCommand)(serve)

if __name__ == "__main__":
    app()
