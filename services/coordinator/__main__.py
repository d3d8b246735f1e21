"""`python -m services.coordinator ...` = `bcstack serve coordinator ...`."""

import typer

from services.coordinator.cli import serve

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
app.command()(serve)

if __name__ == "__main__":
    app()
