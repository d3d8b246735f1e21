"""The chart's Grafana dashboards (issue 17): generated with the Grafana Foundation SDK and
current, every query valid PromQL (promql-parser) over metrics the stack defines, and rendered as
ConfigMaps for Grafana's sidecar. test_alerts_live.py checks every metric named here against the
running stack's /metrics and runs every query on the real Prometheus.
"""

from __future__ import annotations

import json
from pathlib import Path

from helm_harness import ONE_COMPONENT, render_chart, validate_manifests
from prom_util import dashboard_queries, metric_names_in

from bcstack import dashboards

COMMITTED = Path(dashboards.OUT)


def committed() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(COMMITTED.glob("*.json"))}


def recorded_names() -> set[str]:
    rule = next(
        o
        for o in render_chart({**ONE_COMPONENT, "metrics": {"prometheusRule": {"enabled": True}}})
        if o["kind"] == "PrometheusRule"
    )
    return {r["record"] for g in rule["spec"]["groups"] for r in g["rules"] if "record" in r}


def test_the_committed_dashboards_are_what_the_generator_writes():
    generated = dashboards.render_all()
    on_disk = {p.name: p.read_text() for p in COMMITTED.glob("*.json")}
    assert on_disk == generated, "dashboards are stale: run `make dashboards` and commit the result"


def test_the_six_dashboards_the_operators_need():
    titles = {board["title"] for board in committed().values()}
    assert titles == {
        "bcstack / Overview",
        "bcstack / Worker budgets",
        "bcstack / Retrieval",
        "bcstack / Coordinator",
        "bcstack / Judge",
        "bcstack / Training",
    }


def test_every_panel_query_parses_and_names_bcstack_metrics_or_recording_rules():
    recorded = recorded_names()
    for name, board in committed().items():
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert (
            variables["datasource"]["type"] == "datasource"
            and variables["datasource"]["query"] == "prometheus"
        )
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), name
        queries = list(dashboard_queries(board))
        assert queries, name
        for panel in board["panels"]:
            if panel["type"] == "row":
                continue
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            refs = [t["refId"] for t in panel["targets"]]
            assert refs and len(refs) == len(set(refs)), panel["title"]
        for title, expr in queries:
            names = metric_names_in(expr)  # raises on invalid PromQL
            assert names, (title, expr)
            for metric in names:
                assert metric == "up" or metric.startswith("bcstack_") or metric in recorded, (title, metric)


def test_dashboards_render_as_configmaps_for_the_grafana_sidecar():
    assert not [o for o in render_chart(ONE_COMPONENT) if "dashboard" in o["metadata"]["name"]]
    values = {
        "metrics": {
            "dashboards": {
                "enabled": True,
                "label": "grafana.example/dashboard",
                "labelValue": "bcstack",
                "annotations": {"grafana_folder": "bcstack"},
            }
        }
    }
    maps = [
        o
        for o in render_chart({**ONE_COMPONENT, **values})
        if o["kind"] == "ConfigMap" and "-dashboard-" in o["metadata"]["name"]
    ]
    validate_manifests(maps)
    boards = committed()
    assert len(maps) == len(boards) == 6
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana.example/dashboard"] == "bcstack"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "bcstack"}
        ((file, text),) = cm["data"].items()
        assert json.loads(text) == boards[file]
