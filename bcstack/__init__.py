"""browsecomp-stack apps: the `bcstack` CLI, `bcstack up`, the demo and evaluation (the top layer)."""

from core import __version__

__all__ = ["__version__"]
