"""Watch a folder of exports and hot-reload the newest complete one (DESIGN.md §5 and §8).

An export writes SHA256SUMS last (the serving format, core/checkpoint.py), so a sub-folder counts as
complete only when SHA256SUMS is there and no other file in it is newer; a complete one must also pass
`verify_checkpoint` before `reload(path, version)` is called, with the folder name as the version.
Hidden folders (an export's `.NAME.partial-PID` staging folder) are never looked at.

Remembered per folder, keyed by a fingerprint of its files (relative path, size, mtime): the one
loaded and the ones rejected (verification failed or `reload` raised). A rejected folder is not tried
again until its files change; the watcher never goes back to a folder older than the loaded one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.checkpoint import SUMS_FILE, verify_checkpoint

log = logging.getLogger(__name__)

Fingerprint = tuple[tuple[str, int, int], ...]


@dataclass(frozen=True)
class ExportFolder:
    path: Path
    completed_ns: int  # SHA256SUMS mtime: when the export finished
    fingerprint: Fingerprint


@dataclass
class WatchAttempt:
    version: str
    path: str
    outcome: str  # "loaded" | "rejected" | "reload_failed"
    error: str | None
    at: float  # time.time()


def complete_export(folder: Path) -> ExportFolder | None:
    """`folder` as an ExportFolder when its SHA256SUMS exists and is not older than any other
    (non-hidden) file in it; None while the export is still being written."""
    sums = folder / SUMS_FILE
    try:
        sums_stat = sums.stat()
    except OSError:
        return None
    entries: list[tuple[str, int, int]] = []
    for path in folder.rglob("*"):
        relative = path.relative_to(folder)
        if any(part.startswith(".") for part in relative.parts):
            continue
        try:
            stat = path.stat()
        except OSError:  # removed while we looked: not settled
            return None
        if not path.is_file():
            continue
        if stat.st_mtime_ns > sums_stat.st_mtime_ns:
            return None
        entries.append((relative.as_posix(), stat.st_size, stat.st_mtime_ns))
    return ExportFolder(folder, sums_stat.st_mtime_ns, tuple(sorted(entries)))


def complete_exports(directory: Path) -> list[ExportFolder]:
    """The complete exports directly under `directory`, newest (by SHA256SUMS mtime) first."""
    try:
        children = [
            child for child in directory.iterdir() if child.is_dir() and not child.name.startswith(".")
        ]
    except OSError:
        return []
    found = [export for export in map(complete_export, children) if export is not None]
    return sorted(found, key=lambda export: (export.completed_ns, export.path.name), reverse=True)


class CheckpointWatcher:
    """Every `interval` seconds, reload the newest complete, verified export under `directory` that is
    newer than the one loaded. `current` names the version already served (not reloaded again)."""

    def __init__(
        self,
        directory: Path,
        reload: Callable[[Path, str], Awaitable[Any]],
        *,
        interval: float = 5.0,
        verify: Callable[[Path], Any] = verify_checkpoint,
        current: str | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.interval = interval
        self._reload = reload
        self._verify = verify
        self.loaded: str | None = current
        self._loaded_fingerprint: Fingerprint | None = None
        self._loaded_completed_ns: int | None = None
        self.rejected: dict[str, tuple[Fingerprint, str]] = {}  # folder name -> (fingerprint, error)
        self.attempts: list[WatchAttempt] = []
        self._task: asyncio.Task[None] | None = None

    def _record(self, export: ExportFolder, outcome: str, error: str | None) -> None:
        self.attempts.append(WatchAttempt(export.path.name, str(export.path), outcome, error, time.time()))

    def _is_loaded(self, export: ExportFolder) -> bool:
        if export.path.name != self.loaded:
            return False
        return self._loaded_fingerprint is None or self._loaded_fingerprint == export.fingerprint

    async def scan_once(self) -> str | None:
        """One pass: returns the version reloaded, or None when nothing new was loaded."""
        exports = await asyncio.to_thread(complete_exports, self.directory)
        for export in exports:
            if self._is_loaded(export):
                return None  # everything after this is older than what serves now
            if self._loaded_completed_ns is not None and export.completed_ns < self._loaded_completed_ns:
                return None
            name = export.path.name
            previous = self.rejected.get(name)
            if previous is not None and previous[0] == export.fingerprint:
                continue
            try:
                await asyncio.to_thread(self._verify, export.path)
            except Exception as e:  # verify's VerifyError, or an unreadable file
                self._reject(export, "rejected", f"{type(e).__name__}: {e}")
                continue
            try:
                await self._reload(export.path, name)
            except Exception as e:
                self._reject(export, "reload_failed", f"{type(e).__name__}: {e}")
                continue
            self.loaded = name
            self._loaded_fingerprint = export.fingerprint
            self._loaded_completed_ns = export.completed_ns
            self.rejected.pop(name, None)
            self._record(export, "loaded", None)
            log.info("checkpoint watcher: loaded %s", export.path)
            return name
        return None

    def _reject(self, export: ExportFolder, outcome: str, error: str) -> None:
        self.rejected[export.path.name] = (export.fingerprint, error)
        self._record(export, outcome, error)
        log.warning("checkpoint watcher: %s %s: %s", outcome, export.path, error)

    async def _run(self) -> None:
        while True:
            try:
                await self.scan_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad pass must not end the watcher
                log.exception("checkpoint watcher: scan of %s failed", self.directory)
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        """Start scanning on the running event loop (idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="checkpoint-watcher")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()
