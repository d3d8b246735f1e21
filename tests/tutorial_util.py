"""The commands of docs/tutorials/*.md, for the tests that check and run them.

A tutorial's shell commands are its ```bash blocks; a block opened with ```bash tested is one a test
runs (tutorials 00 and 01, the ones a CPU can run). Lines continued with a backslash are joined.

    commands("00-laptop.md", tested=True)    # [["bcstack", "smoke", "--state", ".bcstack"], ...]
    localized(argv, {".bcstack": str(state)})  # arguments equal to a key replaced
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

TUTORIALS = Path(__file__).resolve().parent.parent / "docs" / "tutorials"
_BLOCK = re.compile(r"^```bash(?P<tested>[ \t]+tested)?[ \t]*\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)


def tutorial_files() -> list[Path]:
    return sorted(TUTORIALS.glob("[0-9][0-9]-*.md"))


def shell_lines(path: Path, *, tested: bool | None = None) -> list[str]:
    """The logical lines (backslash continuations joined) of `path`'s bash blocks; `tested` True:
    only the blocks marked tested, False: only the others, None: all."""
    lines: list[str] = []
    for block in _BLOCK.finditer(path.read_text()):
        if tested is not None and bool(block["tested"]) != tested:
            continue
        body = re.sub(r"\\\n\s*", " ", block["body"])
        lines += [
            line.strip() for line in body.splitlines() if line.strip() and not line.lstrip().startswith("#")
        ]
    return lines


def commands(name: str | Path, program: str = "bcstack", *, tested: bool | None = None) -> list[list[str]]:
    """argv of every line of the tutorial that runs `program` (after any VAR=value prefix; a
    trailing `&` or `# comment` dropped)."""
    path = name if isinstance(name, Path) else TUTORIALS / name
    out = []
    for line in shell_lines(path, tested=tested):
        argv = shlex.split(line, comments=True)
        while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):
            argv = argv[1:]
        if argv and argv[-1] == "&":
            argv = argv[:-1]
        if argv and argv[0] == program:
            out.append(argv)
    return out


def localized(argv: list[str], replacements: dict[str, str]) -> list[str]:
    """`argv` with each argument that is a key of `replacements` replaced by its value."""
    return [replacements.get(arg, arg) for arg in argv]
