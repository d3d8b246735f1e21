"""`make install`: a virtual environment of its own, made by a Python 3.11 or newer, that every
Makefile target runs in (so Debian's externally managed Python is never pip's target)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _make_n(target: str, *overrides: str) -> str:
    """What `make TARGET` would run, printed, nothing run (its install stamps taken as done)."""
    venv = next((o.split("=", 1)[1] for o in overrides if o.startswith("VENV=")), ".venv")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    run = subprocess.run(
        [
            "make",
            "--no-print-directory",
            "-n",
            "-o",
            f"{venv}/.installed-demo",
            "-o",
            f"{venv}/.installed-test",
            target,
            *overrides,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_every_target_runs_the_environments_python():
    for target in ("demo", "test", "lint", "docs", "proto", "speedrun"):
        lines = [line for line in _make_n(target).splitlines() if "python" in line]
        runs = [re.search(r"(^|\s)(\S*python)\s", line) for line in lines]
        assert lines and all(m and m.group(2) == ".venv/bin/python" for m in runs), (target, lines)
    assert _make_n("demo", "VENV=/opt/env").strip() == "/opt/env/bin/python -m bcstack.demo"


def test_the_demo_installs_no_debian_package_and_the_tests_do():
    """`make demo` needs no browser, database or Prometheus; `make test` installs what its tests run."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    make = ["make", "--no-print-directory", "-n", "-B"]
    demo = subprocess.run([*make, "install"], capture_output=True, text=True, cwd=ROOT, env=env)
    test = subprocess.run([*make, "install-test"], capture_output=True, text=True, cwd=ROOT, env=env)
    assert "scripts/install.sh demo" in demo.stdout and "install.sh test" not in demo.stdout
    assert "scripts/install.sh test" in test.stdout
    script = (ROOT / "scripts" / "install.sh").read_text()
    apt_calls = [line.strip() for line in script.splitlines() if "apt_install " in line.strip()[:60]]
    # The venv package where the base Python lacks venv's bootstrap, and the tests' packages under
    # `test`, started beside the Python packages before them and waited for before the install is done.
    assert apt_calls[0].startswith('apt_install "python$(') and len(apt_calls) == 2
    tests_apt = 'if [ "$FOR" = test ]; then\n  beside "Debian packages for the tests" apt_install '
    assert script.index(tests_apt) < script.index("want_pip=") < script.index('"${PIP[@]}" "torch==')
    assert script.index("\nwait_beside ||") < script.index('echo "install: done')


def _install(tmp_path: Path, base: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "BASE_PYTHON": base, "VENV": str(tmp_path / "venv")}
    return subprocess.run(
        ["bash", "scripts/install.sh", *args], capture_output=True, text=True, cwd=ROOT, env=env
    )


def test_a_python_older_than_3_11_is_refused_in_one_line_before_anything_is_made(tmp_path: Path):
    old = tmp_path / "python3.10"
    old.write_text('#!/bin/sh\n[ "$1" = -V ] && echo "Python 3.10.12" && exit 0\nexit 1\n')
    old.chmod(0o755)
    result = _install(tmp_path, str(old), "demo")
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"install: {old} is Python 3.10.12; this project needs Python 3.11 or newer (set BASE_PYTHON)"
    ]
    assert not (tmp_path / "venv").exists()
    missing = _install(tmp_path, "no-such-python3", "demo")
    assert missing.returncode == 1 and missing.stderr.splitlines() == [
        "install: no no-such-python3 on PATH; install Python 3.11 or newer (or set BASE_PYTHON)"
    ]
    usage = _install(tmp_path, "python3", "everything")
    assert usage.returncode == 2 and usage.stderr.strip() == "usage: scripts/install.sh [demo|test]"
