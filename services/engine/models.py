"""Token models the scheduler drives: a `transformers` causal LM on the CPU (here) and a scripted
policy (`services.engine.scripted`). Both answer the same two calls, from the scheduler's step
thread only:

- `prefill(seq)`: take a new (or retracted) sequence in; fill `seq.input_logprobs` when asked;
  return its first token and log-prob, or None when there is nothing to draw (`max_new_tokens`
  0, or a retracted sequence whose last token is still to be fed);
- `decode(seqs)`: one step for every sequence (each has one output token not yet fed to the
  model); return one (token, log-prob) per sequence, in order.

Batching (`TransformersModel.decode`): the sequences of one step run as one forward pass over a
left-padded batch: a `DynamicCache` built from their KV tensors, a 2-D attention mask that hides
the padding and per-row `position_ids` (RoPE sees true positions, so padding changes nothing but
float round-off). While the batch keeps the same members, the batched cache is reused from step
to step (the forward pass appends to it); when a sequence joins or leaves, every member's KV is
cut back out of it (padding removed) and a new batch is stacked. Prefill runs one sequence at a
time (no chunked prefill). This is the simplest exact scheme `transformers` allows; it copies a
member's KV once per membership change, which is nothing at the tiny model's size. The batched
cache's layers are `_GrowingLayer`s: `transformers`' `DynamicLayer` concatenates, copying the whole
batch's keys and values at every step (`aten::cat` was 70% of a 16-sequence decode step at 1,500
tokens of context under torch's profiler), where these write the step's one position into a buffer
with room to spare (`DECODE_ROOM` positions, doubled when full) and hand attention a view of it:
the same keys and values, without the copies (`bench/engine_decode.py` measures the two side by
side; tests/test_engine_decode_cache.py checks grown and restacked batches against one forward
pass over each whole sequence).

Prefix cache (`services.engine.prefix_cache`, SGLang's radix cache on the CPU): a prefill keeps
its sequence's KV under its token ids, and so does every release (finished, aborted, retracted:
the tokens whose KV was computed, prompt and output). A prefill whose ids start with a kept
entry's starts from (a view of) that KV and runs the forward pass over the rest only, so a
worker's next turn, which sends the whole trajectory again, computes just the new observation.
RoPE positions follow from the cache length, so the suffix sees the positions a full prefill
would; KV tensors are never written in place (`DynamicCache` concatenates), so an entry can be
shared with the sequences that start from it. At least one token is always computed when the
first output token's logits are needed (an input equal to an entry recomputes its last token),
and with input log-probs every scored position is computed. A sequence that sampled with
other weights never feeds the cache: the cache is flushed when weights are swapped in, and a
sequence whose KV predates the swap (in-place updates keep running sequences) is not kept.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.engine.model_api import Choice, TokenModel, WeightLoadError
from services.engine.prefix_cache import PrefixCache
from services.engine.sampling import sample_token, token_logprobs
from services.engine.sequence import Sequence

__all__ = ["Choice", "TokenModel", "TransformersModel", "WeightLoadError", "eos_ids_of"]

log = logging.getLogger(__name__)


def eos_ids_of(model_dir: Path, config: Any, tokenizer: Any) -> frozenset[int]:
    """Every id that ends generation by default: the config's, generation_config's and the tokenizer's
    EOS (SGLang unions the HF config's eos_token_id with the tokenizer's)."""
    ids: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))

    add(getattr(config, "eos_token_id", None))
    generation_config = model_dir / "generation_config.json"
    if generation_config.is_file():
        try:
            add(json.loads(generation_config.read_text(encoding="utf-8")).get("eos_token_id"))
        except (OSError, ValueError):
            log.warning("unreadable %s; using the config's EOS only", generation_config)
    add(getattr(tokenizer, "eos_token_id", None))
    return frozenset(ids)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Positions a stacked decode batch has room for before its buffers grow: a worker's turn writes at
# most a few hundred tokens before its sequence finishes and the batch is stacked again.
DECODE_ROOM = 256


@functools.cache
def _growing_layer() -> type:
    """`_GrowingLayer`, defined on first use: `transformers` is imported only by engines that load a
    model (a scripted engine never does)."""
    from transformers.cache_utils import DynamicLayer

    class _GrowingLayer(DynamicLayer):
        """A `DynamicLayer` whose keys and values are views of buffers with room to grow: `update`
        writes the new positions in place instead of concatenating (copying) everything cached.
        Views handed out earlier see later writes only beyond their own length, so nothing they
        hold changes."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
            super().__init__()
            self._keys, self._values = keys, values  # [B, heads, capacity, dim]
            self.keys, self.values = keys[:, :, :length], values[:, :, :length]
            self.device, self.dtype = keys.device, keys.dtype
            self.is_initialized = True

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            start = self.keys.shape[2]
            end = start + key_states.shape[2]
            if end > self._keys.shape[2]:
                self._keys = _with_room(self._keys, start, end)
                self._values = _with_room(self._values, start, end)
            self._keys[:, :, start:end] = key_states
            self._values[:, :, start:end] = value_states
            self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]
            return self.keys, self.values

    return _GrowingLayer


def _with_room(buffer: torch.Tensor, length: int, needed: int) -> torch.Tensor:
    """A buffer twice as long as `needed` positions (at least) holding `buffer`'s first `length`."""
    shape = (*buffer.shape[:2], max(2 * buffer.shape[2], needed + DECODE_ROOM), buffer.shape[3])
    grown = buffer.new_zeros(shape)
    grown[:, :, :length] = buffer[:, :, :length]
    return grown


def load_causal_lm(model_dir: str | Path, dtype: str = "auto") -> Any:
    """`AutoModelForCausalLM.from_pretrained` on the CPU in eval mode; WeightLoadError on failure."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise WeightLoadError(f"{path} is not a model folder (no config.json)")
    hf_logging.disable_progress_bar()  # its tqdm bar would fill the service log
    try:
        kwargs: dict[str, Any] = {} if dtype == "auto" else {"dtype": _DTYPES[dtype]}
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except Exception as e:  # from_pretrained raises OSError, ValueError, safetensors errors ...
        raise WeightLoadError(f"{type(e).__name__}: {e}") from e
    return model.eval()


@dataclass
class _KV:
    """One sequence's KV cache outside a batch: per layer (keys, values), each [1, heads, len, dim]."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    weights: int = 0  # which weights computed it (TransformersModel.weights_epoch)

    @property
    def length(self) -> int:
        return self.layers[0][0].shape[2]

    def prefix(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The layers cut to the first `n` tokens (views, no copy)."""
        if n == self.length:
            return self.layers
        return [(k[:, :, :n], v[:, :, :n]) for k, v in self.layers]


class _Batch:
    """The decode batch kept between steps while its members stay the same."""

    def __init__(self, seqs: list[Sequence], cache: Any, mask: torch.Tensor, weights: list[int]) -> None:
        self.seqs = seqs
        self.cache = cache
        self.mask = mask  # [B, T] 1 = real token, 0 = left padding
        self.weights = weights  # each member's _KV.weights

    def same_members(self, seqs: list[Sequence]) -> bool:
        return len(seqs) == len(self.seqs) and all(a is b for a, b in zip(seqs, self.seqs, strict=True))


class TransformersModel:
    """A Hugging Face causal LM served on the CPU (the embedded default's engine)."""

    def __init__(
        self, model: Any, model_path: str, eos_token_ids: frozenset[int], prefix_cache_tokens: int = 0
    ) -> None:
        self.model = model
        self.model_path = model_path
        self.eos_token_ids = eos_token_ids
        config = model.config
        self.vocab_size = int(config.vocab_size)
        self.max_position_embeddings = int(getattr(config, "max_position_embeddings", 0) or 0)
        self.parameter_count = sum(p.numel() for p in model.parameters())
        # transformers 5.2x names the cache argument `cache`; earlier 5.x `past_key_values`.
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._batch: _Batch | None = None
        self.prefix_cache: PrefixCache[_KV] = PrefixCache(prefix_cache_tokens)
        self.weights_epoch = 0  # bumped by every adopt(): KV of older weights is never reused

    @classmethod
    def load(
        cls, model_dir: str | Path, tokenizer: Any, dtype: str = "auto", prefix_cache_tokens: int = 0
    ) -> TransformersModel:
        model = load_causal_lm(model_dir, dtype)
        eos = eos_ids_of(Path(model_dir), model.config, tokenizer)
        return cls(model, str(model_dir), eos, prefix_cache_tokens)

    def cache_shape(self) -> tuple[int, int, int]:
        """(layers, KV heads, head dim): what must match for running sequences to keep their KV."""
        c = self.model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return (c.num_hidden_layers, getattr(c, "num_key_value_heads", c.num_attention_heads), head_dim)

    def kv_bytes_per_token(self) -> int:
        """Bytes of keys and values one token holds (what the prefix cache's budget costs per token)."""
        layers, heads, head_dim = self.cache_shape()
        return 2 * layers * heads * head_dim * next(self.model.parameters()).element_size()

    def adopt(self, other: TransformersModel) -> None:
        """Serve `other`'s weights from now on (the scheduler calls this between steps)."""
        self.model = other.model
        self.model_path = other.model_path
        self.eos_token_ids = other.eos_token_ids
        self.weights_epoch += 1
        self.flush_cache()

    def flush_cache(self) -> None:
        """Forget every prefix-cache entry (running sequences keep their own KV)."""
        self.prefix_cache.clear()

    # --- forward passes --------------------------------------------------------------------------

    def _new_cache(self, layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> Any:
        from transformers import DynamicCache

        return DynamicCache(ddp_cache_data=layers) if layers else DynamicCache()

    def _forward(self, input_ids: torch.Tensor, cache: Any, **kwargs: Any) -> torch.Tensor:
        out = self.model(input_ids=input_ids, use_cache=True, **{self._cache_arg: cache}, **kwargs)
        return out.logits

    @torch.inference_mode()
    def prefill(self, seq: Sequence) -> Choice | None:
        self.release(seq)
        resuming = bool(seq.output_ids)
        # A retracted sequence recomputes its cache up to (not including) its last output token,
        # which the next decode step feeds.
        ids = seq.prompt_ids + seq.output_ids[:-1] if resuming else seq.prompt_ids
        start = seq.request.logprob_start_len
        want_input = seq.request.return_logprob and start >= 0 and not resuming
        keep = len(ids) - start if want_input else 1
        # Cached KV may stand in for every token whose logits are not needed: a resumed sequence
        # needs none; a new one needs the last position's and, with input log-probs, all from `start`.
        limit = len(ids) if resuming else min(len(ids) - 1, start if want_input else len(ids))
        reused, hit = self.prefix_cache.match(ids, limit) if self.prefix_cache.enabled else (0, None)
        if not resuming:
            seq.cached_tokens = reused
        past = hit.prefix(reused) if hit is not None else None
        if past is not None and reused == len(ids):  # a retracted sequence's kept KV: nothing to compute
            seq.model_state = _KV(past, self.weights_epoch)
            return None
        cache = self._new_cache(past)
        logits = self._forward(torch.tensor([ids[reused:]]), cache, logits_to_keep=keep)[0]
        seq.model_state = _KV([(layer.keys, layer.values) for layer in cache.layers], self.weights_epoch)
        # Kept now, not only at the end, so the requests that share this prompt while it runs
        # (a GRPO group, one system prompt) find it.
        self._keep(ids, seq.model_state)
        if want_input:
            # Row r scores the token after position start + r. The token at `start` has no score
            # in SGLang's answer: the list starts with None (`_process_input_token_logprobs`).
            targets = torch.tensor(ids[start + 1 :])
            seq.input_logprobs = [None, *token_logprobs(logits[:-1], targets)]
        if resuming or seq.sampling.max_new_tokens == 0:
            return None
        return sample_token(logits[-1], seq.sampling, seq.generator, seq.banned_tokens())

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> list[Choice]:
        if self._batch is None or not self._batch.same_members(seqs):
            self._dissolve_batch()
            self._batch = self._stack(seqs)
        batch = self._batch
        lengths = [len(s.prompt_ids) + len(s.output_ids) - 1 for s in seqs]
        input_ids = torch.tensor([[s.output_ids[-1]] for s in seqs])
        batch.mask = torch.cat([batch.mask, torch.ones(len(seqs), 1, dtype=batch.mask.dtype)], dim=1)
        logits = self._forward(
            input_ids,
            batch.cache,
            attention_mask=batch.mask,
            position_ids=torch.tensor([[n] for n in lengths]),
        )[:, -1, :]
        return [
            sample_token(logits[i], s.sampling, s.generator, s.banned_tokens()) for i, s in enumerate(seqs)
        ]

    def release(self, seq: Sequence, reusable: bool = True) -> None:
        """Hand a sequence's KV (finished, aborted or retracted) to the prefix cache, and forget it.

        `reusable` False (a step that raised may have left the KV half-updated): drop it instead.
        """
        keep = reusable and self.prefix_cache.enabled
        if self._batch is not None and any(s is seq for s in self._batch.seqs):
            self._dissolve_batch(drop=None if keep else seq, cut_finished=keep)
        if keep and isinstance(seq.model_state, _KV):
            kv = seq.model_state
            self._keep((seq.prompt_ids + seq.output_ids)[: kv.length], kv)
        seq.model_state = None

    def _keep(self, tokens: list[int], kv: _KV) -> None:
        if kv.weights == self.weights_epoch:
            self.prefix_cache.insert(tokens, kv)

    # --- batch bookkeeping -----------------------------------------------------------------------

    def _stack(self, seqs: list[Sequence]) -> _Batch:
        kvs: list[_KV] = [s.model_state for s in seqs]
        longest = max(kv.length for kv in kvs)
        mask = torch.zeros(len(seqs), longest, dtype=torch.long)
        layers = []
        growing = _growing_layer()
        for layer in range(len(kvs[0].layers)):
            keys, values = kvs[0].layers[layer]
            shape = (len(seqs), keys.shape[1], longest + DECODE_ROOM, keys.shape[3])
            batch_keys = keys.new_zeros(shape)
            batch_values = values.new_zeros(shape)
            for i, kv in enumerate(kvs):
                k, v = kv.layers[layer]
                batch_keys[i, :, longest - kv.length : longest] = k[0]
                batch_values[i, :, longest - kv.length : longest] = v[0]
            layers.append(growing(batch_keys, batch_values, longest))
        for i, kv in enumerate(kvs):
            mask[i, longest - kv.length :] = 1
        for s in seqs:
            s.model_state = None  # the batch holds it now
        cache = self._new_cache()
        cache.layers = layers
        cache.layer_class_to_replicate = None  # every layer is here
        return _Batch(list(seqs), cache, mask, [kv.weights for kv in kvs])

    def _dissolve_batch(self, drop: Sequence | None = None, cut_finished: bool = False) -> None:
        """Cut each live member's KV back out of the batched cache (dropping the padding); the
        finished members' too with `cut_finished` (their release hands it to the prefix cache)."""
        batch, self._batch = self._batch, None
        if batch is None:
            return
        width = batch.mask.shape[1]
        for i, seq in enumerate(batch.seqs):
            if seq is drop or (seq.finished and not cut_finished):
                continue
            pad = width - int(batch.mask[i].sum())
            seq.model_state = _KV(
                [
                    (layer.keys[i : i + 1, :, pad:].clone(), layer.values[i : i + 1, :, pad:].clone())
                    for layer in batch.cache.layers
                ],
                batch.weights[i],
            )
