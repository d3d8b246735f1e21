"""The docs: the README read in five minutes, the MkDocs site built strictly, no change-log prose.

`mkdocs build --strict` fails on a link to a missing page or anchor, on a page left out of the nav,
and on a broken image: so a page moved or renamed without its links fails here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(REPO / "mkdocs.yml"),
            "-d",
            str(tmp_path / "site"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    site = tmp_path / "site"
    for page in (
        "index.html",
        "glossary/index.html",
        "operating/index.html",
        "tutorials/00-laptop/index.html",
    ):
        assert (site / page).is_file(), page
    assert (site / "bench" / "results" / "speedrun.png").is_file()  # the hook's benchmark plots
    operating = (site / "operating" / "index.html").read_text()
    assert 'id="bcstacktargetdown"' in operating  # the anchor every alert's runbook_url ends with


def test_the_readme_is_short_and_starts_with_the_two_commands() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; at most 250 (the rest goes to docs/)"
    head = "\n".join(lines[: next(i for i, line in enumerate(lines) if line.startswith("## "))])
    assert "make demo" in head and "make test" in head and "Prerequisites" in head


def test_every_readme_link_resolves() -> None:
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text()):
        if not target.startswith(("http://", "https://")):
            assert (REPO / target).exists(), f"README links to {target}, which does not exist"


def test_no_change_log_prose_in_the_docs() -> None:
    pattern = re.compile(r"this session|this wave|\(issue \d+\)|\bissue #?\d+\b|predates", re.I)
    for path in [README, *sorted((REPO / "docs").rglob("*.md"))]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert not pattern.search(line), (
                f"{path.relative_to(REPO)}:{number}: change-log prose: {line.strip()}"
            )


def test_the_glossary_explains_the_seeds_terms() -> None:
    glossary = (REPO / "docs" / "glossary.md").read_text()
    for term in ("Seed 000", "FoldAgent", "MOPD", "TIS", "k3 KL", "GRPO", "Wilson", "McNemar", "RRF", "LoRA"):
        assert f"**{term}" in glossary, term
