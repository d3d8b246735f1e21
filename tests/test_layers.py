"""The layers point one way: `lint-imports` keeps pyproject.toml's import-linter contracts, and a
forbidden arrow (here: a core module importing a service) is reported as broken."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    return subprocess.run(
        [exe, "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(cwd), "PATH": str(Path(sys.executable).parent)},
    )  # fmt: skip


def test_the_layer_contracts_are_kept() -> None:
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("where", "line", "contract"),
    [
        ("core/budget.py", "import services.judge.core", "Layers point one way"),
        ("services/worker/settings.py", "import services.judge.core", "Services talk through APIs"),
        ("core/atomic.py", "import torch", "The core never pulls in torch"),
    ],
)
def test_a_forbidden_arrow_breaks_a_contract(tmp_path: Path, where: str, line: str, contract: str) -> None:
    copy = tmp_path / "repo"
    copy.mkdir()
    shutil.copy(REPO / "pyproject.toml", copy)
    for package in ("core", "devkit", "services", "trainer", "bcstack"):
        shutil.copytree(REPO / package, copy / package, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / where
    target.write_text(target.read_text() + f"\n{line}  # a backward arrow\n")
    result = lint_imports(copy)
    assert result.returncode != 0
    broken = result.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken
