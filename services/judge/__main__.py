"""`python -m services.judge ...` = `bcstack serve judge ...`."""

import typer

from services.judge.cli import serve

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
app.command()(serve)

if __name__ == "__main__":
    app()
