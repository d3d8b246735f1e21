"""Continuous batching, lite: one loop that advances every running sequence by one token per step
and admits waiting requests between steps.

The asyncio side (HTTP handlers, this loop) owns the queues; the model runs in one dedicated
worker thread, so the event loop stays free while a step computes and the model is only ever
touched by that thread. A step, in order: forget the sequences aborted since the last step,
decode one token for every running sequence (one batched forward pass), then prefill the newly
admitted ones (each gets its first token and joins the batch at the next step). Between steps the
loop applies aborts, pauses and a weight swap, and wakes the handlers whose sequences changed.

Pause modes (SGLang's `PauseGenerationReqInput`): `abort` finishes every queued and running
request with an abort reason; `retract` drops the running sequences' KV caches and puts them
back at the head of the queue (on continue, their KV is taken back from the model's prefix cache,
which keeps released KV, or recomputed); `in_place` just stops stepping, keeping the KV caches.
In every mode new requests are held apart until `continue_generation` (SGLang holds them in its
tokenizer manager, so the scheduler's waiting queue does not see them).

Flush (SGLang 0.5.19 `Scheduler.flush_cache` / `is_fully_idle`): the prefix cache is emptied only
when no request is running and none is waiting in the scheduler's queue, retracted ones included
(0.5.23 ignores the waiting queue while paused); otherwise the flush is refused. A weight swap
records, on every live request that already has output tokens, the version that made them
(`record_weight_version_change`), which its answer reports as `meta_info["weight_versions"]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from services.engine import protocol as proto
from services.engine.metrics import EngineMetrics
from services.engine.model_api import TokenModel
from services.engine.sequence import Sequence

log = logging.getLogger(__name__)

PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[str, ...] = ("abort", "retract", "in_place")


class QueueFull(RuntimeError):
    """More requests are waiting than `max_queued_requests` allows."""


class Scheduler:
    def __init__(
        self,
        model: TokenModel,
        *,
        max_running: int,
        max_queued: int,
        weight_version: str,
        metrics: EngineMetrics | None = None,
        thread_setup: Callable[[], None] | None = None,
    ) -> None:
        self.model = model
        self.max_running = max_running
        self.max_queued = max_queued
        self.weight_version = weight_version
        self.metrics = metrics
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.held: list[Sequence] = []  # submitted while paused: outside the scheduler until continue
        self.paused: PauseMode | None = None
        self.steps = 0
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="engine-step", initializer=thread_setup
        )
        self._wake = asyncio.Event()
        self._step_lock = asyncio.Lock()
        self._pending_aborts: list[tuple[Sequence, str]] = []
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="engine-scheduler")

    async def close(self) -> None:
        """Stop the loop; every request still queued or running ends with an abort reason."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        message = "The engine is shutting down."
        for seq in (*self.held, *self.waiting, *self.running, *(s for s, _ in self._pending_aborts)):
            if not seq.finished:
                seq.finish(proto.finish_abort(message))
            seq.updated.set()
        self.waiting.clear()
        self.held = []
        self.running = []
        self._executor.shutdown(wait=False, cancel_futures=True)

    # --- requests --------------------------------------------------------------------------------

    def submit(self, seq: Sequence) -> None:
        if self._stopping:
            raise QueueFull("The engine is shutting down.")
        if len(self.waiting) + len(self.held) >= self.max_queued:
            raise QueueFull(f"{len(self.waiting)} requests are already waiting (max_queued_requests).")
        (self.held if self.paused is not None else self.waiting).append(seq)
        self._gauges()
        self._wake.set()

    def abort(self, seq: Sequence, message: str) -> None:
        """Finish `seq` with an abort reason: a queued one now, a running one between two steps."""
        if seq.finished:
            return
        if any(s is seq for s in self.held):
            self.held.remove(seq)
            seq.finish(proto.finish_abort(message))
            self._finished(seq)
        elif any(s is seq for s in self.waiting):
            self.waiting.remove(seq)
            seq.finish(proto.finish_abort(message))
            self._finished(seq)
            self._gauges()
        elif any(s is seq for s in self.running):
            self._pending_aborts.append((seq, message))
            self._wake.set()

    def abort_all(self, message: str) -> int:
        seqs = [*self.held, *self.waiting, *self.running]
        for seq in seqs:
            self.abort(seq, message)
        return len(seqs)

    def find(self, rid: str) -> Sequence | None:
        return next((s for s in (*self.running, *self.waiting, *self.held) if s.rid == rid), None)

    @property
    def idle(self) -> bool:
        """SGLang's `is_fully_idle`: nothing running and nothing in the waiting queue."""
        return not self.running and not self.waiting and not self._pending_aborts

    # --- control ---------------------------------------------------------------------------------

    async def pause(self, mode: PauseMode) -> None:
        """Stop stepping; returns once no step is in flight (see the module docstring for modes)."""
        self.paused = mode
        if self.metrics:
            self.metrics.paused.set(1)
        async with self._step_lock:
            await self._apply_aborts()
            if mode == "abort":
                self.abort_all("Aborted by pause_generation.")
                await self._apply_aborts()
            elif mode == "retract":
                retracted, self.running = self.running, []
                await self._in_step_thread(self._release_all, retracted)
                self.waiting.extendleft(reversed(retracted))
            self._gauges()

    def resume(self) -> None:
        self.paused = None
        self.waiting.extend(self.held)
        self.held = []
        if self.metrics:
            self.metrics.paused.set(0)
        self._wake.set()

    async def swap_model(self, apply: Any) -> None:
        """Run `apply()` (which installs new weights) in the step thread, between two steps."""
        async with self._step_lock:
            await self._in_step_thread(apply)
        self._gauges()

    def record_weight_version(self, weight_version: str | None) -> None:
        """Label the weights `weight_version`; live requests note which version made their tokens."""
        if weight_version is None or weight_version == self.weight_version:
            return
        for seq in (*self.running, *self.waiting, *self.held):
            if seq.output_ids:
                seq.version_events.append((self.weight_version, len(seq.output_ids)))
        self.weight_version = weight_version

    async def flush_cache(self) -> bool:
        """Empty the model's prefix cache between two steps; refused (False) unless `idle`."""
        async with self._step_lock:
            if not self.idle:
                log.warning(
                    "Cache not flushed because there are pending requests. #queue-req: %d, #running-req: %d",
                    len(self.waiting),
                    len(self.running),
                )
                return False
            flush = getattr(self.model, "flush_cache", None)
            if flush is not None:
                await self._in_step_thread(flush)
        self._gauges()
        return True

    # --- the loop --------------------------------------------------------------------------------

    async def _in_step_thread(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _release(self, seq: Sequence, reusable: bool = True) -> None:
        release = getattr(self.model, "release", None)
        if release is not None:
            release(seq, reusable=reusable)

    def _release_all(self, seqs: list[Sequence], reusable: bool = True) -> None:
        for seq in seqs:
            self._release(seq, reusable)

    def _step(self, admit: list[Sequence], decode: list[Sequence]) -> None:
        """One step, in the step thread."""
        if decode:
            for seq, (token, logprob) in zip(decode, self.model.decode(decode), strict=True):
                seq.append(token, logprob)
        for seq in admit:
            resuming = bool(seq.output_ids)
            choice = self.model.prefill(seq)
            if choice is not None:
                seq.append(*choice)
            elif not resuming:  # max_new_tokens 0: scoring only
                seq.finish(proto.finish_length(0))
        for seq in (*decode, *admit):
            if seq.finished:
                self._release(seq)

    async def _apply_aborts(self) -> None:
        """Finish the running sequences aborted since the last step (the step lock is held)."""
        pending, self._pending_aborts = self._pending_aborts, []
        gone = []
        for seq, message in pending:
            if not seq.finished:
                seq.finish(proto.finish_abort(message))
                self._finished(seq)
                gone.append(seq)
        if gone:
            self.running = [s for s in self.running if not s.finished]
            await self._in_step_thread(self._release_all, gone)
            self._gauges()

    async def _run(self) -> None:
        while True:
            if self._pending_aborts:
                async with self._step_lock:
                    await self._apply_aborts()
            if self.paused is not None or not (self.waiting or self.running):
                self._wake.clear()
                if not self._pending_aborts:
                    await self._wake.wait()
                continue
            async with self._step_lock:
                if self.paused is not None:
                    continue
                await self._apply_aborts()
                decode = list(self.running)
                admit: list[Sequence] = []
                while self.waiting and len(decode) + len(admit) < self.max_running:
                    seq = self.waiting.popleft()
                    if not seq.finished:
                        admit.append(seq)
                before = {id(s): len(s.output_ids) for s in (*decode, *admit)}
                # The admitted count as running from here, so an abort during the step finds them.
                self.running = [*decode, *admit]
                try:
                    await self._in_step_thread(self._step, admit, decode)
                except Exception as e:  # a bug or OOM in the model: fail this step's requests, go on
                    log.exception("engine step failed")
                    failed = [*decode, *admit]
                    for seq in failed:
                        seq.finish(
                            proto.finish_abort(f"Internal error in the engine: {type(e).__name__}: {e}")
                        )
                    await self._in_step_thread(self._release_all, failed, False)
                self.running = [s for s in (*decode, *admit) if not s.finished]
                self.steps += 1
                self._account(decode, admit, before)
                self._gauges()
            await asyncio.sleep(0)  # let the woken handlers answer before the next step

    # --- bookkeeping -----------------------------------------------------------------------------

    def _account(self, decode: list[Sequence], admit: list[Sequence], before: dict[int, int]) -> None:
        m = self.metrics
        new_tokens = 0
        for seq in (*decode, *admit):
            new_tokens += len(seq.output_ids) - before[id(seq)]
            seq.weight_version = self.weight_version
            if seq.finished:
                self._finished(seq)
            else:
                seq.updated.set()
        if m is None:
            return
        if decode:
            m.batch_size.observe(len(decode))
        m.generation_tokens.inc(new_tokens)
        cache = getattr(self.model, "prefix_cache", None)
        for seq in admit:
            if before[id(seq)] == 0:
                m.prompt_tokens.inc(len(seq.prompt_ids))
                m.cached_prompt_tokens.inc(seq.cached_tokens)
                m.computed_prompt_tokens.inc(len(seq.prompt_ids) - seq.cached_tokens)
                if cache is not None and cache.enabled:
                    (m.prefix_cache_hits if seq.cached_tokens else m.prefix_cache_misses).inc()
                if seq.first_token_perf is not None and seq.request.log_metrics:
                    m.time_to_first_token.observe(seq.first_token_perf - seq.created_perf)

    def _finished(self, seq: Sequence) -> None:
        seq.weight_version = self.weight_version
        seq.updated.set()
        m = self.metrics
        if m is not None and seq.request.log_metrics and seq.finish_reason is not None:
            m.requests.labels(seq.finish_reason["type"]).inc()
            if seq.finished_perf is not None:
                m.e2e_latency.observe(seq.finished_perf - seq.created_perf)

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.running.set(len(self.running))
            self.metrics.queued.set(len(self.waiting))
            cache = getattr(self.model, "prefix_cache", None)
            self.metrics.prefix_cache_tokens.set(cache.tokens if cache is not None else 0)
