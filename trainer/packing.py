"""Dynamic batches packed by a token budget (DESIGN.md §5), and log-probs computed on them.

An RL step's samples (worker trajectories of a few hundred to ~25K tokens) are packed, without
padding, into micro-batches: each micro-batch is ONE row of concatenated samples whose total length
stays under a token budget. Inside the row,

- position ids restart at 0 for each sample, so RoPE sees each sample as if it ran alone;
- attention is block-diagonal causal: a token attends to earlier tokens of its own sample only,
  never across a sample boundary (how, without a T x T mask, is below).

With both, a sample's log-probs in a packed row equal its log-probs computed alone (the tests pin
this), so packing changes the cost of a step, not its result. Rows have different lengths and are
never padded: a micro-batch is exactly its samples' tokens, and no padding appears anywhere.

    bins = first_fit_pack([len(s) for s in samples], budget=8192)
    for batch in (pack(samples, b) for b in bins):
        logp = per_token_logprobs(model, batch)                       # [1, T], aligned like the samples
        loss = -sample_token_means(logp, batch).sum() / len(samples)  # per-sample token mean
        loss.backward()                                               # accumulates the full-batch grad

How the model sees a packed row (`forward_inputs`). The trainer loads its models with the
`trainer.attention.VARLEN` attention: the row's sample boundaries (cumulative lengths, computed from
the restarting position ids) go to an attention function that runs causal attention on each sample's
slice, so no mask tensor exists and no query-key pair across samples is computed (memory for masks
O(T), not O(T^2)). The "eager" and "sdpa" implementations still work, with the dense block-diagonal
mask built on demand (`PackedBatch.dense_attention_mask`): transformers 5 passes a 4D mask to the
attention function as is (`masking_utils._preprocess_mask_arguments` returns early on `ndim == 4`),
"sdpa" gives it to `scaled_dot_product_attention`, but "eager" ADDS it to the scores, so a boolean
mask there would add 0/1 and silently attend across samples; the additive float form (0 where
allowed, the dtype's minimum elsewhere; `additive_mask`) is right for both. `bench/packing_attention.py`
measures the two side by side. Other implementations (flash_attention_2, flex_attention) are refused.

Log-probs of the response tokens (`per_token_logprobs`, `token_logprobs`) go through the output head
`LOGPROB_CHUNK_TOKENS` positions at a time, each chunk under activation checkpointing, so a
micro-batch never holds its [T, V] float32 logits: at T = 24,576 and Qwen3's V = 151,936 they would
be 14.9 GB; a 1,024-token chunk is 0.62 GB, recomputed once in the backward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from trainer.attention import VARLEN, varlen_kwargs

# The name under which `trainer.distributed` registers `packed_logprobs` as an FSDP forward method.
PACKED_FORWARD = "bcstack_packed_logprobs"

if TYPE_CHECKING:
    from trainer.data import Sample

# Attention implementations that apply a custom dense 4D mask (see the module docstring).
MASKED_ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa")
PACKED_ATTENTION_IMPLEMENTATIONS = (VARLEN, *MASKED_ATTENTION_IMPLEMENTATIONS)
# Positions per pass through the output head (see the module docstring).
LOGPROB_CHUNK_TOKENS = 1024


def first_fit_pack(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """First-fit decreasing bin packing: bins of indices into `lengths`, each bin's total <= `budget`.

    Items are placed longest first (ties by index) into the first bin with room, opening a new bin
    when none has. Every index appears in exactly one bin; bins are in the order they were opened
    (so the first is the fullest-started) and list their indices in ascending order. First fit never
    leaves two bins both at most half full. Deterministic in its arguments.

    Raises ValueError for a budget < 1, a negative length, or a length over the budget.
    """
    if budget < 1:
        raise ValueError(f"the token budget must be >= 1, got {budget}")
    for index, length in enumerate(lengths):
        if length < 0:
            raise ValueError(f"sample {index} has a negative length ({length})")
        if length > budget:
            raise ValueError(
                f"sample {index} has {length} tokens, more than the micro-batch token budget of {budget}"
            )
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for index in order:
        length = lengths[index]
        for b, load in enumerate(loads):
            if load + length <= budget:
                bins[b].append(index)
                loads[b] += length
                break
        else:
            bins.append([index])
            loads.append(length)
    return [sorted(b) for b in bins]


@dataclass(frozen=True)
class PackedBatch:
    """One micro-batch: several samples concatenated into a single row of T tokens, no padding."""

    input_ids: torch.Tensor  # [1, T] int64
    position_ids: torch.Tensor  # [1, T] int64, 0 at each sample's first token
    loss_mask: torch.Tensor  # [1, T] float32, 1.0 on generated (trained) tokens
    rollout_logprobs: torch.Tensor  # [1, T] float32, aligned to input_ids, 0.0 where loss_mask is 0
    sample_index: torch.Tensor  # [1, T] int64, which entry of `indices` each token belongs to
    indices: tuple[int, ...]  # the packed samples' indices in the list given to `pack`
    slices: tuple[slice, ...]  # slices[k]: sample indices[k]'s tokens in the row

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    @property
    def num_samples(self) -> int:
        return len(self.indices)

    def dense_attention_mask(self) -> torch.Tensor:
        """[1, 1, T, T] bool, True where query t may attend to key s: causal within its own sample.

        Built on demand for the "eager"/"sdpa" route only (T^2 booleans); the varlen route never does.
        """
        owner = self.sample_index[0]
        arange = torch.arange(owner.numel())
        return ((owner[:, None] == owner[None, :]) & (arange[:, None] >= arange[None, :]))[None, None]

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """The attention mask as added to attention scores: 0.0 where allowed, dtype's min elsewhere."""
        allowed = torch.zeros((), dtype=dtype)
        blocked = torch.tensor(torch.finfo(dtype).min, dtype=dtype)
        return torch.where(self.dense_attention_mask(), allowed, blocked)


def _sequence_parts(item: Any) -> tuple[list[int], list[int], list[float]]:
    if hasattr(item, "token_ids"):
        return list(item.token_ids), list(item.loss_mask), list(item.rollout_logprobs)
    # A bare token-id sequence (SFT text, tests): every token after the first is trained on.
    token_ids = [int(t) for t in item]
    return token_ids, [0] + [1] * (len(token_ids) - 1), [0.0] * len(token_ids)


def pack(samples_or_sequences: Sequence[Sample | Sequence[int]], indices: Sequence[int]) -> PackedBatch:
    """Concatenate the samples at `indices` (in that order) into one packed row.

    Items are `Sample`s (anything with aligned `token_ids`, `loss_mask` and `rollout_logprobs`) or
    bare token-id sequences, which get loss mask 1 on every token but the first and zero log-probs.
    """
    if not indices:
        raise ValueError("pack needs at least one sample index")
    if len(set(indices)) != len(indices):
        raise ValueError(f"sample indices repeat in {list(indices)}")
    token_ids: list[int] = []
    loss_mask: list[int] = []
    logprobs: list[float] = []
    positions: list[int] = []
    owner: list[int] = []
    slices: list[slice] = []
    for k, index in enumerate(indices):
        ids, mask, lps = _sequence_parts(samples_or_sequences[index])
        if not ids:
            raise ValueError(f"sample {index} has no tokens")
        if not len(ids) == len(mask) == len(lps):
            raise ValueError(
                f"sample {index}: {len(ids)} token ids, {len(mask)} loss-mask values, "
                f"{len(lps)} rollout log-probs; they must be aligned"
            )
        slices.append(slice(len(token_ids), len(token_ids) + len(ids)))
        token_ids.extend(ids)
        loss_mask.extend(mask)
        logprobs.extend(lps)
        positions.extend(range(len(ids)))
        owner.extend([k] * len(ids))
    return PackedBatch(
        input_ids=torch.tensor([token_ids], dtype=torch.int64),
        position_ids=torch.tensor([positions], dtype=torch.int64),
        loss_mask=torch.tensor([loss_mask], dtype=torch.float32),
        rollout_logprobs=torch.tensor([logprobs], dtype=torch.float32),
        sample_index=torch.tensor([owner], dtype=torch.int64),
        indices=tuple(indices),
        slices=tuple(slices),
    )


def pack_micro_batches(
    samples_or_sequences: Sequence[Sample | Sequence[int]], budget: int
) -> list[PackedBatch]:
    """All samples packed into micro-batches of at most `budget` tokens each (first fit decreasing)."""
    lengths = [len(_sequence_parts(s)[0]) for s in samples_or_sequences]
    return [pack(samples_or_sequences, b) for b in first_fit_pack(lengths, budget)]


def forward_inputs(model: torch.nn.Module, batch: PackedBatch) -> dict[str, Any]:
    """The keyword arguments that run `model` on `batch` with attention inside each sample."""
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation not in PACKED_ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"packed batches need one of the attention implementations "
            f"{', '.join(PACKED_ATTENTION_IMPLEMENTATIONS)}; the model uses {implementation!r}"
        )
    device = next(model.parameters()).device
    inputs: dict[str, Any] = {
        "input_ids": batch.input_ids.to(device),
        "position_ids": batch.position_ids.to(device),
        "use_cache": False,
    }
    if implementation == VARLEN:
        return {**inputs, "attention_mask": None, **varlen_kwargs(batch.position_ids)}
    return {**inputs, "attention_mask": batch.additive_mask(model.dtype).to(device)}


def hidden_states(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """The decoder's last hidden states for the packed row, [T, hidden] (no output head applied)."""
    inputs = forward_inputs(model, batch)
    return model.model(**inputs).last_hidden_state[0]


def _chunk_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden)
    if isinstance(logits, DTensor):
        # Vocab-sharded logits (tensor parallel): under loss_parallel() cross-entropy reduces across
        # the shards, and the [chunk, V] logits never exist whole on one rank.
        return -F.cross_entropy(logits.float(), targets, reduction="none").full_tensor()
    logits = logits.float()
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def token_logprobs(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int = LOGPROB_CHUNK_TOKENS,
) -> torch.Tensor:
    """log softmax(head(hidden[i]))[targets[i]] for each row i, [N] float32, `chunk_tokens` rows at a time.

    With gradients on, each chunk runs under activation checkpointing: its logits are freed after the
    forward and recomputed in the backward, so at most one chunk's [chunk, V] logits exist at a time.
    A tensor-parallel head (vocab-sharded DTensor logits) goes through vocab-parallel cross-entropy;
    the caller runs forward and backward under `loss_parallel()` (`trainer.distributed.Layout.train_context`).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    grad = torch.is_grad_enabled() and hidden.requires_grad
    parts = []
    for s in range(0, hidden.shape[0], chunk_tokens):
        h, t = hidden[s : s + chunk_tokens], targets[s : s + chunk_tokens]
        if grad:
            parts.append(checkpoint(_chunk_logprobs, head, h, t, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(head, h, t))
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)


def packed_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    select: torch.Tensor | None = None,
    chunk_tokens: int = LOGPROB_CHUNK_TOKENS,
) -> torch.Tensor:
    """log p(input_ids[t + 1] | its sample's tokens up to t) for the T - 1 next-token predictions of
    the row, or only those where the bool mask `select` ([T - 1]) is True: [N] float32.

    Predictions across a sample boundary are computed too (the caller masks them; see
    `per_token_logprobs`). The decoder and the output head run in this one call, which
    `trainer.distributed.parallelize` registers with FSDP as a forward method (`PACKED_FORWARD`).
    """
    hidden = hidden_states(model, batch)[:-1]
    targets = batch.input_ids[0, 1:].to(hidden.device)
    if select is not None:
        select = select.to(hidden.device)
        hidden, targets = hidden[select], targets[select]
    return token_logprobs(model.lm_head, hidden, targets, chunk_tokens)


def next_token_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    select: torch.Tensor | None = None,
    chunk_tokens: int = LOGPROB_CHUNK_TOKENS,
) -> torch.Tensor:
    """`packed_logprobs`, through the model's FSDP-hooked forward method when it has one."""
    forward = getattr(model, PACKED_FORWARD, None)
    if forward is None:
        return packed_logprobs(model, batch, select, chunk_tokens)
    return forward(batch, select, chunk_tokens)


def per_token_logprobs(
    model: torch.nn.Module, batch: PackedBatch, chunk_tokens: int = LOGPROB_CHUNK_TOKENS
) -> torch.Tensor:
    """log p(token t | the earlier tokens of its own sample), [1, T] float32, aligned like the samples.

    Position t holds the log-prob of `input_ids[t]`, as a trajectory's rollout log-probs do; a
    sample's first token has no context and gets 0.0 (it is a prompt token, loss mask 0). The model
    is a transformers causal LM (Qwen3) with one of `PACKED_ATTENTION_IMPLEMENTATIONS`; gradients flow
    when the caller has them enabled.
    """
    next_logprobs = next_token_logprobs(model, batch, None, chunk_tokens)
    logprobs = torch.cat([next_logprobs.new_zeros(1), next_logprobs])
    # Across a boundary the "previous token" belongs to another sample: no prediction there.
    starts = batch.position_ids[0].to(logprobs.device) == 0
    return torch.where(starts, torch.zeros_like(logprobs), logprobs)[None]


def sample_token_means(values: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """Per-sample mean of `values` ([1, T] or [T]) over that sample's loss-mask tokens: [num_samples].

    A sample with no trained tokens gets 0.0. Summing these means over a step's micro-batches and
    dividing by the step's total sample count gives the same loss (and gradient) as computing the
    per-sample token mean on the whole batch at once, however the samples were packed.
    """
    values = values.reshape(-1)
    mask = batch.loss_mask.reshape(-1).to(values.device, values.dtype)
    owner = batch.sample_index.reshape(-1).to(values.device)
    sums = values.new_zeros(batch.num_samples).index_add(0, owner, values * mask)
    counts = mask.new_zeros(batch.num_samples).index_add(0, owner, mask)
    return sums / counts.clamp(min=1.0)
