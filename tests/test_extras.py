"""The per-service extras (issue 17): `pip install 'browsecomp-stack[X]'` into a fresh virtual
environment gives a working service and nothing heavy it does not use.

The light images' extras are checked here: the coordinator gateway and its stand-in LLM
(`[coordinator]`), the judge (`[judge]`), the worker sidecar (`[worker]`). pip resolves them from
the package's wheel as for an empty environment, in one run (`pip install --dry-run
--ignore-installed --report 'WHEEL[coordinator,judge,worker]'`; its resolver is ~13 s of CPU a run),
and each extra's distributions are read from that report by following its requirements (their
extras and markers too; `closure`): they must hold no torch, Locust or matplotlib
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
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import LOOPBACK, find_free_port, wait_until
from packaging.requirements import Requirement

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


def resolve(wheel: Path, extras: list[str], where: Path) -> dict[str, Any]:
    """pip's report of `pip install 'browsecomp-stack[EXTRAS]'` into an empty environment (pip's
    own resolver, `--dry-run --ignore-installed --report`): the distributions and their metadata."""
    report = where / "report.json"
    done = subprocess.run(
        [
            sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q",
            "--disable-pip-version-check", "-c", str(REPO / "constraints.txt"),
            "--report", str(report), f"{wheel}[{','.join(extras)}]",
        ],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(report.read_text())


def closure(report: dict[str, Any], root: str, extras: set[str]) -> set[str]:
    """The distributions `root[extras]` needs among those of a pip report, normalised names: its
    requirements and theirs, each with the extras asked of it, markers evaluated in the report's
    environment (the extra's own `pip install` resolution, read from one of several extras)."""
    metadata = {canonical(d["metadata"]["name"]): d["metadata"] for d in report["install"]}
    environment = report["environment"]
    needed: dict[str, set[str]] = {}  # distribution -> the extras asked of it so far
    todo = [(canonical(root), set(extras))]
    while todo:
        name, asked = todo.pop()
        first = name not in needed
        fresh = asked - needed.get(name, set())
        if not first and not fresh:
            continue
        needed.setdefault(name, set()).update(asked)
        evaluate = ([""] if first else []) + sorted(fresh)  # its own requirements once, then each extra's
        for line in metadata[name].get("requires_dist") or []:
            requirement = Requirement(line)
            marker = requirement.marker
            if (marker is None and first) or (
                marker is not None and any(marker.evaluate({**environment, "extra": e}) for e in evaluate)
            ):
                todo.append((canonical(requirement.name), set(requirement.extras)))
    return set(needed)


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
    """Each extra's distributions, from one pip resolution of all of them (pip's resolver is ~13 s
    of CPU a run here, and three runs, one per extra, gave the same sets)."""
    root = tmp_path_factory.mktemp("extras")
    wheel = build_wheel(root / "wheel")
    report = resolve(wheel, list(EXTRAS), root)
    return {extra: closure(report, "browsecomp-stack", {extra}) for extra in EXTRAS}


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


def test_an_extras_closure_follows_requirements_their_extras_and_markers():
    def dist(name: str, *requires: str) -> dict[str, Any]:
        return {"metadata": {"name": name, "version": "1", "requires_dist": list(requires)}}

    report = {
        "environment": {"sys_platform": "linux", "python_version": "3.11"},
        "install": [
            dist("Root_Pkg", "base-dep", "web[fast] ; extra == 'serve'", "heavy ; extra == 'train'"),
            dist("base-dep", "win-only ; sys_platform == 'win32'"),
            dist("web", "h11", "uvloop ; extra == 'fast' and sys_platform == 'linux'"),
            *(dist(name) for name in ("h11", "uvloop", "heavy", "win-only")),
        ],
    }
    assert closure(report, "root-pkg", set()) == {"root-pkg", "base-dep"}
    assert closure(report, "root-pkg", {"serve"}) == {"root-pkg", "base-dep", "web", "h11", "uvloop"}
    assert closure(report, "root-pkg", {"serve", "train"}) == {
        "root-pkg",
        "base-dep",
        "web",
        "h11",
        "uvloop",
        "heavy",
    }


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
