"""`python -m services.judge ...` = `bcstack serve judge ...`."""

import typer

from core.kit.cli import ServeCommand
from services.judge.cli import serve

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
app.command(cls=ServeCommand)(serve)

if __name__ == "__main__":
    app()
