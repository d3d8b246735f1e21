"""One URL in front of several gateway replicas, as a Kubernetes Service gives them: Debian's HAProxy,
configured here and run as a child process (`bcstack up --gateways N`, tests/test_gateway_replicas.py).

    with HaproxyFront(folder, port=8003, backends=["127.0.0.1:9101", "127.0.0.1:9102"]) as front:
        front.url   # http://127.0.0.1:8003

Round robin over the replicas that pass their health check (GET /health every second, out after
two failures, back after one success), so a killed replica stops getting requests within about two
seconds and a request whose connection it refused is sent to another (`retries`, `redispatch`).
A request in flight on a replica that dies gets 502: the apps' client (`bcstack.gateway_client`)
sends it again with the same episode id, which the shared record store makes one episode. Episodes
run long, so the server timeout is the gateway's longest episode, not HAProxy's default.

A real load balancer rather than a hand-written proxy: HAProxy is what such fronts are built with,
and its health checks, retries and connection handling are the behaviour a Service gives.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx


class FrontError(RuntimeError):
    """HAProxy is missing, its configuration is refused, or it does not answer (one line)."""


def haproxy_config(port: int, backends: list[str], *, host: str = "127.0.0.1", timeout_s: int = 7200) -> str:
    servers = "\n".join(
        f"    server gateway-{i + 1} {address} check inter 1s fall 2 rise 1"
        for i, address in enumerate(backends)
    )
    return f"""# written by bcstack (bcstack/front.py): the gateways' front
global
    maxconn 4096

defaults
    mode http
    timeout connect 2s
    timeout client {timeout_s}s
    timeout server {timeout_s}s
    retries 3
    option redispatch
    option http-keep-alive

frontend gateways
    bind {host}:{port}
    default_backend gateways

backend gateways
    balance roundrobin
    option httpchk GET /health
    http-check expect status 200
{servers}
"""


class HaproxyFront:
    def __init__(self, folder: Path, *, port: int, backends: list[str], host: str = "127.0.0.1") -> None:
        self.folder = Path(folder)
        self.port = port
        self.host = host
        self.backends = backends
        self.url = f"http://{host}:{port}"
        self.proc: subprocess.Popen | None = None

    @staticmethod
    def binary() -> str:
        found = shutil.which("haproxy") or (
            "/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None
        )
        if found is None:
            raise FrontError("HAProxy is not installed: `make install-test` adds Debian's haproxy package")
        return found

    def start(self, *, timeout: float = 30) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        config = self.folder / "haproxy.cfg"
        config.write_text(haproxy_config(self.port, self.backends, host=self.host))
        binary = self.binary()
        check = subprocess.run([binary, "-c", "-q", "-f", str(config)], capture_output=True, text=True)
        if check.returncode != 0:
            last = (check.stderr or check.stdout).strip().splitlines()
            raise FrontError(f"HAProxy refused {config}: {last[-1] if last else check.returncode}")
        log = (self.folder / "haproxy.log").open("ab")
        # Its own session, as `bcstack up` starts every service: it outlives `up`, and `down` stops its group.
        self.proc = subprocess.Popen(
            [binary, "-db", "-f", str(config)], stdout=log, stderr=log, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise FrontError(
                    f"HAProxy exited with {self.proc.returncode}; see {self.folder / 'haproxy.log'}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise FrontError(f"the front {self.url} did not answer within {timeout:g} s")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> HaproxyFront:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
