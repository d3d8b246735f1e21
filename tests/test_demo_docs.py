"""The demo's output as the README and docs/demo.md show it is what `bcstack.demo` prints now: the
same stages, in the same order, with the same names (timings, counts and ports aside). The stage
texts are read from bcstack/demo.py's `_stage(...)` calls, f-strings as patterns."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def stage_patterns() -> list[re.Pattern[str]]:
    """One pattern per `_stage(...)` call of the demo, in source order."""
    tree = ast.parse((REPO / "bcstack" / "demo.py").read_text())
    patterns = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_stage":
            text = node.args[0]
            if isinstance(text, ast.Constant):
                parts = [re.escape(text.value)]
            else:
                assert isinstance(text, ast.JoinedStr)
                parts = [re.escape(v.value) if isinstance(v, ast.Constant) else ".+?" for v in text.values]
            patterns.append((node.lineno, re.compile("".join(parts))))
    return [p for _, p in sorted(patterns, key=lambda item: item[0])]


def shown_stages(path: Path) -> list[str]:
    """The `== ...` lines of the first fenced block of `path` that has them, timings dropped."""
    block: list[str] | None = None
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            if block is None:
                block = []
                continue
            stages = [re.sub(r"\s+\[\s*\d+ s\]$", "", b[3:]) for b in block if b.startswith("== ")]
            if stages:
                return stages
            block = None
        elif block is not None:
            block.append(line)
    return []


def shown_text() -> str:
    return (REPO / "docs" / "demo.md").read_text()


def test_docs_demo_shows_every_stage_as_the_demo_prints_it() -> None:
    patterns = stage_patterns()
    shown = shown_stages(REPO / "docs" / "demo.md")
    assert len(shown) == len(patterns) == 8, shown
    for line, pattern in zip(shown, patterns, strict=True):
        assert pattern.fullmatch(line), f"docs/demo.md shows `== {line}`; the demo prints {pattern.pattern}"
    # The swap in the middle of the expert's evaluation lost nothing, as the run shown printed it.
    assert re.search(r"episodes per endpoint: backup \d+, default \d+; failed episodes: 0\n", shown_text())


def test_the_readme_shows_the_same_stages() -> None:
    patterns = stage_patterns()
    shown = shown_stages(REPO / "README.md")
    assert len(shown) == len(patterns), shown
    for line, pattern in zip(shown, patterns, strict=True):
        # The README may cut a long stage line short with "; ...": the part it shows must match.
        head = line.split("; ...")[0]
        assert re.match(pattern.pattern.split(re.escape(";"))[0], head), (line, pattern.pattern)
