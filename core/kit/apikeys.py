"""The API key of an upstream endpoint: from the env var or the file (a mounted Secret) its spec names.

A key read here is registered with the log redaction filter at once; errors name the variable
or the path, never a value.
"""

from __future__ import annotations

import os

from core.kit.logging import register_secret
from core.kit.upstream import EndpointSpec, UpstreamError


def read_api_key(spec: EndpointSpec, role: str = "coordinator") -> tuple[str | None, str | None]:
    """(key, source) of `spec`: source is "env:NAME", "file:PATH" or None (no key configured).

    With both named, the env var wins when it holds a key and the file is the fallback.
    Raises UpstreamError(kind="no_api_key") naming the variable or path (never a value).
    """
    problems: list[str] = []
    if spec.api_key_env:
        value = os.environ.get(spec.api_key_env, "").strip()
        if value:
            register_secret(value)
            return value, f"env:{spec.api_key_env}"
        state = "is not set" if spec.api_key_env not in os.environ else "is blank"
        problems.append(f"env var {spec.api_key_env} {state}")
    if spec.api_key_file is not None:
        path = spec.api_key_file
        try:
            value = path.read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            problems.append(f"key file {path} does not exist")
        except (OSError, UnicodeDecodeError) as exc:
            problems.append(
                f"key file {path} is unreadable ({getattr(exc, 'strerror', None) or type(exc).__name__})"
            )
        else:
            if value:
                register_secret(value)
                return value, f"file:{path}"
            problems.append(f"key file {path} is blank")
    if problems:
        raise UpstreamError(
            "no_api_key", spec.name, "no API key", "; ".join(problems), retryable=False, role=role
        )
    return None, None


def resolve_api_key(spec: EndpointSpec, role: str = "coordinator") -> str | None:
    """The API key of `spec` (see `read_api_key`), or None when it names no key source."""
    return read_api_key(spec, role)[0]
