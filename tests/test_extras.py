"""The per-service extras (issue 17): `pip install 'browsecomp-stack[X]'` into a fresh virtual
environment gives a working service and nothing heavy it does not use.

The light images are installed here, each in its own venv: the coordinator gateway and its stand-in
LLM (`[coordinator]`), the judge (`[judge]`), the worker sidecar (`[worker]`). Each must import and
serve (`/health` answers) with no torch, Locust or matplotlib installed (transformers only where
the sidecar needs its tokenizer). The heavy extras (retrieval, engine, trainer: torch) take minutes
to install; scripts/extras_sizes.py installs every extra the same way and writes the size table
the README quotes.
"""

from __future__ import annotations

import os
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


def venv_with(wheel: Path, extra: str, where: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, timeout=120)
    # --no-compile: no .pyc at install time (a third of the time here; Python writes them on import)
    pip = [
        str(where / "bin" / "python"),
        "-m",
        "pip",
        "install",
        "-q",
        "--disable-pip-version-check",
        "--no-compile",
    ]
    done = subprocess.run(
        [*pip, "-c", str(REPO / "constraints.txt"), f"{wheel}[{extra}]"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PIP_ROOT_USER_ACTION": "ignore"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return where / "bin"


def installed(bin_dir: Path) -> set[str]:
    names = "import importlib.metadata as m; print(' '.join(d.metadata['Name'] for d in m.distributions()))"
    listing = subprocess.run(
        [str(bin_dir / "python"), "-c", names], capture_output=True, text=True, check=True
    )
    return {name.lower().replace("_", "-") for name in listing.stdout.split()}


def size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()) / 1e6


@pytest.fixture(scope="module")
def venvs(tmp_path_factory) -> dict[str, Path]:
    """One fresh venv per extra, installed side by side (pip waits on downloads as much as on the CPU)."""
    root = tmp_path_factory.mktemp("extras")
    wheel = build_wheel(root / "wheel")
    with ThreadPoolExecutor(len(EXTRAS)) as pool:
        built = {extra: pool.submit(venv_with, wheel, extra, root / extra) for extra in EXTRAS}
        return {extra: future.result() for extra, future in built.items()}


@pytest.mark.parametrize("extra", list(EXTRAS))
def test_an_extra_installs_alone_and_its_services_serve(extra, venvs, tmp_path):
    forbidden, services = EXTRAS[extra]
    bin_dir = venvs[extra]
    dists = installed(bin_dir)
    assert "browsecomp-stack" in dists
    assert not dists & forbidden, f"[{extra}] pulls in {sorted(dists & forbidden)}"
    print(f"[{extra}]: {len(dists)} distributions, {size_mb(bin_dir.parent):.0f} MB")
    for service in services:
        python = [str(bin_dir / "python"), "-c", f"import {MODULES[service]}"]
        # run from tmp_path, so the import finds the installed package, not this checkout
        imported = subprocess.run(python, capture_output=True, text=True, cwd=tmp_path)
        assert imported.returncode == 0, imported.stderr
        if service == "worker":  # needs an engine and a tokenizer to be healthy; its CLI must load
            worker_help = [str(bin_dir / "bcstack"), "serve", "worker", "--help"]
            helped = subprocess.run(worker_help, capture_output=True, text=True, cwd=tmp_path)
            assert helped.returncode == 0 and "--engine-url" in helped.stdout, helped.stderr
            continue
        port = find_free_port()
        args = [str(bin_dir / "bcstack"), "serve", service, "--host", LOOPBACK, "--port", str(port)]
        if service != "coordinator-llm":
            args += ["--grpc-port", str(find_free_port())]
        if service == "coordinator":
            args += [
                "--coordinator-url",
                f"http://{LOOPBACK}:{find_free_port()}/v1",
                "--records",
                str(tmp_path / "r.sqlite"),
            ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("BCSTACK_")}
        proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path, env=env
        )
        health = f"http://{LOOPBACK}:{port}/health"
        try:
            wait_until(
                lambda url=health: httpx.get(url, timeout=2).status_code == 200,
                timeout=60,
                message=f"{service} healthy from the [{extra}] install",
            )
        finally:
            proc.terminate()
            out = proc.communicate(timeout=20)[0]
        assert "Traceback" not in out, out
