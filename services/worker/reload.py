"""Hot reload of the engine's weights through the worker: `POST /admin/reload {"checkpoint": PATH}`.

One reload, in order:

1. resolve PATH inside `checkpoint_root` (symlinks resolved; anything outside is refused, 400);
2. verify it as a serving-format export (`core.checkpoint.verify_checkpoint`) against the config of
   the model the engine serves now (its `model_path` from /model_info), 422 on the first problem;
3. `pause_generation(mode="in_place")`: running requests stay in the running batch with their KV,
   new ones wait; no episode fails;
4. `flush_cache`, best effort: SGLang flushes only an idle scheduler, so it succeeds when no request
   is in flight and is refused (400, harmless) otherwise;
5. `update_weights_from_disk(PATH, weight_version=..., flush_cache=false)`;
6. `continue_generation()` always, even when 4 or 5 failed; then /model_info must report the new
   version.

Why in_place with `flush_cache` false, read from SGLang 0.5.19's scheduler: the update's own flush
(`flush_cache` true) runs after the weights are loaded and needs `is_fully_idle()`, i.e. an empty
running batch *and* an empty waiting queue. After an in_place pause the running batch holds the
in-flight requests; after a `retract` pause they sit in the waiting queue: either way the flush is
refused, which 0.5.19 turns into `assert flush_cache_success` in the scheduler (the server goes
down with the new weights in and the old label) and 0.5.23 into a 400 after the weights changed,
label unchanged. (0.5.23 lets a paused flush ignore the waiting queue, so retract + flush works
there; not on the pinned version.) With `flush_cache` false every version accepts the update with
episodes in flight: SGLang moves the label only when the load succeeded, so label and weights
agree on every path, and it reports per request which tokens each version made
(`meta_info["weight_versions"]`), which each turn records (`TurnSpan.version_spans`). In place also
costs the least: retract recomputes every in-flight request's KV after the pause
(bench/reload_pause_modes.py measures both on the CPU engine). The price: KV computed by the old
weights (the in-flight requests', and the radix cache's when step 4 was refused) is reused after
the swap until flushed or evicted; in-flight turns say so in their spans.

Failure paths, each leaving the label the engine reports (read back from /model_info, which the
worker's status and `bcstack_worker_weight_version_info` then show) true to the weights it serves:
the update refused (400: SGLang keeps or rolls back to the old weights and label), a refused
flush (not a failure: the update goes on), the engine restarted between pause and continue (it
comes back unpaused with its start-up weights and label). Any failure answers 502. Reloads are
serialized: a second one while one runs gets 409 at once; `in_progress` tells readiness probes
that a pause is ours.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from core.checkpoint import VerifyError, verify_checkpoint
from core.engine_client import EngineClient, EngineError

log = logging.getLogger(__name__)

Outcome = Literal["ok", "rejected", "failed"]
OUTCOMES: tuple[Outcome, ...] = ("ok", "rejected", "failed")
# What a reload is for, as `bcstack worker reload --canary` tags it (counted per step in metrics):
# the canaries' reload, the other replicas' once the canaries passed, the canaries' way back.
CanaryStep = Literal["canary", "promote", "rollback"]
CANARY_STEPS: tuple[CanaryStep, ...] = ("canary", "promote", "rollback")
DISABLED_MESSAGE = "reload is disabled: set BCSTACK_WORKER_CHECKPOINT_ROOT"
HISTORY = 20


@dataclass(frozen=True)
class ReloadAttempt:
    checkpoint: str
    weight_version: str | None
    outcome: Outcome
    error: str | None
    started_at: float  # unix seconds
    seconds: float


class ReloadRefused(Exception):
    """A reload that did not happen (or did not complete): the HTTP status and the reason."""

    def __init__(self, status: int, error: str) -> None:
        super().__init__(error)
        self.status = status
        self.error = error


class ReloadMetrics:
    """What the manager reports; `WorkerMetrics` implements it on the worker's registry."""

    def reload(self, outcome: Outcome, seconds: float, paused_seconds: float | None) -> None: ...

    def canary_step(self, step: CanaryStep, outcome: Outcome) -> None: ...

    def weight_version(self, version: str | None) -> None: ...


def resolve_checkpoint(root: Path, checkpoint: str) -> Path:
    """`checkpoint` (relative to `root`, or absolute) with symlinks resolved; must lie inside `root`."""
    if not checkpoint.strip():
        raise ReloadRefused(400, "checkpoint: give a folder inside the checkpoint root")
    real_root = root.resolve()
    candidate = Path(checkpoint)
    try:
        real = (candidate if candidate.is_absolute() else real_root / candidate).resolve()
    except (ValueError, OSError) as e:  # a NUL byte, a lone surrogate, a name the OS refuses
        raise ReloadRefused(400, f"checkpoint {checkpoint!r} is not a usable path ({e})") from None
    # 403 and 404, not 400: which paths these are depends on the server's folders, which no
    # request schema can know (a fuzzer's schema-valid path is refused as a client's would be).
    if real == real_root or not real.is_relative_to(real_root):
        raise ReloadRefused(403, f"checkpoint {checkpoint!r} is not inside the checkpoint root {real_root}")
    if not real.is_dir():
        raise ReloadRefused(404, f"checkpoint {checkpoint!r} is not a folder in the checkpoint root")
    return real


def served_config(model_path: Any) -> tuple[Path | None, str | None]:
    """The served model's config.json, or (None, why it is not usable)."""
    if not isinstance(model_path, str) or not model_path:
        return None, "the engine reports no model_path"
    config = Path(model_path) / "config.json"
    try:
        json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return None, f"{config} is not readable here ({type(e).__name__})"
    return config, None


class ReloadManager:
    """Serialized, verified weight reloads of one engine; the last `HISTORY` attempts kept."""

    def __init__(
        self,
        engine: EngineClient,
        checkpoint_root: Path | None,
        metrics: ReloadMetrics | None = None,
        *,
        verify: Callable[..., Any] | None = None,
        pause_limit_s: float = 240.0,
    ) -> None:
        self.engine = engine
        self.pause_limit_s = pause_limit_s
        self.checkpoint_root = checkpoint_root
        self.metrics = metrics or ReloadMetrics()
        self._verify = verify
        self.attempts: deque[ReloadAttempt] = deque(maxlen=HISTORY)
        self.running = False
        # True from the pause to the read-back after continue: a reload, not a wedged engine.
        self.in_progress = False
        # The folder the served weights came from: the last successful reload's, None for the
        # weights the engine started with.
        self.checkpoint: Path | None = None

    async def status(self) -> dict[str, Any]:
        try:
            version = await self.engine.weight_version()
        except EngineError as e:
            log.warning("engine weight version unavailable: %s", e)
            version = None
        else:
            self.metrics.weight_version(version)
        return {
            "weight_version": version,
            "checkpoint_root": str(self.checkpoint_root) if self.checkpoint_root is not None else None,
            # None: the weights the engine started with (no reload yet in this worker's life).
            "checkpoint": str(self.checkpoint) if self.checkpoint is not None else None,
            "attempts": [asdict(a) for a in self.attempts],
        }

    async def reload(
        self, checkpoint: str, weight_version: str | None = None, canary_step: CanaryStep | None = None
    ) -> dict[str, Any]:
        """Run one reload; the success body, or ReloadRefused(status, error). `canary_step` (set by
        a canary reload) counts the attempt under that step too."""
        if self.checkpoint_root is None:
            raise ReloadRefused(403, DISABLED_MESSAGE)
        if self.running:  # checked and set with no await between: atomic on the event loop
            raise ReloadRefused(409, "a reload is already running")
        self.running = True
        started_at, started = time.time(), time.perf_counter()
        version = weight_version
        paused: float | None = None
        notes: list[str] = []
        try:
            path = resolve_checkpoint(self.checkpoint_root, checkpoint)
            version = weight_version if weight_version is not None else path.name
            if not version.strip():
                raise ReloadRefused(400, "weight_version must not be empty")
            await self._verify_checkpoint(path, notes)
            previous, paused = await self._swap(path, version, notes)
        except ReloadRefused as e:
            paused = e.paused if isinstance(e, _Failed) else paused
            outcome: Outcome = "rejected" if e.status < 500 else "failed"
            error = "; ".join([e.error, *notes])
            self._record(checkpoint, version, outcome, error, started_at, started, paused)
            if canary_step is not None:
                self.metrics.canary_step(canary_step, outcome)
            log.warning("reload of %s %s: %s", checkpoint, outcome, error)
            raise ReloadRefused(e.status, error) from None
        finally:
            self.running = False
        note = "; ".join(notes) or None
        seconds = self._record(checkpoint, version, "ok", note, started_at, started, paused)
        if canary_step is not None:
            self.metrics.canary_step(canary_step, "ok")
        log.info("reloaded %s as %s (was %s) in %.2f s", path, version, previous, seconds)
        return {
            "status": "ok",
            "weight_version": version,
            "previous_version": previous,
            "seconds": round(seconds, 3),
            "paused_seconds": round(paused or 0.0, 3),
        }

    async def _verify_checkpoint(self, path: Path, notes: list[str]) -> None:
        try:
            info = await self.engine.model_info()
            expect, why_not = served_config(info.get("model_path"))
        except EngineError as e:
            expect, why_not = None, f"engine model info unavailable ({e})"
        if expect is None:
            notes.append(f"verified without the served model's config: {why_not}")
        verify = self._verify or verify_checkpoint
        try:
            await asyncio.to_thread(verify, path, expect_config=expect)
        except VerifyError as e:
            raise ReloadRefused(422, f"verification failed: {e}") from None

    async def _swap(self, path: Path, version: str, notes: list[str]) -> tuple[str | None, float]:
        """pause → flush (best effort) → update → continue (always) → read back; (previous version,
        paused seconds)."""
        try:
            previous = await self.engine.weight_version()
        except EngineError as e:
            raise ReloadRefused(502, f"engine unavailable before the reload: {e}") from None
        failure: str | None = None
        self.in_progress = True
        paused_at = time.perf_counter()
        try:
            await self.engine.pause_generation("in_place")
            flushed, _text = await self.engine.flush_cache()
            if not flushed:
                notes.append(
                    "prefix cache not flushed: requests were in flight (their turns record both versions)"
                )
            async with asyncio.timeout(self.pause_limit_s):
                ok, message = await self.engine.update_weights_from_disk(
                    str(path), weight_version=version, flush_cache=False
                )
            if not ok:
                failure = f"engine refused the weights (old weights keep serving): {message}"
        except EngineError as e:
            failure = f"engine error during the reload: {e}"
        except TimeoutError:
            failure = f"the engine did not load the weights within {self.pause_limit_s:g} s"
        finally:
            try:
                await self.engine.continue_generation()
            except EngineError as e:
                log.error("continue_generation failed after a reload: %s", e)
                failure = "; ".join(filter(None, [failure, f"continue_generation failed: {e}"]))
            paused = time.perf_counter() - paused_at
            try:
                now: str | None = await self.engine.weight_version()
            except EngineError as e:
                now = None
                failure = "; ".join(filter(None, [failure, f"engine unavailable after the reload: {e}"]))
            self.in_progress = False
        self._served(now, path, version, previous)
        if failure is None and now != version:
            failure = f"engine reports weight_version {now!r} after the reload, not {version!r}"
        if failure is not None:
            raise _Failed(f"{failure}; the engine serves {now!r}", paused)
        return previous, paused

    def _served(self, now: str | None, path: Path, version: str, previous: str | None) -> None:
        """Bring the worker's view in line with the label the engine reports after a reload."""
        if now is None:
            return  # unknown: status reads it again on the next GET
        self.metrics.weight_version(now)
        if now == version:
            self.checkpoint = path
        elif now != previous:  # neither: a restarted engine serving its start-up weights
            self.checkpoint = None

    def _record(
        self,
        checkpoint: str,
        version: str | None,
        outcome: Outcome,
        error: str | None,
        started_at: float,
        started: float,
        paused: float | None,
    ) -> float:
        seconds = time.perf_counter() - started
        self.attempts.append(
            ReloadAttempt(checkpoint, version, outcome, error, round(started_at, 3), round(seconds, 3))
        )
        self.metrics.reload(outcome, seconds, paused)
        return seconds


class _Failed(ReloadRefused):
    """A failure after pausing (502); carries how long generation was paused."""

    def __init__(self, error: str, paused: float) -> None:
        super().__init__(502, error)
        self.paused = paused
