"""Shared test helpers, kept generic: free loopback ports and bounded waiting.

Fixtures: `free_port` (an unused loopback TCP port). Plain helpers, importable as
`from conftest import find_free_port, wait_for_port, wait_until`.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import TypeVar

import pytest

LOOPBACK = "127.0.0.1"
T = TypeVar("T")


def find_free_port(host: str = LOOPBACK) -> int:
    """A TCP port nothing listens on right now (the OS picks it; a race is possible but rare)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_for_port(port: int, host: str = LOOPBACK, timeout: float = 10.0) -> None:
    """Block until something accepts TCP connections on host:port; TimeoutError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {host}:{port} after {timeout:.0f} s") from None
            time.sleep(0.05)


def wait_until(
    predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.1, message: str = "condition"
) -> T:
    """Poll `predicate` until it returns something truthy and return that; TimeoutError otherwise.

    Exceptions raised by the predicate count as "not yet" (a server still starting up).
    """
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            result = predicate()
            if result:
                return result
        except Exception as exc:
            last_error = exc
        if time.monotonic() > deadline:
            detail = f" (last error: {last_error!r})" if last_error else ""
            raise TimeoutError(f"{message} not met within {timeout:.0f} s{detail}")
        time.sleep(interval)


@pytest.fixture
def free_port() -> int:
    """An unused loopback TCP port."""
    return find_free_port()


@pytest.fixture(scope="session")
def toy_kit(tmp_path_factory):
    """One toy world (500 documents, seed 5, 8 test questions per tier, no train split), the tiny
    model and its retrieval index, built once per test session for the end-to-end suites.

    Returns {"dir", "world"}: `dir` holds `world/`, `tiny/` and `idx/`; treat them as read-only.
    """
    import subprocess
    import sys

    from devkit.modelkit.build import build_tiny_kit
    from devkit.toyworld.generator import generate_world, write_world

    root = tmp_path_factory.mktemp("toy-kit")
    world = generate_world(500, 5, questions_per_tier=8, train_medium=0, train_hard=0)
    write_world(world, root / "world")
    build_tiny_kit(root / "tiny")
    index = subprocess.run(
        [sys.executable, "-m", "bcstack", "index", "--corpus", str(root / "world" / "corpus.jsonl"),
         "--index-dir", str(root / "idx")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert index.returncode == 0, index.stderr
    return {"dir": root, "world": world}


def link_toy_kit(kit: dict, into) -> None:
    """Make `into/world`, `into/tiny` and `into/idx` point at the shared toy kit."""
    for name in ("world", "tiny", "idx"):
        (into / name).symlink_to(kit["dir"] / name, target_is_directory=True)
