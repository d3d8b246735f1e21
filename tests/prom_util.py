"""A real Prometheus server (Debian package `prometheus`) for tests, scraping loopback targets."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterable, Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import find_free_port, wait_until


@contextlib.contextmanager
def prometheus(
    tmp_path: Path, targets: dict[str, str | list[str]], rule_files: Iterable[Path] = ()
) -> Iterator[str]:
    """Scrape ``{job: "host:port" or ["host:port", ...]}`` every second and evaluate `rule_files`
    every second; yields the query API URL (``.../api/v1/query``)."""
    binary = shutil.which("prometheus") or (
        "/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else ""
    )
    if not binary:
        pytest.fail("no Prometheus server (Debian package `prometheus`): run `make install-test`")
    port = find_free_port()
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": [where] if isinstance(where, str) else where}]}
            for job, where in targets.items()
        ],
    }
    config_file = tmp_path / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config_file}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    api = f"http://127.0.0.1:{port}/api/v1/query"
    try:

        def ready() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"Prometheus exited: {(tmp_path / 'prometheus.log').read_text()[-2000:]}")
            return httpx.get(api, params={"query": "up"}, timeout=2).status_code == 200

        wait_until(ready, timeout=30)
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


def alerts(api: str) -> list[dict]:
    """Prometheus' active alerts (pending and firing), from /api/v1/alerts."""
    body = httpx.get(api.replace("/query", "/alerts"), timeout=5).json()
    assert body["status"] == "success", body
    return body["data"]["alerts"]


def metric_names(api: str) -> set[str]:
    """Every metric name Prometheus holds a series of."""
    body = httpx.get(api.replace("/query", "/label/__name__/values"), timeout=5).json()
    assert body["status"] == "success", body
    return set(body["data"])


# Grafana's variables, as a dashboard query sees them, for parsing and running it outside Grafana.
GRAFANA_VARIABLES = {"$__rate_interval": "20s", "$__range": "5m", "$namespace": ".*"}


def dashboard_queries(board: dict) -> Iterator[tuple[str, str]]:
    """(panel title, expr with Grafana's variables replaced) of every target of every panel."""
    for panel in board["panels"]:
        for target in panel.get("targets") or []:
            expr = target["expr"]
            for name, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(name, value)
            yield panel["title"], expr


def metric_names_in(expr: str) -> set[str]:
    """Every metric name a PromQL expression selects (promql-parser's AST, not a regex)."""
    import promql_parser

    names: set[str] = set()

    def visit(node: object) -> None:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(expr), pre_visit=visit)
    return names
