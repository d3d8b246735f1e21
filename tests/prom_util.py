"""A real Prometheus server (Debian package `prometheus`) for tests, scraping loopback targets."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import find_free_port, wait_until


@contextlib.contextmanager
def prometheus(tmp_path: Path, targets: dict[str, str]) -> Iterator[str]:
    """Scrape ``{job: "host:port"}`` every second; yields the query API URL."""
    binary = shutil.which("prometheus") or (
        "/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else ""
    )
    if not binary:
        pytest.fail("no Prometheus server (Debian package `prometheus`): run `make install`")
    port = find_free_port()
    jobs = "".join(
        f"""
              - job_name: {job}
                static_configs:
                  - targets: ["{target}"]"""
        for job, target in targets.items()
    )
    config = tmp_path / "prometheus.yml"
    config.write_text(
        textwrap.dedent(
            """
            global:
              scrape_interval: 1s
              scrape_timeout: 1s
            scrape_configs:"""
        )
        + jobs
        + "\n"
    )
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    api = f"http://127.0.0.1:{port}/api/v1/query"
    try:
        wait_until(lambda: httpx.get(api, params={"query": "up"}, timeout=2).status_code == 200, timeout=30)
        yield api
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def query(api: str, promql: str) -> list[dict]:
    body = httpx.get(api, params={"query": promql}, timeout=5).json()
    assert body["status"] == "success", body
    return body["data"]["result"]
