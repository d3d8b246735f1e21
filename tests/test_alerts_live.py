"""The chart's alerts on the live stack (issue 17): `bcstack up`, the real Prometheus (Debian's)
evaluating the rendered PrometheusRule against every service's /metrics, episodes running, and
three faults injected in turn. Each alert is seen `firing` through Prometheus' HTTP API and then
resolved once the fault is removed:

- the retrieval service SIGKILLed (BcstackTargetDown), then restarted with its own command line;
- the coordinator LLM answering 500 to every call through its runtime fault injection
  (BcstackCoordinatorUpstreamErrors, BcstackCoordinatorBreakerOpen), then healthy again;
- a corrupt checkpoint sent to the worker's reload (BcstackWorkerReloadFailed), which resolves
  once the window has passed.

Prometheus scrapes each service under the job name the chart's ServiceMonitors give it
(<release>-bcstack-<component>: the engine under the worker's, as the worker ServiceMonitor
scrapes both containers), so these are the rules a cluster runs. Only the timings are the test's:
a 6 s window, no `for:` holds, a 3 s breaker reset, scraped and evaluated every second.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from conftest import LOOPBACK, find_free_port, wait_until
from helm_harness import ONE_COMPONENT, chart_defaults, render_chart
from prom_util import alerts, dashboard_queries, metric_names_in, prometheus, query
from prometheus_client.parser import text_string_to_metric_families

from bcstack import dashboards
from bcstack.stack import down, read_state, restart, up
from trainer.sinks import RunSinks

# This module's stacks fork their services (conftest.forked_services).
pytestmark = pytest.mark.usefixtures("forked_services")

RELEASE = "bc"
JOBS = {  # stack service -> the job its chart ServiceMonitor scrapes it as
    "retrieval": f"{RELEASE}-bcstack-retrieval",
    "worker": f"{RELEASE}-bcstack-worker",
    "engine": f"{RELEASE}-bcstack-worker",
    "coordinator": f"{RELEASE}-bcstack-coordinator",
    "judge": f"{RELEASE}-bcstack-judge",
    "coordinator-llm": "coordinator-llm",  # outside the chart: the production coordinator LLM is external
}
TRAINER_JOB = f"default/{RELEASE}-bcstack-trainer"  # a PodMonitor's job: <namespace>/<name>
WINDOW = "6s"  # rates need two 1 s scrapes inside it; an alert resolves this long after its fault


def live_rules(path: Path) -> Path:
    """The chart's rules with the test's timings: every alert at once (`for: 0s`), a short window."""
    alerts_values = {name: {"for": "0s"} for name in chart_defaults("metrics")["prometheusRule"]["alerts"]}
    alerts_values["turnsSlow"]["baseline"] = "2m"
    rule = {"prometheusRule": {"enabled": True, "window": WINDOW, "alerts": alerts_values}}
    values = {**ONE_COMPONENT, "metrics": rule}
    rule = next(o for o in render_chart(values, release=RELEASE) if o["kind"] == "PrometheusRule")
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    return path


class Traffic:
    """Episodes through the gateway, one after another, each graded by the judge, until stopped."""

    def __init__(self, services: dict[str, Any], questions: list[dict[str, Any]]) -> None:
        self.gateway = services["coordinator"]["http"]
        self.judge = services["judge"]["http"]
        self.questions = questions
        self.finished = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def _run(self) -> None:
        rng = random.Random(0)
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                q = rng.choice(self.questions)
                with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                    r = client.post(f"{self.gateway}/v1/episodes", json={"question": q["query"]})
                    answer = (r.json().get("answer") or "") if r.status_code == 200 else ""
                    client.post(
                        f"{self.judge}/v1/grade",
                        json={
                            "question": q["query"],
                            "response": answer or "none",
                            "correct_answer": q["answer"],
                        },
                    )
                    self.finished += 1
                if self._stop.wait(0.05):
                    return


def firing(api: str, name: str, **labels: str) -> list[dict]:
    return [
        a
        for a in alerts(api)
        if a["labels"]["alertname"] == name
        and a["state"] == "firing"
        and all(a["labels"].get(k) == v for k, v in labels.items())
    ]


def wait_firing(api: str, name: str, timeout: float = 60, **labels: str) -> dict:
    found = wait_until(
        lambda: firing(api, name, **labels), timeout=timeout, interval=0.5, message=f"{name} firing"
    )
    return found[0]


def wait_resolved(api: str, name: str, timeout: float = 90, **labels: str) -> None:
    wait_until(
        lambda: not firing(api, name, **labels), timeout=timeout, interval=0.5, message=f"{name} resolved"
    )


def _kill(state: Path, name: str) -> None:
    """SIGKILL one service of the stack (its process group): no shutdown code runs."""
    pid = read_state(state)["services"][name]["pid"]
    os.killpg(pid, signal.SIGKILL)  # the forkserver it was forked from reaps it


@pytest.fixture(scope="module")
def live(tmp_path_factory, toy_kit) -> Iterator[dict[str, Any]]:
    state = tmp_path_factory.mktemp("alert-stack")
    kit = toy_kit["dir"]
    # The gateway lets a trial call through an open breaker after 3 s, not 30, so the breaker alert
    # resolves within the test; every service reads its settings from the environment.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("BCSTACK_COORDINATOR_BREAKER_RESET_SECONDS", "3")
        assets = {"world": kit / "world", "kit": kit / "tiny", "index": kit / "idx"}
        info = up(state, worker="expert", **assets, say=lambda s: None)
    services = info["services"]
    targets: dict[str, list[str]] = {}
    for name, job in JOBS.items():
        targets.setdefault(job, []).append(services[name]["http"].removeprefix("http://"))
    questions = [json.loads(line) for line in (kit / "world" / "questions.jsonl").read_text().splitlines()]
    prom_dir = tmp_path_factory.mktemp("prometheus")
    # The trainer's /metrics as `bcstack train rl --metrics-port` serves it (no update logged: the
    # run has just started), scraped as the chart's PodMonitor job.
    trainer_port = find_free_port()
    sinks = RunSinks(prom_dir / "train", set(), prometheus_port=trainer_port, prometheus_host=LOOPBACK)
    targets[TRAINER_JOB] = [f"{LOOPBACK}:{trainer_port}"]
    try:
        with (
            prometheus(prom_dir, targets, [live_rules(prom_dir / "rules.yaml")]) as api,
            Traffic(services, questions) as traffic,
        ):
            yield {"state": state, "services": services, "api": api, "traffic": traffic, "targets": targets}
    finally:
        sinks.close()
        if read_state(state) is not None:
            down(state, say=lambda s: None)


def test_no_alert_fires_on_the_healthy_stack(live):
    api = live["api"]
    wait_until(lambda: live["traffic"].finished >= 5, timeout=120, message="five graded episodes")

    def every_target_up() -> bool:
        ups = query(api, "up")
        return len(ups) == len(JOBS) + 1 and all(s["value"][1] == "1" for s in ups)

    wait_until(every_target_up, timeout=30, message="every target scraped")
    # The recording rules evaluate (a rate needs two scrapes of the counter inside the window).
    wait_until(
        lambda: query(api, "job_stop_reason:bcstack_worker_episodes:rate"), timeout=30, message="rules"
    )
    assert [a["labels"]["alertname"] for a in alerts(api)] == []


def test_retrieval_killed_fires_target_down_and_restarting_it_resolves_it(live):
    api, state = live["api"], live["state"]
    _kill(state, "retrieval")
    try:
        alert = wait_firing(api, "BcstackTargetDown", job=JOBS["retrieval"])
        assert alert["labels"]["severity"] == "critical"
        assert alert["labels"]["instance"] == live["services"]["retrieval"]["http"].removeprefix("http://")
        assert alert["annotations"]["runbook"] == "docs/operating.md, Alerts > BcstackTargetDown"
    finally:
        restart(state, "retrieval", say=lambda s: None)  # `bcstack restart`: its own command line
    wait_resolved(api, "BcstackTargetDown", job=JOBS["retrieval"])


def test_coordinator_llm_500s_fire_upstream_errors_and_the_breaker_then_resolve(live):
    api, services = live["api"], live["services"]
    token = (live["state"] / "admin-token").read_text().strip()
    auth = {"Authorization": f"Bearer {token}"}
    llm = services["coordinator-llm"]["http"]
    r = httpx.put(
        f"{llm}/admin/faults", json={"fail_rate": 1.0, "fail_mode": "http500"}, headers=auth, timeout=5
    )
    assert r.status_code == 200, r.text
    try:
        errors = wait_firing(api, "BcstackCoordinatorUpstreamErrors", job=JOBS["coordinator"])
        assert float(errors["value"]) > 0.1 and errors["labels"]["endpoint"]
        wait_firing(api, "BcstackCoordinatorBreakerOpen", job=JOBS["coordinator"])
    finally:
        r = httpx.put(f"{llm}/admin/faults", json={"fail_rate": 0.0}, headers=auth, timeout=5)
        assert r.status_code == 200, r.text
    wait_resolved(api, "BcstackCoordinatorBreakerOpen")
    wait_resolved(api, "BcstackCoordinatorUpstreamErrors")


def test_a_corrupt_checkpoint_reload_fires_reload_failed_then_resolves(live, tmp_path):
    api, state = live["api"], live["state"]
    token = (state / "admin-token").read_text().strip()
    bad = state / "train" / "corrupt"
    shutil.copytree(live_kit_model(state), bad)
    weights = next(bad.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # cut in half
    worker = live["services"]["worker"]["http"]
    r = httpx.post(
        f"{worker}/admin/reload",
        json={"checkpoint": "corrupt", "weight_version": "corrupt-1"},
        headers={"Authorization": f"Bearer {token}"},
        timeout=60,
    )
    assert r.status_code == 422 and r.json()["status"] == "failed", r.text
    alert = wait_firing(api, "BcstackWorkerReloadFailed", job=JOBS["worker"])
    assert alert["labels"]["outcome"] == "rejected"
    wait_resolved(api, "BcstackWorkerReloadFailed")


def live_kit_model(state: Path) -> Path:
    return Path(read_state(state)["assets"]["tiny"])


def exported_names(target: str) -> set[str]:
    """The metric names a target's /metrics exports, series or not yet (a labelled counter with no
    children still has its HELP and TYPE lines)."""
    text = httpx.get(f"http://{target}/metrics", timeout=10).text
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_count", "_sum", "_created"),
        "summary": ("", "_count", "_sum", "_created"),
        "info": ("_info",),
    }
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


def test_every_dashboard_metric_is_exported_and_every_query_runs(live):
    """A renamed metric breaks this test, not a dashboard: every metric a panel names is exported by
    a running service (or is a recording rule the Prometheus evaluates), and Prometheus runs every
    panel's query; the overview's panels show data from the episodes running."""
    api = live["api"]
    exported = {"up"}
    for addresses in live["targets"].values():
        for target in addresses:
            exported |= exported_names(target)
    recorded = {r["name"] for g in _rule_groups(api) for r in g["rules"] if r["type"] == "recording"}
    for uid in dashboards.DASHBOARDS:
        board = json.loads((dashboards.OUT / f"{uid}.json").read_text())
        for title, expr in dashboard_queries(board):
            for metric in metric_names_in(expr):
                assert metric in exported or metric in recorded, f"{uid} / {title}: {metric} is not exported"
            answer = httpx.get(api, params={"query": expr}, timeout=10).json()
            assert answer["status"] == "success", (uid, title, answer)
            if uid == "bcstack-overview":
                wait_until(lambda e=expr: query(api, e), timeout=30, message=f"data for {title}")


def _rule_groups(api: str) -> list[dict]:
    body = httpx.get(api.replace("/query", "/rules"), timeout=5).json()
    assert body["status"] == "success", body
    return body["data"]["groups"]


def test_the_helm_test_pod_command_passes_on_the_stack_and_fails_on_a_dead_service(live):
    """The chart's `helm test` pod runs `bcstack smoke` with the release's Service URLs; here the same
    arguments, with each Service URL swapped for the local service's, against the running stack."""
    values = {c: {"enabled": True} for c in ("coordinator", "retrieval", "worker", "judge")}
    pod = next(o for o in render_chart(values, release=RELEASE) if o["kind"] == "Pod")
    (container,) = pod["spec"]["containers"]
    services = live["services"]
    ports = {"coordinator": 8003, "retrieval": 8001, "worker": 8002, "judge": 8005}  # the chart's defaults
    local = {f"http://{JOBS[name]}:{port}": services[name]["http"] for name, port in ports.items()}

    def localised(args: list[str]) -> list[str]:
        out = []
        for arg in args:
            for cluster_url, url in local.items():
                arg = arg.replace(cluster_url, url)
            out.append(arg)
        return out

    args = localised(container["args"])
    assert not [a for a in args if "bcstack-" in a], args  # every Service URL had a local service
    smoke = [sys.executable, "-m", "bcstack", *container["command"][1:]]
    done = subprocess.run([*smoke, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "smoke: 5/5 checks passed" in done.stdout
    dead = [a.replace(services["judge"]["http"], f"http://{LOOPBACK}:{find_free_port()}") for a in args]
    failed = subprocess.run([*smoke, *dead], capture_output=True, text=True, timeout=300)
    assert failed.returncode == 1 and "FAIL  judge /metrics" in failed.stdout, failed.stdout
    whole = subprocess.run(
        [*smoke, "--state", str(live["state"])], capture_output=True, text=True, timeout=300
    )
    assert whole.returncode == 0 and "smoke: 7/7 checks passed" in whole.stdout, whole.stdout + whole.stderr
