"""Helpers every `bcstack` command shares: one-line errors, settings loading, settings help."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import typer

from core.kit.settings import ServiceSettings, SettingsError, load_settings, settings_help

S = TypeVar("S", bound=ServiceSettings)


def fail(message: str, code: int = 2) -> NoReturn:
    """Print ``error: message`` to stderr and exit: what a user sees instead of a traceback."""
    sys.stderr.write(f"error: {message}\n")
    raise typer.Exit(code)


def load_or_fail(cls: type[S], config: Path | None, **overrides: Any) -> S:
    try:
        return load_settings(cls, config_file=config, **overrides)
    except SettingsError as e:
        fail(str(e))


def settings_epilog(cls: type[ServiceSettings]) -> str:
    """The settings table for a command's --help; kept verbatim (\\b stops click re-wrapping it)."""
    return "\b\n" + settings_help(cls)
