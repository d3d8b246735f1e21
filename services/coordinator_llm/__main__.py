"""`python -m services.coordinator_llm ...` = `bcstack serve coordinator-llm ...`."""

import typer

from services.coordinator_llm.cli import serve

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
app.command()(serve)

if __name__ == "__main__":
    app()
