"""A CPU engine (`bcstack serve engine --model DIR`) started on a free port for the duration of a block.

Used where a command takes a model folder but talks to models through SGLang's HTTP API (pass@k
evaluation, distillation teachers): the same code path as a production engine URL. The admin token
is not passed on, so the engine's admin routes stay disabled.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


class LocalEngineError(RuntimeError):
    """The engine did not start (one line: why)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalEngine:
    """A CPU engine (`bcstack serve engine --model DIR`) on a free port, for the duration of a block."""

    def __init__(self, model_dir: str, startup_s: float = 180.0) -> None:
        self.model_dir = model_dir
        self.startup_s = startup_s
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.log: Any = None

    def __enter__(self) -> LocalEngine:
        import httpx

        env = {k: v for k, v in os.environ.items() if k != "BCSTACK_ADMIN_TOKEN"}
        # The log goes to a file, not a pipe: nobody reads a pipe while the engine serves, and a full
        # pipe buffer would block the engine on its next log line.
        self.log = tempfile.NamedTemporaryFile(prefix="bcstack-engine-", suffix=".log", delete=False)
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bcstack",
                "serve",
                "engine",
                "--model",
                self.model_dir,
                "--port",
                str(self.port),
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = Path(self.log.name).read_text(errors="replace").strip()
                raise LocalEngineError(
                    f"the engine for {self.model_dir} exited: {(err.splitlines() or ['?'])[-1]}"
                )
            try:
                if httpx.get(f"{self.url}/health_generate", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.__exit__()
        raise LocalEngineError(f"the engine for {self.model_dir} did not start within {self.startup_s:.0f} s")

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.log is not None:
            self.log.close()
            Path(self.log.name).unlink(missing_ok=True)
