"""`bcstack coordinator swap`: make one coordinator endpoint the one every gateway replica's new
episodes use, optionally adding or changing it first, and check that every replica runs it.

The gateway that takes the change (PUT /admin/coordinator) probes the endpoint, writes it to the
record store and applies it; every replica sharing that store adopts it within
`endpoint_sync_seconds`, and a replica that restarts reads it back before it serves. So one
reachable gateway is enough for the change (a Service, the local HAProxy front, a port-forward);
the other URLs, or the pods `--k8s-selector` lists, are where the result is checked (/health says
which endpoint and which state version each replica runs).

A key: `--api-key-env` (a variable already in the gateway pods), `--api-key-file` (a path there),
or `--api-key-secret KEY`, a key of the chart's runtime keys Secret, which is mounted whole in
every gateway pod (charts/bcstack values `coordinator.runtimeKeys`): add the key to that Secret and
the kubelet writes it into the running pods within about a minute; until then the gateway refuses
the change with "key file ... does not exist" and this command tries again, up to `--wait`.

Exit codes: 0 every replica runs the endpoint; 1 the change was refused, or some replica did not
adopt it within --wait (each is named with its reason); 2 bad input (options, no admin token, no
gateway answered, replicas that cannot be listed).
"""

from __future__ import annotations

import os
import time
from typing import Any

import httpx
import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from core.kit.cli import fail
from core.kit.upstream import EndpointSpec

TOKEN_ENV = "BCSTACK_ADMIN_TOKEN"
# Where the chart mounts the runtime keys Secret in every gateway pod (charts/bcstack/_coordinator.tpl).
RUNTIME_KEYS_DIR = "/var/run/secrets/bcstack/coordinator-keys"
RETRY_SECONDS = 2.0

app = typer.Typer(add_completion=False, no_args_is_help=True)


@app.callback()
def coordinator() -> None:
    """The coordinator gateways: swap the endpoint every replica uses."""


class SwapFailed(Exception):
    """The change was refused or could not be made; str() is one line."""


def _key_waiting(message: str) -> bool:
    """A refusal that a key file appearing later would lift (the kubelet syncs Secret volumes)."""
    return "key file" in message and ("does not exist" in message or "is blank" in message)


def put_change(
    urls: list[str], change: dict[str, Any], token: str, *, wait: float, say: Any = print
) -> tuple[str, dict[str, Any]]:
    """PUT `change` to the first gateway that answers; (its URL, its answer). Retries while the
    refusal is a key file not written yet, up to `wait` seconds. SwapFailed otherwise."""
    headers = {"Authorization": f"Bearer {token}"}
    deadline = time.monotonic() + wait
    said_waiting = False
    while True:
        problems = []
        for url in urls:
            try:
                response = httpx.put(f"{url}/admin/coordinator", json=change, headers=headers, timeout=60)
            except httpx.HTTPError as exc:
                problems.append(f"{url}: {type(exc).__name__}: {exc}")
                continue
            if response.status_code == 200:
                return url, response.json()
            message = _error_of(response)
            if response.status_code in (401, 403):
                raise SwapFailed(f"{url} refused the admin token ({response.status_code}): {message}")
            if response.status_code == 409 and _key_waiting(message) and time.monotonic() < deadline:
                if not said_waiting:
                    say(f"waiting for the key to reach the gateway pods: {message}")
                    said_waiting = True
                break  # the same answer from every replica; wait, then ask again
            if response.status_code == 503:
                problems.append(f"{url}: 503 {message}")
                continue
            raise SwapFailed(f"{url} refused the change ({response.status_code}): {message}")
        else:
            if time.monotonic() >= deadline:
                raise SwapFailed("no gateway took the change: " + "; ".join(problems))
        time.sleep(RETRY_SECONDS)


def _error_of(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    if isinstance(body, dict):
        return str(body.get("error") or body.get("detail") or body)
    return str(body)


def replica_states(urls: list[str]) -> dict[str, dict[str, Any]]:
    """/health of each gateway ({"error": ...} where it does not answer)."""
    out: dict[str, dict[str, Any]] = {}
    for url in urls:
        try:
            response = httpx.get(f"{url}/health", timeout=10)
            out[url] = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            out[url] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def wait_for_replicas(
    urls: list[str], name: str, version: int, *, wait: float
) -> tuple[bool, dict[str, dict[str, Any]]]:
    """Poll every gateway until each runs endpoint `name` at state version >= `version`."""
    deadline = time.monotonic() + wait
    while True:
        states = replica_states(urls)
        if all(_adopted(state, name, version) for state in states.values()) or time.monotonic() >= deadline:
            return all(_adopted(state, name, version) for state in states.values()), states
        time.sleep(min(1.0, RETRY_SECONDS))


def _adopted(state: dict[str, Any], name: str, version: int) -> bool:
    return state.get("endpoint") == name and (state.get("endpoint_version") or 0) >= version


@app.command()
def swap(
    name: str = typer.Argument(..., help="The endpoint new episodes use from now on, on every replica."),
    gateway: list[str] = typer.Option(
        None,
        "--gateway",
        metavar="URL",
        help="A gateway's HTTP URL (repeat for several). The first that answers takes the change; every "
        "one given is checked to run it. A Service or the local front reaches one replica, and the "
        "others adopt the change from the shared record store.",
    ),
    k8s_selector: str | None = typer.Option(
        None,
        "--k8s-selector",
        metavar="SELECTOR",
        help="Label selector of the gateway pods (e.g. app.kubernetes.io/component=coordinator): "
        "their IPs from the Kubernetes API, each checked; the change goes to the first (run it in the "
        "cluster, or pass --gateway too for the change from outside).",
    ),
    namespace: str | None = typer.Option(
        None, "--k8s-namespace", "-n", help="Kubernetes namespace (with --k8s-selector)."
    ),
    port: int = typer.Option(8080, "--k8s-port", help="The gateways' HTTP port (with --k8s-selector)."),
    base_url: str | None = typer.Option(
        None, "--base-url", help="Add or change the endpoint first: its OpenAI-compatible base URL."
    ),
    model: str | None = typer.Option(None, "--model", help="With --base-url: the model id it serves."),
    api_key_env: str | None = typer.Option(
        None, "--api-key-env", help="With --base-url: the env var holding its key in the gateway pods."
    ),
    api_key_file: str | None = typer.Option(
        None, "--api-key-file", help="With --base-url: a file holding its key in the gateway pods."
    ),
    api_key_secret: str | None = typer.Option(
        None,
        "--api-key-secret",
        metavar="KEY",
        help=f"With --base-url: a key of the chart's runtime keys Secret (mounted at {RUNTIME_KEYS_DIR}); "
        "added to the Secret, it reaches running pods without a restart.",
    ),
    wait: float = typer.Option(
        120.0, "--wait", min=0, help="Seconds to wait for a key to reach the pods and for every replica."
    ),
) -> None:
    """Swap the coordinator endpoint of every gateway replica, and check each one runs it.

    The admin token comes from BCSTACK_ADMIN_TOKEN. A key added to the runtime keys Secret reaches
    running pods without a restart; for example, with the release named bc:

    kubectl create secret generic bc-bcstack-coordinator-keys --from-literal=backup=sk-...

    bcstack coordinator swap backup --base-url https://llm.example.com/v1 --model m2 --api-key-secret
    backup --gateway http://localhost:8080
    """
    console = Console()
    token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        fail(f"{TOKEN_ENV} is not set; the gateways' admin endpoint needs their bearer token")
    if not gateway and k8s_selector is None:
        fail("pass --gateway URL (repeatable), --k8s-selector SELECTOR, or both")
    keys = [k for k in (api_key_env, api_key_file, api_key_secret) if k]
    if len(keys) > 1:
        fail("give at most one of --api-key-env, --api-key-file, --api-key-secret")
    if (base_url is None) != (model is None):
        fail("--base-url and --model go together (the endpoint to add or change)")
    if keys and base_url is None:
        fail("a key option needs --base-url and --model: it belongs to the endpoint being added or changed")
    change: dict[str, Any] = {"activate": name}
    if base_url is not None:
        spec: dict[str, Any] = {"name": name, "base_url": base_url, "model": model}
        if api_key_env:
            spec["api_key_env"] = api_key_env
        if api_key_file:
            spec["api_key_file"] = api_key_file
        if api_key_secret:
            if "/" in api_key_secret or api_key_secret.startswith("."):
                fail(
                    f"--api-key-secret takes a key of the runtime keys Secret, not a path: {api_key_secret!r}"
                )
            spec["api_key_file"] = f"{RUNTIME_KEYS_DIR}/{api_key_secret}"
        try:
            change["endpoint"] = EndpointSpec.model_validate(spec).model_dump(mode="json", exclude_none=True)
        except ValidationError as exc:
            first = exc.errors()[0]
            fail(f"bad endpoint: {'.'.join(str(p) for p in first['loc'])}: {first['msg']}")

    urls = [u.rstrip("/") for u in gateway or []]
    checked = list(urls)
    if k8s_selector is not None:
        from services.worker.rolling import ReplicaDiscoveryError, k8s_worker_urls

        try:
            pods = k8s_worker_urls(k8s_selector, port=port, namespace=namespace)
        except ReplicaDiscoveryError as exc:
            fail(str(exc).replace("--workers URL,...", "--gateway URL"))
        checked = pods
        urls = urls or pods

    try:
        via, answer = put_change(urls, change, token, wait=wait, say=console.print)
    except SwapFailed as exc:
        console.print(f"[red]swap refused[/]: {exc}")
        raise typer.Exit(1) from None
    version = int(answer.get("version") or 0)
    console.print(f"{via} took the change: endpoint '{answer.get('active')}' active, state version {version}")
    ok, states = wait_for_replicas(checked, name, version, wait=wait)
    table = Table(title=f"coordinator endpoint per replica (target '{name}', version >= {version})")
    table.add_column("gateway", no_wrap=True)
    table.add_column("endpoint")
    table.add_column("version")
    table.add_column("state")
    for url, state in states.items():
        good = _adopted(state, name, version)
        why = state.get("error") or state.get("endpoints") or ""
        table.add_row(
            url,
            str(state.get("endpoint", "?")),
            str(state.get("endpoint_version", "?")),
            "[green]runs it[/]" if good else f"[red]not yet[/] {why}",
        )
    console.print(table)
    if not ok:
        behind = [url for url, state in states.items() if not _adopted(state, name, version)]
        console.print(
            f"[red]{len(behind)} of {len(states)} replica(s) did not adopt '{name}' within {wait:g} s[/]: "
            + ", ".join(behind)
        )
        raise typer.Exit(1)
    console.print(f"[green]every replica ({len(states)}) runs '{name}'[/]")
