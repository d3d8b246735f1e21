"""Crash-safe, sharded, reshardable training checkpoints: a run killed at any instant resumes from its
newest complete one, at the layout it was saved at or any other.

Layout under a checkpoint root:

    root/step-00000002/   state/ (.metadata, __0_0.distcp, ...)  [scheduler.pt]  rng.pt
                          trainer_state.json  COMPLETE
    root/.tmp-step-3-4711/   a save in progress (or torn by a crash) by process 4711

Model and optimizer state go through `torch.distributed.checkpoint` (DCP), as torchtitan's
checkpointer does: `get_state_dict` gives each rank its shards keyed by parameter name (DTensors
for a TP or FSDP model, plain tensors for one process), every rank writes its own `.distcp` file,
and the metadata records each tensor's global shape and which slices each file holds. Loading
reads whatever slices the *current* layout needs, so the layout may change between save and resume.
One process needs no process group (DCP then runs single-rank). Every rank writes into the same
folder: on a cluster the checkpoint root must be shared storage (the chart mounts one volume).

A save writes everything into `.tmp-step-N-<pid>` (rank 0's pid), fsyncs each file (DCP's writer
does for its own), writes `COMPLETE` (every file under the folder with its size) last, fsyncs the
folder, then renames it to `step-NNNNNNNN` and fsyncs the root. A rename within one filesystem is
atomic, so a `step-*` folder is either absent or whole; a crash leaves at most a `.tmp-*` folder,
which `latest_checkpoint` ignores and removes once its process is gone. Old checkpoints are retired
the same way (renamed to `.tmp-*`, then deleted), so a crash while deleting never leaves a
half-deleted `step-*` folder behind.

RNG states (python `random`, numpy's global generator, torch CPU and every CUDA device) of rank 0
are saved and restored on every rank, so a resumed run draws the same data order and noise as an
uninterrupted one. The data cursor, the saving layout and `extra` go to `trainer_state.json`
(JSON-serialisable).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from trainer.distributed import Layout

logger = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
STATE_DIR = "state"  # model and optimizer state, DCP (format 2)
MODEL_FILE = "model.pt"  # format 1 only
OPTIMIZER_FILE = "optimizer.pt"  # format 1 only
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng.pt"
STATE_FILE = "trainer_state.json"
FORMAT_VERSION = 2
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


@contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every save and load outside a process group that it assumes one process: it does."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable")
        yield


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
    layout: Layout | None = None,
) -> Path:
    """Write the training state after `step` atomically to `root/step-NNNNNNNN`; returns that folder.

    Every rank of `layout` calls it: each writes its own shards of the model and optimizer state
    into the staging folder (DCP), rank 0 writes the rest and renames the folder into place. An
    existing checkpoint of the same step is replaced (only after the new one is whole). Then all
    but the newest `keep_last` complete checkpoints are deleted (`None` keeps all).
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be at least 1 (or None to keep all), not {keep_last}")
    layout = layout or Layout.single()
    root = Path(root)
    final = root / step_dir_name(step)
    # One staging folder for the whole job, named after rank 0's pid (a crashed save is recognised by it).
    staging = root / layout.broadcast(f".tmp-step-{step}-{os.getpid()}")
    if layout.is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
    layout.barrier()
    try:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        # FileSystemWriter fsyncs every file it writes (sync_files=True).
        with _single_process_quiet():
            dcp.save(
                {"model": model_state, "optimizer": optimizer_state},
                checkpoint_id=staging / STATE_DIR,
                no_dist=not dist.is_initialized(),
            )
        layout.barrier()
        if layout.is_main:
            if scheduler is not None:
                _save_torch(staging / SCHEDULER_FILE, scheduler.state_dict())
            _save_torch(staging / RNG_FILE, _rng_state())
            state = {
                "format": FORMAT_VERSION,
                "step": step,
                "layout": {"dp": layout.dp, "tp": layout.tp},
                "data_cursor": data_cursor,
                "extra": extra or {},
            }
            _save_json(staging / STATE_FILE, state)
            files = {
                str(path.relative_to(staging)): path.stat().st_size
                for path in sorted(staging.rglob("*"))
                if path.is_file()
            }
            _save_json(staging / COMPLETE, {"step": step, "files": files})
            _fsync_dir(staging / STATE_DIR)
            _fsync_dir(staging)
            replaced = final.with_name(f".tmp-delete-{final.name}-{os.getpid()}")
            if final.exists():
                final.rename(replaced)
            staging.rename(final)
            _fsync_dir(root)
            shutil.rmtree(replaced, ignore_errors=True)
    finally:
        if layout.is_main:
            shutil.rmtree(staging, ignore_errors=True)
    if layout.is_main and keep_last is not None:
        for _, old in _complete_checkpoints(root)[:-keep_last]:
            _retire(old)
    layout.barrier()
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
    layout: Layout | None = None,
) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and RNG states from the checkpoint folder `path`.

    `model` and `optimizer` may be sharded for any layout, whatever layout saved the checkpoint:
    DCP reads each rank's slices from the saved shards (`[dp=1, tp=2]` resumes at `[dp=2, tp=1]` or
    in one process). Every rank calls it. Returns `{"step", "layout", "data_cursor", "extra"}`: the
    step the checkpoint was taken after (resume at step + 1), the layout that saved it and what
    `save_checkpoint` was given. Checkpoints of format 1 (one process, `model.pt`) still load.
    """
    path = Path(path)
    if not _is_complete(path):
        raise CheckpointError(f"{path} is not a complete checkpoint")
    state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    if state.get("format") == 1:
        model.load_state_dict(torch.load(path / MODEL_FILE, map_location="cpu", weights_only=True))
        optimizer.load_state_dict(torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True))
    elif state.get("format") == FORMAT_VERSION:
        # The current layout's (sharded, empty-optimizer-initialised) state dicts, filled in place.
        model_state, optimizer_state = get_state_dict(model, optimizer)
        saved = {"model": model_state, "optimizer": optimizer_state}
        with _single_process_quiet():
            dcp.load(saved, checkpoint_id=path / STATE_DIR, no_dist=not dist.is_initialized())
        set_state_dict(model, optimizer, model_state_dict=saved["model"], optim_state_dict=saved["optimizer"])
    else:
        raise CheckpointError(f"{path}: unknown checkpoint format {state.get('format')!r}")
    if scheduler is not None:
        if not (path / SCHEDULER_FILE).exists():
            raise CheckpointError(f"{path} holds no scheduler state")
        scheduler.load_state_dict(torch.load(path / SCHEDULER_FILE, map_location="cpu", weights_only=True))
    # Rank 0's RNG states on every rank: every rank draws the same data order, as one process does.
    _set_rng_state(torch.load(path / RNG_FILE, weights_only=True))
    return {
        "step": state["step"],
        "layout": state.get("layout", {"dp": 1, "tp": 1}),
        "data_cursor": state["data_cursor"],
        "extra": state["extra"],
    }


def load_model_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The model's full (unsharded) tensors saved in checkpoint `path`, read in this one process,
    whatever layout saved them: for comparing runs and for tools, not for resuming."""
    path = Path(path)
    if not _is_complete(path):
        raise CheckpointError(f"{path} is not a complete checkpoint")
    if json.loads((path / STATE_FILE).read_text(encoding="utf-8")).get("format") == 1:
        return torch.load(path / MODEL_FILE, map_location="cpu", weights_only=True)
    metadata = dcp.FileSystemReader(path / STATE_DIR).read_metadata().state_dict_metadata
    prefix = "model."
    tensors = {
        key[len(prefix) :]: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    with _single_process_quiet():
        dcp.load({"model": tensors}, checkpoint_id=path / STATE_DIR, no_dist=True)
    return tensors
