"""The chart's PrometheusRule, checked with Prometheus' own tools (issue 17).

`promtool check rules` on the rendered rules, `promtool test rules` on tests/alerts/ (input series
-> expected alerts, one test per alert), and the chart's side of it: off unless asked for or the
Operator's CRDs exist, thresholds and `for:` from values, every alert documented in docs/operating.md.
The live proof (a real Prometheus evaluating these rules against the running stack) is in
test_alerts_live.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from helm_harness import ONE_COMPONENT, chart_defaults, render_chart, validate_manifests

ALERT_TESTS = Path(__file__).parent / "alerts" / "bcstack_test.yaml"
OPERATING = Path(__file__).resolve().parents[1] / "docs" / "operating.md"


def promtool() -> str:
    binary = shutil.which("promtool") or ("/usr/bin/promtool" if Path("/usr/bin/promtool").exists() else "")
    if not binary:
        pytest.fail("no promtool (Debian package `prometheus`): run `make install-test`")
    return binary


def prometheus_rule(values: dict[str, Any] | None = None) -> dict[str, Any]:
    rule = {"prometheusRule": {"enabled": True, **(values or {})}}
    rendered = render_chart({**ONE_COMPONENT, "metrics": rule})
    rules = [o for o in rendered if o["kind"] == "PrometheusRule"]
    assert len(rules) == 1, [o["kind"] for o in rendered]
    return rules[0]


def alerts_of(rule: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}


def write_rules(rule: dict[str, Any], path: Path, *, description_only: bool = False) -> Path:
    groups = rule["spec"]["groups"]
    if description_only:
        groups = yaml.safe_load(yaml.safe_dump(groups))
        for group in groups:
            for r in group["rules"]:
                if "annotations" in r:
                    r["annotations"] = {"description": r["annotations"]["description"]}
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return path


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_off_by_default_offline_and_on_when_asked():
    # enabled: null renders the rule only where the cluster serves the Operator's CRD; the offline
    # render has no such API, so nothing is rendered there.
    assert chart_defaults("metrics")["prometheusRule"]["enabled"] is None
    assert not [o for o in render_chart(ONE_COMPONENT) if o["kind"] == "PrometheusRule"]
    assert not [
        o
        for o in render_chart({**ONE_COMPONENT, "metrics": {"prometheusRule": {"enabled": False}}})
        if o["kind"] == "PrometheusRule"
    ]
    rule = prometheus_rule({"labels": {"release": "kube-prometheus"}})
    validate_manifests([rule])
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus"


def test_promtool_checks_the_rendered_rules(tmp_path):
    rules = write_rules(prometheus_rule(), tmp_path / "rules.yaml")
    done = run([promtool(), "check", "rules", str(rules)], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    groups = yaml.safe_load(rules.read_text())["groups"]
    assert f"SUCCESS: {sum(len(g['rules']) for g in groups)} rules found" in done.stdout


def test_promtool_unit_tests_fire_every_alert(tmp_path):
    rule = prometheus_rule()
    write_rules(rule, tmp_path / "rules.yaml", description_only=True)
    shutil.copy(ALERT_TESTS, tmp_path / ALERT_TESTS.name)
    done = run([promtool(), "test", "rules", ALERT_TESTS.name], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    # Every alert the chart renders is expected to fire in some test, with its labels.
    tested = yaml.safe_load(ALERT_TESTS.read_text())["tests"]
    fired = {
        case["alertname"]
        for test in tested
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    assert fired == set(alerts_of(rule))


BUDGET_SERIES = [  # 2 of every 3 worker episodes run out of budget
    {
        "series": 'bcstack_worker_episodes_total{job="bc-bcstack-worker", stop_reason="finish"}',
        "values": "0+10x90",
    },
    {
        "series": 'bcstack_worker_episodes_total{job="bc-bcstack-worker", stop_reason="budget"}',
        "values": "0+20x90",
    },
]


def stop_reason_alerts(tmp_path: Path, tuned: dict[str, Any], at: list[str]) -> list[list[dict]]:
    """Render with workerStopReasons tuned, and what promtool's evaluation fires at each time."""
    defaults = chart_defaults("metrics")["prometheusRule"]["alerts"]
    rule = prometheus_rule(
        {"alerts": {**defaults, "workerStopReasons": {**defaults["workerStopReasons"], **tuned}}}
    )
    write_rules(rule, tmp_path / "rules.yaml", description_only=True)
    got: list[list[dict]] = []
    for when in at:
        # promtool prints what fired when it differs from the expectation: expect none, read the rest.
        case = {"eval_time": when, "alertname": "BcstackWorkerStopReasons", "exp_alerts": []}
        test = {"interval": "1m", "input_series": BUDGET_SERIES, "alert_rule_test": [case]}
        (tmp_path / "t.yaml").write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "tests": [test]}))
        done = run([promtool(), "test", "rules", "t.yaml"], tmp_path)
        got.append(
            [] if done.returncode == 0 else re.findall(r"Labels:\{([^}]*)\}", done.stdout + done.stderr)
        )
    return got


def test_thresholds_durations_and_labels_come_from_values(tmp_path):
    fires_at_defaults = stop_reason_alerts(tmp_path, {}, ["25m"])
    assert len(fires_at_defaults[0]) == 1 and 'stop_reason="budget"' in fires_at_defaults[0][0]
    assert stop_reason_alerts(tmp_path, {"budget": 0.7}, ["25m"]) == [[]]  # 2/3 is under 0.7
    held, fired = stop_reason_alerts(tmp_path, {"for": "1h", "labels": {"team": "ml-infra"}}, ["50m", "70m"])
    assert held == [] and len(fired) == 1 and 'team="ml-infra"' in fired[0]


def test_a_disabled_alert_is_left_out():
    defaults = chart_defaults("metrics")["prometheusRule"]["alerts"]
    rule = prometheus_rule({"alerts": {"klHigh": {"enabled": False}}})
    assert "BcstackTrainerKLHigh" not in alerts_of(rule)
    assert len(alerts_of(rule)) == len(defaults) - 1


def test_every_alert_has_a_summary_description_and_runbook_in_the_docs():
    alerts = OPERATING.read_text().split("\n## Alerts", 1)
    assert len(alerts) == 2, "docs/operating.md has no `## Alerts` section"
    sections = set(re.findall(r"^### (Bcstack\w+)$", alerts[1].split("\n## ", 1)[0], re.M))
    rule = prometheus_rule({"runbookUrl": "https://git.example/bcstack/docs/operating.md"})
    for name, alert in alerts_of(rule).items():
        notes = alert["annotations"]
        assert notes["summary"] and notes["description"], name
        assert notes["runbook"].endswith(f"> {name}")
        assert notes["runbook_url"] == f"https://git.example/bcstack/docs/operating.md#{name.lower()}"
        assert name in sections, f"docs/operating.md's Alerts section has no runbook heading `### {name}`"
        assert alert["labels"]["severity"] in {"critical", "warning"}


def test_recording_rules_alone_have_colons():
    rule = prometheus_rule()
    for group in rule["spec"]["groups"]:
        for r in group["rules"]:
            if "record" in r:
                assert r["record"].count(":") == 2 and r["record"].split(":")[1].startswith("bcstack_")
            else:
                assert ":" not in r["alert"] and r["alert"].startswith("Bcstack")
