"""Rolling hot reload of worker replicas and the checkpoint watcher (DESIGN.md §5, §8; issue 9).

Fake workers: a small FastAPI app per replica, run under uvicorn on a real port, with the admin
reload contract (bearer token; POST answers ok or a scripted failure and takes the new version a
moment later; GET reports the version). All replicas append to one shared log, so the order of
calls across replicas is visible. The checkpoint is a real export of the tiny kit, made once.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
import uvicorn
import yaml
from conftest import find_free_port
from fake_openai import serving_uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from typer.testing import CliRunner

from bcstack.reload_cli import app
from core.checkpoint import SUMS_FILE, VerifyError, verify_checkpoint
from services.worker import rolling
from services.worker.rolling import ReplicaDiscoveryError, k8s_worker_urls
from services.worker.watch import CheckpointWatcher
from trainer.export import export_checkpoint

TOKEN = "s3cret"
runner = CliRunner()


class FakeWorker:
    """One replica's admin reload contract. `fail` maps a POST number (1-based) to (status, body);
    the new version shows in GET only `swap_delay` seconds after a 200 POST."""

    def __init__(self, name: str, log: list[tuple], *, version: str = "v0", swap_delay: float = 0.3) -> None:
        self.name, self.log, self.version, self.swap_delay = name, log, version, swap_delay
        self.fail: dict[int, tuple[int, dict]] = {}
        self.posts: list[dict] = []
        self.lock = threading.Lock()
        self.app = FastAPI()
        self.app.post("/admin/reload")(self._post)
        self.app.get("/admin/reload")(self._get)

    def _auth(self, request: Request) -> JSONResponse | None:
        header = request.headers.get("authorization")
        if header is None:
            return JSONResponse({"detail": "no token"}, status_code=401)
        if header != f"Bearer {TOKEN}":
            return JSONResponse({"detail": "wrong token"}, status_code=403)
        return None

    async def _post(self, request: Request) -> JSONResponse:
        if (denied := self._auth(request)) is not None:
            return denied
        body = await request.json()
        with self.lock:
            self.posts.append(body)
            self.log.append(("post", self.name, body.get("weight_version")))
            number = len(self.posts)
        if number in self.fail:
            status, answer = self.fail[number]
            return JSONResponse(answer, status_code=status)
        previous, target = self.version, body.get("weight_version") or Path(body["checkpoint"]).name

        async def swap() -> None:
            await asyncio.sleep(self.swap_delay)
            self.version = target

        asyncio.get_running_loop().create_task(swap())
        return JSONResponse(
            {
                "status": "ok",
                "weight_version": target,
                "previous_version": previous,
                "seconds": 0.01,
                "paused_seconds": 0.0,
            }
        )

    async def _get(self, request: Request) -> JSONResponse:
        if (denied := self._auth(request)) is not None:
            return denied
        self.log.append(("get", self.name, self.version))
        return JSONResponse({"weight_version": self.version, "checkpoint_root": "/ckpt", "attempts": []})


@pytest.fixture
def workers() -> Iterator[tuple[list[FakeWorker], list[str], list[tuple]]]:
    log: list[tuple] = []
    fakes = [FakeWorker(f"w{i}", log) for i in range(3)]
    urls = []
    with ExitStack() as stack:
        for fake in fakes:
            port = find_free_port()
            config = uvicorn.Config(
                fake.app, host="127.0.0.1", port=port, lifespan="off", log_level="warning"
            )
            stack.enter_context(serving_uvicorn(uvicorn.Server(config)))
            urls.append(f"http://127.0.0.1:{port}")
        yield fakes, urls, log


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory, tiny_kit) -> Path:
    root = tmp_path_factory.mktemp("export")
    tiny_kit(root / "kit")
    export_checkpoint(root / "kit", root / "step-100")
    return root / "step-100"


def _stamp(folder: Path, when: float, sums_when: float | None = None) -> None:
    """Every file's mtime to `when`, SHA256SUMS's to `sums_when` (default `when + 1`)."""
    for path in folder.rglob("*"):
        if path.is_file():
            os.utime(path, (when, when))
    sums = when + 1 if sums_when is None else sums_when
    os.utime(folder / SUMS_FILE, (sums, sums))


def _break(folder: Path) -> None:
    """A file changed after the export: its hash no longer matches SHA256SUMS."""
    config = folder / "config.json"
    config.write_text(config.read_text() + "\n")


@pytest.fixture
def broken(exported: Path, tmp_path: Path) -> Path:
    copy = Path(shutil.copytree(exported, tmp_path / "broken"))
    _break(copy)
    return copy


def _flat(text: str) -> str:
    return " ".join(text.split())


# ----------------------------------------------------------------------------------------------
# Rolling reload


def test_three_replicas_reload_one_at_a_time_in_order(workers, exported: Path, monkeypatch) -> None:
    fakes, urls, log = workers
    monkeypatch.setenv("BCSTACK_ADMIN_TOKEN", TOKEN)
    result = runner.invoke(
        app,
        [
            "reload",
            "--checkpoint",
            str(exported),
            "--workers",
            ",".join(urls),
            "--path-on-workers",
            "/ckpt/s100",
        ],
    )
    assert result.exit_code == 0, result.output
    assert [fake.version for fake in fakes] == ["step-100"] * 3
    assert all(fake.posts == [{"checkpoint": "/ckpt/s100", "weight_version": "step-100"}] for fake in fakes)
    posts = [i for i, entry in enumerate(log) if entry[0] == "post"]
    assert [log[i][1] for i in posts] == ["w0", "w1", "w2"]
    for before, after in (("w0", "w1"), ("w1", "w2")):
        # the next replica is called only after the previous one reported the new version
        reported = log.index(("get", before, "step-100"))
        assert reported < log.index(("post", after, "step-100"))
        assert ("get", before, "v0") in log  # it was polled while still swapping
    assert "all 3 replica(s) serve 'step-100'" in _flat(result.output)


def test_stops_at_the_first_failure(workers, exported: Path, monkeypatch) -> None:
    fakes, urls, log = workers
    fakes[1].fail[1] = (422, {"status": "failed", "error": "SHA256SUMS: missing in /ckpt/x"})
    monkeypatch.setenv("BCSTACK_ADMIN_TOKEN", TOKEN)
    result = runner.invoke(
        app,
        ["reload", "--checkpoint", str(exported), "--workers", ",".join(urls), "--weight-version", "v1"],
    )
    assert result.exit_code == 1, result.output
    assert [len(fake.posts) for fake in fakes] == [1, 1, 0]  # replica 3 untouched
    assert [fake.version for fake in fakes] == ["v1", "v0", "v0"]
    out = _flat(result.output)
    assert f"stopped at {urls[1]}: POST /admin/reload: HTTP 422: SHA256SUMS: missing in /ckpt/x" in out
    table = [line for line in result.output.splitlines() if "127.0.0.1" in line and "│" in line]
    assert [(("reloaded" in row), ("failed" in row), ("skipped" in row)) for row in table] == [
        (True, False, False),
        (False, True, False),
        (False, False, True),
    ]
    versions = [[cell.strip() for cell in row.split("│")][3] for row in table]
    assert versions == ["v1", "v0", "v0"]  # which replica holds which version


def test_a_bad_checkpoint_fails_before_any_replica_is_called(workers, broken: Path, monkeypatch) -> None:
    fakes, urls, log = workers
    monkeypatch.setenv("BCSTACK_ADMIN_TOKEN", TOKEN)
    result = runner.invoke(app, ["reload", "--checkpoint", str(broken), "--workers", ",".join(urls)])
    assert result.exit_code == 2
    assert "failed verification, no replica touched" in _flat(result.output)
    assert "config.json" in result.output
    assert log == []


def test_missing_token_is_bad_input(workers, exported: Path, monkeypatch) -> None:
    fakes, urls, log = workers
    monkeypatch.delenv("BCSTACK_ADMIN_TOKEN", raising=False)
    result = runner.invoke(app, ["reload", "--checkpoint", str(exported), "--workers", urls[0]])
    assert result.exit_code == 2
    assert "BCSTACK_ADMIN_TOKEN is not set" in result.output
    assert log == []
    neither = runner.invoke(
        app, ["reload", "--checkpoint", str(exported)], env={"BCSTACK_ADMIN_TOKEN": TOKEN}
    )
    assert neither.exit_code == 2 and "exactly one of --workers" in neither.output


# ----------------------------------------------------------------------------------------------
# Finding the replicas through the Kubernetes API


class StandInApiServer:
    """The Kubernetes API server for the one call discovery makes, `GET
    /api/v1/namespaces/NS/pods?labelSelector=SEL`, on a loopback port: plain HTTP, or HTTPS with
    `tls=(cert, key)`. `pods` holds pod objects by namespace; an equality selector (`k=v,k2=v2`, what
    the chart's selector labels make) is matched as the API server matches it. `forbid` answers as
    the API server does for a ServiceAccount without RBAC on pods. Every request is kept in
    `requests` as (path, query, Authorization header)."""

    def __init__(self, pods: dict[str, list[dict]], *, tls: tuple[Path, Path] | None = None) -> None:
        self.pods, self.forbid = pods, False
        self.requests: list[tuple[str, dict[str, list[str]], str | None]] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                url = urlsplit(self.path)
                query = parse_qs(url.query)
                stand_in.requests.append((url.path, query, self.headers.get("Authorization")))
                parts = url.path.strip("/").split("/")
                if len(parts) != 5 or parts[:3] != ["api", "v1", "namespaces"] or parts[4] != "pods":
                    return self._answer(404, _status(404, "NotFound", "the server could not find it"))
                namespace = parts[3]
                if stand_in.forbid:
                    message = (
                        'pods is forbidden: User "system:serviceaccount:research:trainer" cannot list '
                        f'resource "pods" in API group "" in the namespace "{namespace}"'
                    )
                    return self._answer(403, _status(403, "Forbidden", message))
                wanted = dict(
                    term.split("=", 1) for term in query.get("labelSelector", [""])[0].split(",") if term
                )
                items = [
                    pod
                    for pod in stand_in.pods.get(namespace, [])
                    if pod["metadata"].get("labels", {}).items() >= wanted.items()
                ]
                self._answer(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items})

            def _answer(self, status: int, body: dict) -> None:
                payload = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> StandInApiServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def _status(code: int, reason: str, message: str) -> dict:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _pod(name: str, phase: str, ip: str | None = None, component: str = "worker") -> dict:
    labels = {"app.kubernetes.io/instance": "bc", "app.kubernetes.io/component": component}
    status: dict = {"phase": phase}
    if ip is not None:
        status |= {"podIP": ip, "podIPs": [{"ip": ip}]}
    return {
        "metadata": {"name": name, "namespace": "research", "labels": labels},
        "spec": {"containers": [{"name": "worker", "image": "ghcr.io/browsecomp-stack/bcstack:0.1.0"}]},
        "status": status,
    }


SELECTOR = "app.kubernetes.io/instance=bc,app.kubernetes.io/component=worker"
PODS = {
    "research": [
        _pod("bc-worker-b", "Running", "10.1.0.2"),
        _pod("bc-worker-a", "Running", "10.1.0.1"),
        _pod("bc-worker-c", "Pending"),  # not scheduled yet: no IP
        _pod("bc-worker-d", "Succeeded", "10.1.0.4"),
        _pod("bc-worker-e", "Running", "fd00::5"),
        _pod("bc-judge-0", "Running", "10.1.0.9", component="judge"),  # another component
    ],
}


def _kubeconfig(path: Path, server: str, namespace: str | None = "research") -> Path:
    context = {"cluster": "stand-in", "user": "tester", **({"namespace": namespace} if namespace else {})}
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "stand-in", "cluster": {"server": server}}],
                "users": [{"name": "tester", "user": {"token": "kubeconfig-token"}}],
                "contexts": [{"name": "stand-in", "context": context}],
                "current-context": "stand-in",
            }
        )
    )
    return path


@pytest.fixture
def outside_the_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)


def test_k8s_discovery_lists_running_pods_by_name(outside_the_cluster, tmp_path: Path, monkeypatch) -> None:
    with StandInApiServer(PODS) as api:
        monkeypatch.setenv("KUBECONFIG", str(_kubeconfig(tmp_path / "config", api.url)))
        urls = k8s_worker_urls(SELECTOR, port=8002)
    # Running with an IP only, ordered by pod name; an IPv6 address in brackets.
    assert urls == ["http://10.1.0.1:8002", "http://10.1.0.2:8002", "http://[fd00::5]:8002"]
    # The kubeconfig context's namespace and the token it names.
    assert api.requests == [
        ("/api/v1/namespaces/research/pods", {"labelSelector": [SELECTOR]}, "Bearer kubeconfig-token")
    ]


def test_k8s_discovery_namespace_given_or_default(outside_the_cluster, tmp_path: Path, monkeypatch) -> None:
    pods = {"default": [_pod("w-0", "Running", "10.2.0.1")], "other": [_pod("w-1", "Running", "10.3.0.1")]}
    with StandInApiServer(pods) as api:
        monkeypatch.setenv("KUBECONFIG", str(_kubeconfig(tmp_path / "config", api.url, namespace=None)))
        assert k8s_worker_urls(SELECTOR, port=9) == ["http://10.2.0.1:9"]  # no namespace in the context
        assert k8s_worker_urls(SELECTOR, port=9, namespace="other") == ["http://10.3.0.1:9"]
    assert [path for path, _, _ in api.requests] == [
        "/api/v1/namespaces/default/pods",
        "/api/v1/namespaces/other/pods",
    ]


def test_k8s_discovery_without_rbac_names_what_is_missing(
    outside_the_cluster, tmp_path: Path, monkeypatch
) -> None:
    with StandInApiServer(PODS) as api:
        api.forbid = True
        monkeypatch.setenv("KUBECONFIG", str(_kubeconfig(tmp_path / "config", api.url)))
        with pytest.raises(ReplicaDiscoveryError) as refused:
            k8s_worker_urls(SELECTOR, port=8002)
    message = str(refused.value)
    assert "list pods in namespace research" in message
    assert "403" in message and 'cannot list resource "pods"' in message  # the API server's own reason


def test_k8s_discovery_errors(outside_the_cluster, tmp_path: Path, monkeypatch) -> None:
    with StandInApiServer(PODS) as api:
        monkeypatch.setenv("KUBECONFIG", str(_kubeconfig(tmp_path / "config", api.url)))
        with pytest.raises(ReplicaDiscoveryError, match="no running pod with an IP matches -l app=none"):
            k8s_worker_urls("app=none", port=8002)
        with pytest.raises(ReplicaDiscoveryError, match="in namespace empty$"):
            k8s_worker_urls(SELECTOR, port=8002, namespace="empty")
    # The API server gone.
    with pytest.raises(ReplicaDiscoveryError, match=f"the Kubernetes API at {api.url} did not answer"):
        k8s_worker_urls(SELECTOR, port=8002, timeout=5)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(ReplicaDiscoveryError, match="no Kubernetes API credentials"):
        k8s_worker_urls(SELECTOR, port=8002)


def test_k8s_discovery_in_a_pod_uses_its_service_account(tmp_path: Path, monkeypatch) -> None:
    """In the cluster: the API over HTTPS at KUBERNETES_SERVICE_HOST/PORT, trusted by the mounted CA,
    as the mounted token, in the pod's own namespace; no kubeconfig."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=apiserver",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text("pod-token")
    (account / "namespace").write_text("research")
    shutil.copy(cert, account / "ca.crt")
    monkeypatch.setattr(rolling, "SERVICE_ACCOUNT_DIR", account)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))  # never read in a pod
    with StandInApiServer(PODS, tls=(cert, key)) as api:
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(api.port))
        urls = k8s_worker_urls(SELECTOR, port=8002)
    assert urls == ["http://10.1.0.1:8002", "http://10.1.0.2:8002", "http://[fd00::5]:8002"]
    ((path, _query, authorization),) = api.requests
    assert path == "/api/v1/namespaces/research/pods"
    assert authorization is not None and authorization.lower() == "bearer pod-token"


def test_reload_with_k8s_selector_rolls_the_listed_pods(
    outside_the_cluster, exported: Path, tmp_path: Path, monkeypatch
) -> None:
    port = find_free_port()
    log: list[tuple] = []
    fakes = [FakeWorker("a", log, swap_delay=0.0), FakeWorker("b", log, swap_delay=0.0)]
    pods = {
        "research": [
            _pod("worker-b", "Running", "127.0.0.2"),
            _pod("worker-a", "Running", "127.0.0.1"),
            _pod("worker-c", "Pending"),
        ]
    }
    monkeypatch.setenv("BCSTACK_ADMIN_TOKEN", TOKEN)
    with StandInApiServer(pods) as api, ExitStack() as stack:
        monkeypatch.setenv("KUBECONFIG", str(_kubeconfig(tmp_path / "config", api.url, namespace=None)))
        for fake, host in zip(fakes, ("127.0.0.1", "127.0.0.2"), strict=True):
            config = uvicorn.Config(fake.app, host=host, port=port, lifespan="off", log_level="warning")
            stack.enter_context(serving_uvicorn(uvicorn.Server(config)))
        args = ["reload", "--checkpoint", str(exported), "--k8s-selector", SELECTOR, "--k8s-port", str(port)]
        result = runner.invoke(app, [*args, "-n", "research"])
        assert result.exit_code == 0, result.output
        api.forbid = True
        refused = runner.invoke(app, [*args, "-n", "research"])
    assert [entry[1] for entry in log if entry[0] == "post"] == ["a", "b"]  # by pod name; Pending skipped
    assert [fake.version for fake in fakes] == ["step-100", "step-100"]
    assert refused.exit_code == 2  # bad input, before any replica is touched
    assert "list pods in namespace research" in _flat(refused.output)
    assert len(fakes[0].posts) == 1


# ----------------------------------------------------------------------------------------------
# Watch mode


def _copy_export(exported: Path, target: Path, when: float) -> Path:
    copy = Path(shutil.copytree(exported, target))
    _stamp(copy, when)
    return copy


def test_watcher_loads_complete_exports_once_and_skips_broken_ones(exported: Path, tmp_path: Path) -> None:
    root = tmp_path / "exports"
    root.mkdir()
    calls: list[tuple[Path, str]] = []
    verified: list[str] = []

    async def reload(path: Path, version: str) -> None:
        calls.append((path, version))

    def verify(path: Path) -> dict:
        verified.append(path.name)
        return verify_checkpoint(path)

    watcher = CheckpointWatcher(root, reload, interval=0.05, verify=verify)
    base = time.time() - 1000

    async def scenario() -> None:
        # still being written: no SHA256SUMS yet
        writing = _copy_export(exported, root / "step-1", base)
        (writing / SUMS_FILE).unlink()
        assert await watcher.scan_once() is None
        # SHA256SUMS older than a weight file: not complete either
        _copy_export(exported, root / "step-1b", base)
        shutil.rmtree(root / "step-1")
        weights = next((root / "step-1b").glob("*.safetensors"))
        os.utime(weights, (base + 5, base + 5))
        assert await watcher.scan_once() is None
        assert calls == [] and verified == []
        # once SHA256SUMS is the newest file the export counts: reloaded exactly once
        os.utime(root / "step-1b" / SUMS_FILE, (base + 6, base + 6))
        assert await watcher.scan_once() == "step-1b"
        assert await watcher.scan_once() is None
        assert calls == [(root / "step-1b", "step-1b")]
        # a newer but broken export is rejected, and not verified again while unchanged
        broken = _copy_export(exported, root / "step-2", base + 10)
        _break(broken)
        _stamp(broken, base + 10)
        assert await watcher.scan_once() is None
        assert await watcher.scan_once() is None
        assert verified.count("step-2") == 1
        assert "step-2" in watcher.rejected and watcher.loaded == "step-1b"
        # a newer good one triggers again; the watcher never goes back to older folders
        _copy_export(exported, root / "step-3", base + 20)
        _copy_export(exported, root / "step-0", base - 50)
        assert await watcher.scan_once() == "step-3"
        assert await watcher.scan_once() is None
        assert [version for _path, version in calls] == ["step-1b", "step-3"]
        assert [(a.version, a.outcome) for a in watcher.attempts] == [
            ("step-1b", "loaded"),
            ("step-2", "rejected"),
            ("step-3", "loaded"),
        ]

    asyncio.run(scenario())


def test_watcher_task_runs_until_stopped(exported: Path, tmp_path: Path) -> None:
    root = tmp_path / "exports"
    root.mkdir()
    calls: list[str] = []

    async def reload(path: Path, version: str) -> None:
        calls.append(version)

    def verify(path: Path) -> None:
        if (path / "BROKEN").exists():
            raise VerifyError("BROKEN: marker present")

    async def scenario() -> None:
        watcher = CheckpointWatcher(root, reload, interval=0.02, verify=verify)
        watcher.start()
        try:
            _copy_export(exported, root / "a", time.time() - 100)
            for _ in range(200):
                if calls:
                    break
                await asyncio.sleep(0.02)
            bad = _copy_export(exported, root / "b", time.time() - 50)
            (bad / "BROKEN").touch()
            os.utime(bad / SUMS_FILE)  # SHA256SUMS newest again
            for _ in range(200):
                if "b" in watcher.rejected:
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)  # several more passes
            assert calls == ["a"] and watcher.running
            assert [a.outcome for a in watcher.attempts] == ["loaded", "rejected"]
        finally:
            await watcher.stop()
        assert not watcher.running

    asyncio.run(scenario())
