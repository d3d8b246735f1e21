"""The engine behind the HTTP routes: loading, request admission, weight updates, health.

Transport-free: `services.engine.service` maps these calls onto SGLang's routes and status codes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from services.engine import protocol as proto
from services.engine.metrics import EngineMetrics
from services.engine.model_api import WeightLoadError
from services.engine.scheduler import PauseMode, QueueFull, Scheduler
from services.engine.scripted import POLICIES, ScriptedModel
from services.engine.sequence import Sequence
from services.engine.settings import EngineSettings

if TYPE_CHECKING:
    from services.engine.models import TransformersModel

log = logging.getLogger(__name__)

State = Literal["starting", "ready", "failed"]
SUPPORTED_LOAD_FORMATS = (None, "auto", "safetensors", "pt")
# Below this size a decode step takes about a millisecond and handing it to several threads costs
# more than it saves (on a busy 2-core box, 25x more); one thread is the default there.
SMALL_MODEL_PARAMETERS = 100_000_000


class EngineUnavailable(RuntimeError):
    """The engine cannot take requests now (starting, failed, queue full): HTTP 503."""


@dataclass(frozen=True)
class UpdateResult:
    success: bool
    message: str
    num_paused_requests: int = 0


def check_world(world: Path) -> str | None:
    """Why `world` is not a toy world folder (`bcstack toyworld generate`), or None."""
    manifest = world / "world.json"
    if not manifest.is_file():
        return f"{world} is not a toy world folder (no world.json; see `bcstack toyworld generate`)"
    try:
        json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return f"{manifest} is unreadable: {e}"
    return None


def _load_tokenizer(path: Path, *, scripted: bool = False) -> Any:
    """transformers' tokenizer, as SGLang loads it; a scripted policy's from tokenizer.json alone where
    that gives the same answers (`core.tokenizer`): its engine then never imports torch."""
    if scripted:
        from core.tokenizer import load_file_tokenizer

        tokenizer = load_file_tokenizer(path)
        if tokenizer is not None:
            return tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class EngineCore:
    def __init__(self, settings: EngineSettings, metrics: EngineMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.state: State = "starting"
        self.failure: str | None = None
        self.tokenizer: Any = None
        self.model: TransformersModel | ScriptedModel | None = None
        self.scheduler: Scheduler | None = None
        self.context_length = 0
        self.model_path = str(settings.model) if settings.model else f"scripted:{settings.policy}"
        self.tokenizer_path = str(settings.tokenizer or settings.model)
        self.torch_threads: int | None = settings.torch_threads
        self._update_lock = asyncio.Lock()

    # --- lifecycle -------------------------------------------------------------------------------

    def _load(self) -> tuple[Any, TransformersModel | ScriptedModel]:
        """Blocking: the tokenizer and the token model (run off the event loop)."""
        s = self.settings
        tokenizer = _load_tokenizer(Path(self.tokenizer_path), scripted=s.policy is not None)
        if s.policy is not None:
            limit = int(getattr(tokenizer, "model_max_length", 0) or 0)
            limit = limit if 0 < limit < 10**9 else s.max_context_length
            return tokenizer, ScriptedModel(POLICIES[s.policy](), tokenizer, s.policy, limit)
        assert s.model is not None
        from services.engine.models import TransformersModel

        model = TransformersModel.load(s.model, tokenizer, s.dtype, s.prefix_cache_tokens)
        small = model.parameter_count < SMALL_MODEL_PARAMETERS
        self.torch_threads = s.torch_threads or (1 if small else None)
        return tokenizer, model

    async def start(self) -> None:
        """Load off the loop, then start the scheduler; failures leave `state` = failed."""
        try:
            self.tokenizer, self.model = await asyncio.to_thread(self._load)
        except Exception as e:
            self.state, self.failure = "failed", f"{type(e).__name__}: {e}"
            log.error("engine failed to load %s: %s", self.model_path, self.failure)
            return
        s = self.settings
        window = s.context_length or self.model.max_position_embeddings
        self.context_length = min(window, s.max_context_length)
        self.scheduler = Scheduler(
            self.model,
            max_running=s.max_running_requests,
            max_queued=s.max_queued_requests,
            weight_version=s.weight_version,
            metrics=self.metrics,
            thread_setup=self._thread_setup,
        )
        self.scheduler.start()
        self.state = "ready"
        if not isinstance(self.model, ScriptedModel) and s.prefix_cache_tokens:
            mib = s.prefix_cache_tokens * self.model.kv_bytes_per_token() / 2**20
            log.info("prefix cache: KV of up to %d tokens (%.0f MiB)", s.prefix_cache_tokens, mib)
        log.info(
            "engine ready: %s (context %d tokens, %d running at most)",
            self.model_path,
            self.context_length,
            s.max_running_requests,
        )

    def _thread_setup(self) -> None:
        if self.torch_threads:
            import torch

            torch.set_num_threads(self.torch_threads)

    async def close(self) -> None:
        if self.scheduler is not None:
            await self.scheduler.close()

    def _ready(self) -> Scheduler:
        if self.state == "starting":
            raise EngineUnavailable("The engine is still loading its model.")
        if self.state == "failed" or self.scheduler is None:
            raise EngineUnavailable(f"The engine failed: {self.failure}")
        return self.scheduler

    @property
    def weight_version(self) -> str:
        return self.scheduler.weight_version if self.scheduler else self.settings.weight_version

    # --- generation ------------------------------------------------------------------------------

    def submit(self, request: proto.GenerateRequest) -> Sequence:
        """Validate `request` against the model and queue it (RequestError / EngineUnavailable)."""
        scheduler = self._ready()
        assert self.model is not None
        if request.input_ids is not None:
            prompt = list(request.input_ids)
        else:
            prompt = list(self.tokenizer.encode(request.text or "", add_special_tokens=False))
            if not prompt:
                raise proto.RequestError("The text encodes to no tokens.")
        proto.check_vocab(prompt, self.model.vocab_size)
        limit = proto.check_length(len(prompt), request.sampling.max_new_tokens, self.context_length)
        if limit != request.sampling.max_new_tokens:  # trimmed to the context, as SGLang's scheduler does
            floor = min(request.sampling.min_new_tokens, limit)
            sampling = dataclasses.replace(request.sampling, max_new_tokens=limit, min_new_tokens=floor)
            request = dataclasses.replace(request, sampling=sampling)
        if request.return_logprob and request.logprob_start_len >= 0:
            proto.check_logprob_start(request.logprob_start_len, len(prompt))
        stop_lengths = [
            len(self.tokenizer.encode(stop, add_special_tokens=False)) for stop in request.sampling.stop
        ]
        seq = Sequence(
            request=request,
            prompt_ids=prompt,
            eos_token_ids=self.model.eos_token_ids,
            tokenizer=self.tokenizer,
            generator=self._generator(request.sampling.sampling_seed),
            stop_token_lengths=max(stop_lengths, default=0),
            weight_version=scheduler.weight_version,
        )
        try:
            scheduler.submit(seq)
        except QueueFull as e:
            raise EngineUnavailable(str(e)) from None
        return seq

    def _generator(self, seed: int | None) -> Any:
        """The request's torch generator (services.engine.sampling); a scripted policy draws nothing."""
        if isinstance(self.model, ScriptedModel):
            return None
        from services.engine.sampling import new_generator

        return new_generator(seed)

    def abort(self, seq: Sequence, message: str = "The client went away.") -> None:
        if self.scheduler is not None:
            self.scheduler.abort(seq, message)

    def abort_request(self, rid: str | None, abort_all: bool) -> None:
        scheduler = self._ready()
        if abort_all:
            scheduler.abort_all("Aborted by abort_request.")
        elif rid:
            seq = scheduler.find(rid)
            if seq is not None:
                scheduler.abort(seq, "Aborted by abort_request.")

    async def health_generate(self) -> tuple[bool, str]:
        """SGLang's /health_generate: one greedy token from `input_ids` [0], within the timeout."""
        try:
            scheduler = self._ready()
        except EngineUnavailable as e:
            return False, str(e)
        if scheduler.paused is not None:
            return False, f"generation is paused ({scheduler.paused})"
        request = proto.GenerateRequest(
            rid=f"HEALTH_CHECK_{id(self)}_{scheduler.steps}",
            sampling=proto.SamplingParams(max_new_tokens=1, temperature=0.0),
            input_ids=(0,),
            log_metrics=False,
        )
        try:
            seq = self.submit(request)
        except (EngineUnavailable, proto.RequestError) as e:
            return False, str(e)
        try:
            await asyncio.wait_for(seq.wait_finished(), self.settings.health_generate_timeout_seconds)
        except TimeoutError:
            scheduler.abort(seq, "Health check timed out.")
            return False, f"no token within {self.settings.health_generate_timeout_seconds:g} s"
        if seq.finish_reason and seq.finish_reason["type"] == "abort":
            return False, str(seq.finish_reason.get("message"))
        return True, "ok"

    # --- control ---------------------------------------------------------------------------------

    async def flush_cache(self) -> bool:
        """SGLang's /flush_cache: empty the prefix cache; refused (False) unless the scheduler is idle
        (nothing running, nothing waiting in its queue), as SGLang refuses it."""
        return await self._ready().flush_cache()

    def _die(self, failure: str) -> None:
        """What a scheduler exception does to SGLang: the server goes down. Here every request ends
        with an abort and every later call answers 503 until the engine is restarted."""
        self.state, self.failure = "failed", failure
        log.error("engine failed: %s", failure)
        if self.scheduler is not None:
            self.scheduler.abort_all(f"The engine failed: {failure}")

    async def pause(self, mode: PauseMode) -> None:
        await self._ready().pause(mode)

    def resume(self) -> None:
        self._ready().resume()

    async def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str | None = None,
        load_format: str | None = None,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
    ) -> UpdateResult:
        """Load `model_path` into a new model object off the loop, then swap it in between steps.

        The old weights keep serving while the new ones load and whenever loading fails. Running
        sequences keep their KV caches across the swap (as SGLang's in-place update does) unless
        `abort_all_requests`. Then, as SGLang 0.5.19 does (`SchedulerWeightUpdater.
        update_weights_from_disk`): with `flush_cache` the cache is flushed, and a flush refused
        because requests are running or waiting is `assert flush_cache_success, "Cache flush failed
        after updating weights"`, which takes the server down (here: the engine fails, 503 from
        then on) with the new weights in and the old label; otherwise the label moves to
        `weight_version`. Departure: the CPU engine never reuses prefix KV of older weights, even
        with `flush_cache` false (SGLang's radix cache keeps it until flushed or evicted).
        Messages are SGLang's (`ModelRunner.update_weights_from_disk`).
        """
        scheduler = self._ready()
        async with self._update_lock:
            result = await self._update(
                scheduler, model_path, weight_version, load_format, abort_all_requests, flush_cache
            )
        if self.metrics is not None:
            self.metrics.weight_updates.labels("success" if result.success else "failure").inc()
        return result

    async def _update(
        self,
        scheduler: Scheduler,
        model_path: str,
        weight_version: str | None,
        load_format: str | None,
        abort_all_requests: bool,
        flush_cache: bool,
    ) -> UpdateResult:
        if load_format not in SUPPORTED_LOAD_FORMATS:
            return UpdateResult(
                False,
                f"Failed to get weights iterator: load_format {load_format!r} is not supported by the "
                "CPU engine (auto, safetensors, pt).",
            )
        path = Path(model_path)
        if isinstance(self.model, ScriptedModel):
            # A scripted policy has no weights; the update only moves the version, so reload
            # drills run against it too.
            if not path.is_dir():
                return UpdateResult(False, f"Failed to get weights iterator: {path} is not a folder.")
            install = _nothing
        else:
            from services.engine.models import TransformersModel

            assert isinstance(self.model, TransformersModel)
            try:
                new = await asyncio.to_thread(
                    TransformersModel.load, path, self.tokenizer, self.settings.dtype
                )
            except WeightLoadError as e:
                return UpdateResult(False, f"Failed to get weights iterator: {e}.")
            problem = _incompatibility(self.model, new)
            if problem:
                return UpdateResult(
                    False, f"Failed to update weights: {problem}.\nRolling back to original weights."
                )
            install = functools.partial(self.model.adopt, new)
        if abort_all_requests:
            scheduler.abort_all("Aborted for a weight update.")
        await scheduler.swap_model(install)
        if not isinstance(self.model, ScriptedModel):
            self.model_path = str(path)
        if flush_cache and not await scheduler.flush_cache():
            self._die("Scheduler hit an exception: AssertionError: Cache flush failed after updating weights")
            raise EngineUnavailable(f"The engine failed: {self.failure}")
        scheduler.record_weight_version(weight_version)
        message = "Succeeded to update model weights."
        if weight_version is not None:
            message += f" Weight version updated to {weight_version}."
        log.info("weights updated from %s (version %s)", path, scheduler.weight_version)
        return UpdateResult(True, message)

    # --- info ------------------------------------------------------------------------------------

    def model_info(self) -> dict[str, Any]:
        """SGLang's /model_info keys the stack reads (0.5.19 `http_server.model_info`), plus the
        context length, which SGLang reports in /v1/models."""
        return {
            "model_path": self.model_path,
            "served_model_name": self.settings.served_model_name or self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "load_format": "auto",
            "context_length": self.context_length,
        }

    def health(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "status": "ok" if self.state == "ready" else self.state,
            "model_path": self.model_path,
            "weight_version": self.weight_version,
        }
        if self.scheduler is not None:
            body.update(
                running=len(self.scheduler.running),
                queued=len(self.scheduler.waiting),
                paused=self.scheduler.paused,
            )
        if self.failure:
            body["error"] = self.failure
        return body


def _incompatibility(old: TransformersModel, new: TransformersModel) -> str | None:
    if new.vocab_size != old.vocab_size:
        return f"the vocabulary differs ({new.vocab_size} rows, serving {old.vocab_size})"
    if new.cache_shape() != old.cache_shape():
        return f"the KV layout differs ({new.cache_shape()}, serving {old.cache_shape()})"
    return None


def _nothing() -> None:
    pass
