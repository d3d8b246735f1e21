"""Files and folders written safely: whole or not at all (a temporary beside it, then a rename)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def swap_in(staging: Path, out_dir: Path) -> None:
    """Move the finished `staging` folder to `out_dir`, replacing what is there.

    An existing `out_dir` is renamed aside first and removed only after the new one is in place,
    so at no moment does `out_dir` hold a half-written folder.
    """
    if out_dir.exists():
        retired = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        out_dir.rename(retired)
        staging.rename(out_dir)
        shutil.rmtree(retired)
    else:
        staging.rename(out_dir)


def atomic_write_text(path: Path, text: str) -> None:
    """Write `path` whole or not at all: a temporary file beside it, fsynced, then renamed over it."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with temporary.open("w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
