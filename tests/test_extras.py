"""The per-service extras (issue 17): `pip install 'browsecomp-stack[X]'` into a fresh virtual
environment gives a working service and nothing heavy it does not use.

The light images' extras are checked here: the coordinator gateway and its stand-in LLM
(`[coordinator]`), the judge (`[judge]`), the worker sidecar (`[worker]`). pip resolves each from
the package's wheel as for an empty environment (`pip install --dry-run --ignore-installed
--report`): the distributions it would install must hold no torch, Locust or matplotlib
(transformers only where the sidecar needs its tokenizer). Each service must then import and serve
(`/health` answers) with only those distributions importable: a `sitecustomize` blocker makes
every other installed distribution's modules raise ModuleNotFoundError, as they would in the
fresh venv. Real venvs took 74 s of this module (three installs); a real install of every extra,
heavy ones included, is `python scripts/extras_sizes.py`, which writes the size table the README
quotes.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import LOOPBACK, find_free_port, wait_until

REPO = Path(__file__).resolve().parents[1]
HEAVY = {"torch", "locust", "matplotlib", "scipy", "sentence-transformers", "onnxruntime", "tensorboard"}

# extra -> (distributions it must not carry, the services to import and start)
EXTRAS = {
    "coordinator": (HEAVY | {"transformers"}, ["coordinator-llm", "coordinator"]),
    "judge": (HEAVY | {"transformers"}, ["judge"]),
    "worker": (HEAVY, ["worker"]),
}
MODULES = {
    "coordinator": "services.coordinator.service",
    "coordinator-llm": "services.coordinator_llm.service",
    "judge": "services.judge.service",
    "worker": "services.worker.service",
}


PACKAGES = ("core", "devkit", "bcstack", "services", "trainer")


def build_wheel(where: Path) -> Path:
    """The package as a wheel, built from a copy of the sources (a build in the checkout would leave
    build/ there, and parallel builds from one tree collide)."""
    src = where / "src"
    src.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for package in PACKAGES:
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--disable-pip-version-check",
            "-w",
            str(where),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = where.glob("browsecomp_stack-*.whl")
    return wheel


def resolve(wheel: Path, extra: str, where: Path) -> set[str]:
    """The distributions `pip install 'browsecomp-stack[extra]'` would install into an empty
    environment (pip's own resolver, `--dry-run --ignore-installed --report`), normalised names."""
    report = where / f"{extra}.json"
    done = subprocess.run(
        [
            sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q",
            "--disable-pip-version-check", "-c", str(REPO / "constraints.txt"),
            "--report", str(report), f"{wheel}[{extra}]",
        ],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return {canonical(d["metadata"]["name"]) for d in json.loads(report.read_text())["install"]}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def blocker(allowed: set[str], where: Path) -> Path:
    """A folder whose `sitecustomize.py` makes every module of a distribution installed here but not
    in `allowed` unimportable (ModuleNotFoundError, as in an environment without it): this checkout's
    environment then behaves, for imports, like a fresh one holding just the extra's distributions."""
    blocked = sorted(
        module
        for module, dists in importlib.metadata.packages_distributions().items()
        if not {canonical(d) for d in dists} & allowed and not module.startswith("_")
    )
    folder = where / "blocker"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(
        "import importlib.abc, sys\n"
        f"BLOCKED = frozenset({blocked!r})\n"
        "class _NotInstalled(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.partition('.')[0] in BLOCKED:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r} (not in the extra)', name=name)\n"
        "sys.meta_path.insert(0, _NotInstalled())\n"
    )
    return folder


@pytest.fixture(scope="module")
def resolved(tmp_path_factory) -> dict[str, set[str]]:
    """pip's resolution of each extra, side by side (pip waits on the index as much as on the CPU)."""
    root = tmp_path_factory.mktemp("extras")
    wheel = build_wheel(root / "wheel")
    with ThreadPoolExecutor(len(EXTRAS)) as pool:
        futures = {extra: pool.submit(resolve, wheel, extra, root) for extra in EXTRAS}
        return {extra: future.result() for extra, future in futures.items()}


def test_the_blocker_hides_what_an_extra_does_not_install(tmp_path):
    """The stand-in for a fresh venv is only as good as its blocking: a module outside the allowed
    distributions fails to import, one inside imports."""
    folder = blocker({"httpx", "httpcore", "anyio", "idna", "certifi", "h11", "sniffio"}, tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(REPO)])}
    probe = "import httpx\ntry:\n    import yaml\nexcept ImportError as e:\n    print('blocked', e.name)"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert done.returncode == 0 and done.stdout.strip() == "blocked yaml", done.stderr


@pytest.mark.parametrize("extra", list(EXTRAS))
def test_an_extra_installs_alone_and_its_services_serve(extra, resolved, tmp_path):
    forbidden, services = EXTRAS[extra]
    dists = resolved[extra]
    assert "browsecomp-stack" in dists
    assert not dists & forbidden, f"[{extra}] pulls in {sorted(dists & forbidden)}"
    print(f"[{extra}]: {len(dists)} distributions")
    # Every service of the extra imports and serves with only those distributions importable.
    env = {k: v for k, v in os.environ.items() if not k.startswith("BCSTACK_")}
    env["PYTHONPATH"] = os.pathsep.join([str(blocker(dists, tmp_path)), str(REPO)])
    bcstack = [sys.executable, "-m", "bcstack"]
    for service in services:
        python = [sys.executable, "-c", f"import {MODULES[service]}"]
        imported = subprocess.run(python, capture_output=True, text=True, cwd=tmp_path, env=env)
        assert imported.returncode == 0, imported.stderr
        if service == "worker":  # needs an engine and a tokenizer to be healthy; its CLI must load
            worker_help = [*bcstack, "serve", "worker", "--help"]
            helped = subprocess.run(worker_help, capture_output=True, text=True, cwd=tmp_path, env=env)
            assert helped.returncode == 0 and "--engine-url" in helped.stdout, helped.stderr
            continue
        port = find_free_port()
        args = [*bcstack, "serve", service, "--host", LOOPBACK, "--port", str(port)]
        if service != "coordinator-llm":
            args += ["--grpc-port", str(find_free_port())]
        if service == "coordinator":
            args += [
                "--coordinator-url",
                f"http://{LOOPBACK}:{find_free_port()}/v1",
                "--records",
                str(tmp_path / "r.sqlite"),
            ]
        proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path, env=env
        )
        health = f"http://{LOOPBACK}:{port}/health"
        try:
            wait_until(
                lambda url=health: httpx.get(url, timeout=2).status_code == 200,
                timeout=60,
                message=f"{service} healthy with only [{extra}]'s distributions",
            )
        finally:
            proc.terminate()
            out = proc.communicate(timeout=20)[0]
        assert "Traceback" not in out, out
