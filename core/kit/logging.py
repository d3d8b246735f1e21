"""Process logging for every service: one root handler, optional JSON lines, secret redaction.

Secrets (the admin token, API keys) are registered once with `register_secret`; the
`RedactingFilter` on the root handler replaces them in every record that reaches it, whatever
logger or library produced it (uvicorn access lines included, since `serve_http` leaves
uvicorn's loggers propagating to the root).
"""

from __future__ import annotations

import json as _json
import logging
import sys
import threading
from datetime import UTC, datetime
from typing import IO, Any

from pydantic import SecretStr

REDACTED = "[REDACTED]"

_secrets: set[str] = set()
_secrets_lock = threading.Lock()
# Marks the handler setup_logging installed, so a second call replaces it instead of doubling output.
_HANDLER_MARK = "_bcstack_handler"


def register_secret(value: str | SecretStr | None) -> None:
    """Redact `value` from all log output from now on. Empty values are ignored."""
    if isinstance(value, SecretStr):
        value = value.get_secret_value()
    if value:
        with _secrets_lock:
            _secrets.add(value)


def redact(text: str) -> str:
    """`text` with every registered secret replaced by [REDACTED]."""
    if not _secrets or not text:
        return text
    # Longest first, so a secret that contains another is removed whole.
    for secret in sorted(_secrets, key=len, reverse=True):
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text


class RedactingFilter(logging.Filter):
    """Rewrites a record's message, traceback and stack text with secrets redacted."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not _secrets:
            return True
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: let the formatter report it
            return True
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (UTC ISO 8601), level, logger, message[, exc_info]."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            entry["exc_info"] = record.exc_text
        if record.stack_info:
            entry["stack_info"] = record.stack_info
        return _json.dumps(entry, ensure_ascii=False)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(
    level: str | int = "INFO", json: bool = False, stream: IO[str] | None = None
) -> logging.Handler:
    """Install the root handler (stderr by default) with redaction; return it. Idempotent."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, _HANDLER_MARK, False):
            root.removeHandler(handler)
            handler.close()
    handler = logging.StreamHandler(stream or sys.stderr)
    setattr(handler, _HANDLER_MARK, True)
    handler.setFormatter(JsonFormatter() if json else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(RedactingFilter())
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    return handler
