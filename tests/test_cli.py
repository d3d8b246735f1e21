"""The command line: README commands exist, help is fast and complete, the demo is honest."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bcstack(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bcstack", *args], capture_output=True, text=True, cwd=ROOT)


def _readme_commands() -> list[list[str]]:
    """Every `bcstack <group> <command>` the README shows."""
    found = []
    for line in (ROOT / "README.md").read_text().splitlines():
        m = re.match(r"^bcstack ([a-z][a-z-]*)(?: ([a-z][a-z-]*))?", line.strip())
        if m:
            found.append([w for w in m.groups() if w])
    return found


def test_readme_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    head = text[: text.index("## ")]
    assert "make demo" in head and "make test" in head
    assert (ROOT / ".ci" / "run").read_text().strip().endswith("make test")


@pytest.mark.parametrize("command", _readme_commands(), ids=" ".join)
def test_every_readme_command_exists(command):
    result = _bcstack(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert "Usage" in result.stdout


def test_root_help_lists_the_groups_and_the_readme_lists_them_back():
    result = _bcstack("--help")
    assert result.returncode == 0
    groups = {c[0] for c in _readme_commands()}
    for group in groups:
        assert group in result.stdout
    assert groups >= {"toyworld", "model"}


def test_help_does_not_import_torch():
    code = "import sys; from bcstack.cli import app; assert 'torch' not in sys.modules, 'torch imported'"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_unknown_command_is_a_clear_error():
    result = _bcstack("frobnicate")
    assert result.returncode != 0 and "Traceback" not in result.stderr


def test_demo_help_says_what_it_does():
    # The demo itself (about 4 minutes) runs in `make demo`; its parts are tested in test_eval_stack.py.
    result = subprocess.run(
        [sys.executable, "-m", "bcstack.demo", "--help"], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0
    assert (
        "150 test" in result.stdout and "--sample-per-tier" in result.stdout and "tiny model" in result.stdout
    )
