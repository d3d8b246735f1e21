"""Rolling hot reload across worker replicas (DESIGN.md §8, `bcstack worker reload`).

One replica at a time: `POST /admin/reload` on it, then poll `GET /admin/reload` until it reports the
new `weight_version`, and only then go on to the next; the first failure stops the roll so at most
one replica is ever in a bad state and the rest keep serving the old weights. Verifying the
checkpoint locally and finding the replicas (a URL list, or a label selector asked of the Kubernetes
API) are separate functions so the CLI stays thin.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx

ADMIN_RELOAD_PATH = "/admin/reload"
# Where Kubernetes mounts a pod's ServiceAccount: its token, the cluster CA and its namespace.
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
ReplicaState = Literal["reloaded", "failed", "skipped"]
ProgressStage = Literal["reloading", "waiting", "reloaded", "failed", "skipped"]


class ReplicaDiscoveryError(RuntimeError):
    """The replicas could not be listed (no API credentials, the API refused or is down, no pods)."""


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
    canary_step: str | None = None,
) -> ReplicaResult:
    started = time.monotonic()
    deadline = started + timeout
    body: dict[str, Any] = {"checkpoint": checkpoint}
    if weight_version is not None:
        body["weight_version"] = weight_version
    if canary_step is not None:
        body["canary_step"] = canary_step
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
    canary_step: str | None = None,
) -> list[ReplicaResult]:
    """Reload `urls` one at a time with the checkpoint at `checkpoint_on_workers` (the path as the
    workers see it); stop at the first failure. Returns one result per URL, in order: `reloaded`,
    one `failed` (with the reason), then `skipped` ones, whose `weight_version` is what they still
    serve (None when that could not be read). `timeout` bounds each replica (POST plus waiting).
    `weight_version` None lets each worker name the version and waits for the one its POST returned.
    `canary_step` tags each POST for the workers' canary metrics (`bcstack worker reload --canary`).
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
                client,
                url,
                checkpoint_on_workers,
                weight_version,
                headers,
                timeout,
                poll_interval,
                progress,
                canary_step,
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
    selector: str, *, port: int, namespace: str | None = None, timeout: float = 30.0
) -> list[str]:
    """The running pods matching the label `selector` as `http://IP:port`, ordered by pod name, from
    the Kubernetes API (`list pods`, the official client). Inside a pod (KUBERNETES_SERVICE_HOST set)
    it authenticates as the pod's ServiceAccount, elsewhere with the kubeconfig (KUBECONFIG or
    ~/.kube/config). `namespace` None: the pod's own namespace in the cluster, else the kubeconfig
    context's, else "default". ReplicaDiscoveryError when there are no credentials, the API refuses
    or cannot be reached, or no running pod has an IP."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    configuration, default_namespace = _client_configuration()
    namespace = namespace or default_namespace
    where = f"-l {selector} in namespace {namespace}"
    try:
        with client.ApiClient(configuration) as api:
            listing = client.CoreV1Api(api).list_namespaced_pod(
                namespace, label_selector=selector, _request_timeout=timeout
            )
    except ApiException as e:
        if e.status == 403:
            raise ReplicaDiscoveryError(
                f"the Kubernetes API refused to list pods {where} (403 Forbidden: {_api_message(e)}); "
                f"grant RBAC to list pods in namespace {namespace} (a Role allowing get/list/watch on "
                "pods, bound to this ServiceAccount or user) or pass --workers URL,..."
            ) from None
        raise ReplicaDiscoveryError(
            f"listing pods {where} failed: HTTP {e.status} {e.reason}: {_api_message(e)}"
        ) from None
    except HTTPError as e:  # urllib3's: refused, timed out, TLS
        raise ReplicaDiscoveryError(
            f"the Kubernetes API at {configuration.host} did not answer listing pods {where}: {e}"
        ) from None
    pods = [
        (pod.metadata.name, pod.status.pod_ip)
        for pod in listing.items
        if pod.status is not None and pod.status.pod_ip and pod.status.phase == "Running"
    ]
    if not pods:
        raise ReplicaDiscoveryError(f"no running pod with an IP matches {where}")
    return [f"http://{_bracket(ip)}:{port}" for _name, ip in sorted(pods)]


def _client_configuration() -> tuple[Any, str]:
    """(a kubernetes client Configuration, the namespace to use when none is given)."""
    from kubernetes import client, config
    from kubernetes.config.incluster_config import InClusterConfigLoader

    configuration = client.Configuration()
    try:
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            # load_incluster_config() with the files named from one folder, the namespace's too.
            InClusterConfigLoader(
                token_filename=str(SERVICE_ACCOUNT_DIR / "token"),
                cert_filename=str(SERVICE_ACCOUNT_DIR / "ca.crt"),
            ).load_and_set(configuration)
            namespace_file = SERVICE_ACCOUNT_DIR / "namespace"
            namespace = namespace_file.read_text().strip() if namespace_file.is_file() else ""
        else:
            # KUBECONFIG read now, not when the kubernetes package was first imported.
            kubeconfig = os.environ.get("KUBECONFIG") or None
            config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
            _contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)
            namespace = (active or {}).get("context", {}).get("namespace", "")
    except (config.ConfigException, OSError) as e:
        raise ReplicaDiscoveryError(
            f"no Kubernetes API credentials ({e}): run inside the cluster or point KUBECONFIG at a "
            "kubeconfig, or pass --workers URL,..."
        ) from None
    return configuration, namespace or "default"


def _api_message(error: Any) -> str:
    """The `message` of the API's Status answer, else its body or reason."""
    try:
        return str(json.loads(error.body)["message"])
    except (TypeError, ValueError, KeyError):
        return (str(error.body or "").strip() or str(error.reason))[:300]


def _bracket(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip
