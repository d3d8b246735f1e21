"""`bcstack smoke`: is a deployed stack answering? One episode through the gateway, then every
service's /metrics.

    bcstack smoke --gateway http://bc-bcstack-coordinator:8003 \\
        --metrics worker=http://bc-bcstack-worker:8002 --metrics judge=http://bc-bcstack-judge:8005

The chart's `helm test` pod runs it against the release's Services; on a laptop,
`bcstack smoke --state .bcstack` reads the URLs from `bcstack up`'s stack.json. It passes when the
episode ran to a stored record whose status is not `error`, and each /metrics answers 200 in the
Prometheus text format with the service's own `bcstack_<name>_*` families (a sidecar that serves
an empty registry fails). Exit status 0 on success, 1 on any failure, 2 on bad arguments; every
check is one line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

DEFAULT_QUESTION = "Which document mentions the smoke test? (a smoke-test question; any answer will do)"
# service name in --metrics / stack.json -> the prefix its own metrics carry
PREFIXES = {
    "retrieval": "bcstack_retrieval_",
    "worker": "bcstack_worker_",
    "engine": "bcstack_engine_",
    "coordinator": "bcstack_coordinator_",
    "coordinator-llm": "bcstack_coordinator_llm_",
    "judge": "bcstack_judge_",
    "trainer": "bcstack_trainer_",
}


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


class SmokeError(ValueError):
    """Arguments the smoke test cannot run with; the message says what to give."""


def parse_targets(items: list[str]) -> dict[str, str]:
    """`NAME=URL` items as {name: url}."""
    targets: dict[str, str] = {}
    for item in items:
        name, sep, url = item.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise SmokeError(
                f"--metrics {item!r}: give NAME=http://HOST:PORT (NAME one of {', '.join(PREFIXES)})"
            )
        if name not in PREFIXES:
            raise SmokeError(f"--metrics {item!r}: unknown service {name!r}; known: {', '.join(PREFIXES)}")
        targets[name] = url.rstrip("/")
    return targets


def from_state(state: Path) -> tuple[str, dict[str, str]]:
    """The gateway URL and every service's URL from `bcstack up`'s stack.json."""
    from bcstack.stack import STATE_FILE, StackError, base_name, gateway_url, read_state

    path = state / STATE_FILE
    try:
        info = read_state(state)
    except StackError as e:
        raise SmokeError(str(e)) from None
    if info is None or not isinstance(info.get("services"), dict):
        raise SmokeError(f"no running stack described at {path}; run `bcstack up --state {state}`")
    services = info["services"]
    if "coordinator" not in services:
        raise SmokeError(f"{path} lists no coordinator gateway")
    # Every worker replica is checked: engine-2 / worker-2, ... carry the engine's / worker's metrics.
    return gateway_url(info) or "", {n: s["http"] for n, s in services.items() if base_name(n) in PREFIXES}


def _owner(family: str) -> str | None:
    """The service a metric family belongs to: the longest prefix that matches
    (bcstack_coordinator_llm_* is the stand-in LLM's, not the gateway's)."""
    matching = [n for n, prefix in PREFIXES.items() if family.startswith(prefix)]
    return max(matching, key=lambda n: len(PREFIXES[n])) if matching else None


def episode_check(client: httpx.Client, gateway: str, question: str) -> Check:
    started = time.monotonic()
    try:
        r = client.post(f"{gateway.rstrip('/')}/v1/episodes", json={"question": question})
    except httpx.HTTPError as e:
        return Check("episode", False, f"{gateway} unreachable: {e}")
    seconds = time.monotonic() - started
    if r.status_code != 200:
        return Check("episode", False, f"POST /v1/episodes answered {r.status_code}: {r.text[:200]}")
    try:
        body = r.json()
        episode_id, status = body["episode_id"], body["status"]
    except (ValueError, KeyError):
        return Check(
            "episode", False, f"POST /v1/episodes answered something else than an episode: {r.text[:200]}"
        )
    stored = client.get(f"{gateway.rstrip('/')}/v1/episodes/{episode_id}")
    if stored.status_code != 200:
        return Check("episode", False, f"episode {episode_id} ran but GET answered {stored.status_code}")
    detail = f"{episode_id}: {status} in {seconds:.1f} s, answer {body.get('answer', '')!r:.80}"
    return Check("episode", status != "error", detail)


def metrics_check(client: httpx.Client, name: str, url: str) -> Check:
    try:
        r = client.get(f"{url}/metrics")
    except httpx.HTTPError as e:
        return Check(f"{name} /metrics", False, f"{url} unreachable: {e}")
    if r.status_code != 200:
        return Check(f"{name} /metrics", False, f"{url}/metrics answered {r.status_code}")
    try:
        families = [f.name for f in text_string_to_metric_families(r.text)]
    except ValueError as e:
        return Check(f"{name} /metrics", False, f"{url}/metrics is not the Prometheus text format: {e}")

    from bcstack.stack import base_name

    kind = base_name(name)  # a replica (worker-2) carries its service's metrics
    own = [f for f in families if _owner(f) == kind]
    if not own:
        return Check(f"{name} /metrics", False, f"{url}/metrics has no {PREFIXES[kind]}* metrics")
    return Check(f"{name} /metrics", True, f"{len(own)} {PREFIXES[kind]}* families")


def run_smoke(gateway: str | None, targets: dict[str, str], question: str, timeout: float) -> list[Check]:
    checks: list[Check] = []
    with httpx.Client(timeout=timeout) as client:
        if gateway:
            checks.append(episode_check(client, gateway, question))
        checks.extend(metrics_check(client, name, url) for name, url in targets.items())
    return checks
