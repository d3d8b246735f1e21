"""Rolling hot reload across worker replicas (DESIGN.md §8, `bcstack worker reload`).

One replica at a time: `POST /admin/reload` on it, then poll `GET /admin/reload` until it reports the
new `weight_version`, and only then go on to the next; the first failure stops the roll so at most
one replica is ever in a bad state and the rest keep serving the old weights. Verifying the
checkpoint locally and finding the replicas (a URL list or a Kubernetes label selector) are separate
functions so the CLI stays thin.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx

ADMIN_RELOAD_PATH = "/admin/reload"
ReplicaState = Literal["reloaded", "failed", "skipped"]
ProgressStage = Literal["reloading", "waiting", "reloaded", "failed", "skipped"]


class ReplicaDiscoveryError(RuntimeError):
    """The replicas could not be listed (kubectl missing or failing, no pods)."""


@dataclass
class ReplicaResult:
    url: str
    state: ReplicaState
    weight_version: str | None = None  # what the replica serves at the end (None: unknown)
    previous_version: str | None = None
    seconds: float | None = None  # POST until the new version was reported
    error: str | None = None


@dataclass(frozen=True)
class ReplicaProgress:
    index: int  # 0-based position in the roll
    total: int
    url: str
    stage: ProgressStage
    message: str = ""


def _error_detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:300] or response.reason_phrase
    if isinstance(body, dict):
        for key in ("error", "detail", "message"):
            if body.get(key):
                return str(body[key])
    return json.dumps(body)[:300]


async def _current_version(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> str | None:
    response = await client.get(f"{url}{ADMIN_RELOAD_PATH}", headers=headers)
    response.raise_for_status()
    return response.json().get("weight_version")


async def _version_or_none(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> str | None:
    try:
        return await _current_version(client, url, headers)
    except (httpx.HTTPError, ValueError):
        return None


async def _reload_one(
    client: httpx.AsyncClient,
    url: str,
    checkpoint: str,
    weight_version: str | None,
    headers: dict[str, str],
    timeout: float,
    poll_interval: float,
    progress: Callable[[ProgressStage, str], None],
) -> ReplicaResult:
    started = time.monotonic()
    deadline = started + timeout
    body: dict[str, Any] = {"checkpoint": checkpoint}
    if weight_version is not None:
        body["weight_version"] = weight_version
    progress("reloading", f"POST {ADMIN_RELOAD_PATH} {checkpoint}")
    try:
        response = await client.post(f"{url}{ADMIN_RELOAD_PATH}", json=body, headers=headers, timeout=timeout)
    except httpx.HTTPError as e:
        return ReplicaResult(url, "failed", error=f"POST {ADMIN_RELOAD_PATH}: {type(e).__name__}: {e}")
    if response.status_code != 200:
        return ReplicaResult(
            url,
            "failed",
            error=f"POST {ADMIN_RELOAD_PATH}: HTTP {response.status_code}: {_error_detail(response)}",
        )
    answer = response.json()
    target = weight_version if weight_version is not None else answer.get("weight_version")
    previous = answer.get("previous_version")
    progress("waiting", f"waiting for weight_version {target!r}")
    # The POST may answer before the engine swapped (or another reload raced it); the replica counts
    # as done only when its own status reports the version.
    seen: str | None = None
    last_error = ""
    while True:
        try:
            seen = await _current_version(client, url, headers)
            last_error = ""
        except (httpx.HTTPError, ValueError) as e:
            last_error = f" (last error: {type(e).__name__}: {e})"
        if seen == target:
            return ReplicaResult(url, "reloaded", seen, previous, round(time.monotonic() - started, 3))
        if time.monotonic() >= deadline:
            return ReplicaResult(
                url,
                "failed",
                seen,
                previous,
                error=f"weight_version still {seen!r}, not {target!r}, after {timeout:g} s{last_error}",
            )
        await asyncio.sleep(min(poll_interval, max(deadline - time.monotonic(), 0.0)))


async def rolling_reload(
    urls: Sequence[str],
    checkpoint_on_workers: str,
    weight_version: str | None,
    token: str,
    *,
    timeout: float,
    on_progress: Callable[[ReplicaProgress], None] | None = None,
    poll_interval: float = 0.25,
) -> list[ReplicaResult]:
    """Reload `urls` one at a time with the checkpoint at `checkpoint_on_workers` (the path as the
    workers see it); stop at the first failure. Returns one result per URL, in order: `reloaded`,
    one `failed` (with the reason), then `skipped` ones, whose `weight_version` is what they still
    serve (None when that could not be read). `timeout` bounds each replica (POST plus waiting).
    `weight_version` None lets each worker name the version and waits for the one its POST returned.
    """
    headers = {"Authorization": f"Bearer {token}"}
    notify = on_progress or (lambda _event: None)
    total = len(urls)
    results: list[ReplicaResult] = []
    async with httpx.AsyncClient(timeout=timeout) as client:
        for index, raw_url in enumerate(urls):
            url = raw_url.rstrip("/")

            def progress(stage: ProgressStage, message: str, *, index: int = index, url: str = url) -> None:
                notify(ReplicaProgress(index, total, url, stage, message))

            result = await _reload_one(
                client, url, checkpoint_on_workers, weight_version, headers, timeout, poll_interval, progress
            )
            results.append(result)
            progress(result.state, result.error or f"now serving {result.weight_version!r}")
            if result.state == "failed":
                if result.weight_version is None:  # what the failed replica serves now, for the table
                    result.weight_version = await _version_or_none(client, url, headers)
                break
        for raw_url in urls[len(results) :]:
            url = raw_url.rstrip("/")
            results.append(ReplicaResult(url, "skipped", await _version_or_none(client, url, headers)))
            notify(ReplicaProgress(len(results) - 1, total, url, "skipped", "not touched"))
    return results


def parse_worker_urls(text: str) -> list[str]:
    """`--workers a,b` → URLs; a bare host:port gets `http://`."""
    urls = []
    for part in text.split(","):
        part = part.strip().rstrip("/")
        if part:
            urls.append(part if "://" in part else f"http://{part}")
    return urls


def k8s_worker_urls(
    selector: str, *, port: int, namespace: str | None = None, kubectl: str = "kubectl", timeout: float = 30.0
) -> list[str]:
    """The running pods matching `selector` as `http://IP:port`, ordered by pod name
    (`kubectl get pods -l SELECTOR -o json`). ReplicaDiscoveryError when kubectl is missing or fails,
    or no running pod has an IP."""
    executable = shutil.which(kubectl)
    if executable is None:
        raise ReplicaDiscoveryError(
            f"{kubectl!r} not found on PATH; install kubectl or pass --workers URL,..."
        )
    command = [executable, "get", "pods", "-l", selector, "-o", "json"]
    if namespace:
        command += ["-n", namespace]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise ReplicaDiscoveryError(
            f"kubectl get pods -l {selector} did not answer within {timeout:g} s"
        ) from None
    if done.returncode != 0:
        raise ReplicaDiscoveryError(
            f"kubectl get pods -l {selector} failed: {done.stderr.strip() or done.returncode}"
        )
    try:
        items = json.loads(done.stdout).get("items", [])
    except (ValueError, AttributeError):
        raise ReplicaDiscoveryError("kubectl get pods printed something that is not a pod list") from None
    pods = []
    for item in items:
        status = item.get("status") or {}
        ip = status.get("podIP")
        if ip and status.get("phase") == "Running":
            pods.append(((item.get("metadata") or {}).get("name", ""), ip))
    if not pods:
        raise ReplicaDiscoveryError(f"no running pod with an IP matches -l {selector}")
    return [f"http://{_bracket(ip)}:{port}" for _name, ip in sorted(pods)]


def _bracket(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip
