"""Crash-safe training checkpoints: a run killed at any instant resumes from its newest complete one.

Layout under a checkpoint root:

    root/step-00000002/   model.pt  optimizer.pt  [scheduler.pt]  rng.pt  trainer_state.json  COMPLETE
    root/.tmp-step-3-4711/   a save in progress (or torn by a crash) by process 4711

A save writes everything into `.tmp-step-N-<pid>`, fsyncs each file, writes `COMPLETE` (the file
list with sizes) last, fsyncs the folder, then renames it to `step-NNNNNNNN` and fsyncs the root.
A rename within one filesystem is atomic, so a `step-*` folder is either absent or whole; a crash
leaves at most a `.tmp-*` folder, which `latest_checkpoint` ignores and removes once its process
is gone. Old checkpoints are retired the same way (renamed to `.tmp-*`, then deleted), so a crash
while deleting never leaves a half-deleted `step-*` folder behind.

RNG states (python `random`, numpy's global generator, torch CPU and every CUDA device) are
saved and restored, so a resumed run draws the same data order and noise as an uninterrupted one.
The data cursor and `extra` go to `trainer_state.json` and must be JSON-serialisable.

Simplified: one process writes plain (non-DTensor) state dicts; a tensor-parallel run would save
per-rank shards with `torch.distributed.checkpoint` inside the same atomic-folder protocol.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

logger = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng.pt"
STATE_FILE = "trainer_state.json"
FORMAT_VERSION = 1
DEFAULT_KEEP_LAST = 3

_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_DIR = re.compile(r"^\.tmp-.*-(\d+)$")  # the last number is the writing process's pid


class CheckpointError(RuntimeError):
    """A checkpoint folder is not a complete checkpoint."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, write: Callable[[BinaryIO], None]) -> None:
    with path.open("wb") as handle:
        write(handle)
        handle.flush()
        os.fsync(handle.fileno())


def _save_torch(path: Path, obj: Any) -> None:
    _write_file(path, lambda handle: torch.save(obj, handle))


def _save_json(path: Path, obj: Any) -> None:
    data = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()
    _write_file(path, lambda handle: handle.write(data))


def _rng_state() -> dict[str, Any]:
    kind, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": random.getstate(),
        # as plain ints and a tensor, so the file loads with torch.load(weights_only=True)
        "numpy": {
            "kind": kind,
            "key": torch.from_numpy(key.astype(np.int64)),
            "pos": pos,
            "has_gauss": has_gauss,
            "gauss": gauss,
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    numpy = state["numpy"]
    key = numpy["key"].numpy().astype(np.uint32)
    np.random.set_state((numpy["kind"], key, numpy["pos"], numpy["has_gauss"], numpy["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            logger.warning("checkpoint has CUDA RNG states but CUDA is not available; not restored")


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def _is_complete(path: Path) -> bool:
    """COMPLETE is present and every file it lists is there with the size it recorded."""
    try:
        listed = json.loads((path / COMPLETE).read_text(encoding="utf-8"))["files"]
        return all((path / name).stat().st_size == size for name, size in listed.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    found = []
    for path in root.iterdir() if root.is_dir() else ():
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir() and _is_complete(path):
            found.append((int(match.group(1)), path))
    return sorted(found)


def _retire(path: Path) -> None:
    """Delete a folder so that a crash midway leaves only a `.tmp-*` folder, never a torn step."""
    doomed = path.with_name(f".tmp-delete-{path.name}-{os.getpid()}")
    path.rename(doomed)
    shutil.rmtree(doomed)


def save_checkpoint(
    root: str | Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None = None,
    data_cursor: dict[str, Any],
    extra: dict[str, Any] | None = None,
    keep_last: int | None = DEFAULT_KEEP_LAST,
) -> Path:
    """Write the training state after `step` atomically to `root/step-NNNNNNNN`; returns that folder.

    An existing checkpoint of the same step is replaced (only after the new one is whole). Then all
    but the newest `keep_last` complete checkpoints are deleted (`None` keeps all).
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be at least 1 (or None to keep all), not {keep_last}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    staging = root / f".tmp-step-{step}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        _save_torch(staging / MODEL_FILE, model.state_dict())
        _save_torch(staging / OPTIMIZER_FILE, optimizer.state_dict())
        if scheduler is not None:
            _save_torch(staging / SCHEDULER_FILE, scheduler.state_dict())
        _save_torch(staging / RNG_FILE, _rng_state())
        state = {"format": FORMAT_VERSION, "step": step, "data_cursor": data_cursor, "extra": extra or {}}
        _save_json(staging / STATE_FILE, state)
        files = {path.name: path.stat().st_size for path in sorted(staging.iterdir())}
        _save_json(staging / COMPLETE, {"step": step, "files": files})
        _fsync_dir(staging)
        replaced = final.with_name(f".tmp-delete-{final.name}-{os.getpid()}")
        if final.exists():
            final.rename(replaced)
        staging.rename(final)
        _fsync_dir(root)
        shutil.rmtree(replaced, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if keep_last is not None:
        for _, old in _complete_checkpoints(root)[:-keep_last]:
            _retire(old)
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None.

    Leftovers of crashed saves are skipped with a warning and removed: `.tmp-*` folders whose
    process is gone, and `step-*` folders without a `COMPLETE` marker. A `step-*` folder whose
    files disagree with its marker is skipped but kept for inspection.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    for path in sorted(root.iterdir()):
        if not path.is_dir():
            continue
        tmp = _TMP_DIR.match(path.name)
        if tmp and not _pid_alive(int(tmp.group(1))):
            logger.warning("removing %s, left by an interrupted checkpoint save", path)
            shutil.rmtree(path, ignore_errors=True)
        elif _STEP_DIR.match(path.name) and not _is_complete(path):
            if (path / COMPLETE).exists():
                logger.warning("ignoring %s: its files do not match its COMPLETE marker", path)
            else:
                logger.warning("removing %s, a checkpoint without a COMPLETE marker", path)
                shutil.rmtree(path, ignore_errors=True)
    complete = _complete_checkpoints(root)
    return complete[-1][1] if complete else None


def load_checkpoint(
    path: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None = None,
) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and RNG states from the checkpoint folder `path`.

    Returns `{"step", "data_cursor", "extra"}`: the step the checkpoint was taken after (resume at
    step + 1) and what `save_checkpoint` was given.
    """
    path = Path(path)
    if not _is_complete(path):
        raise CheckpointError(f"{path} is not a complete checkpoint")
    state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    if state.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: unknown checkpoint format {state.get('format')!r}")
    model.load_state_dict(torch.load(path / MODEL_FILE, map_location="cpu", weights_only=True))
    optimizer.load_state_dict(torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True))
    if scheduler is not None:
        if not (path / SCHEDULER_FILE).exists():
            raise CheckpointError(f"{path} holds no scheduler state")
        scheduler.load_state_dict(torch.load(path / SCHEDULER_FILE, map_location="cpu", weights_only=True))
    _set_rng_state(torch.load(path / RNG_FILE, weights_only=True))
    return {"step": state["step"], "data_cursor": state["data_cursor"], "extra": state["extra"]}
