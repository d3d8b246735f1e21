"""Dynamic batches packed by a token budget (DESIGN.md §5), and log-probs computed on them.

An RL step's samples (worker trajectories of a few hundred to ~25K tokens) are packed, without
padding, into micro-batches: each micro-batch is ONE row of concatenated samples whose total length
stays under a token budget. Inside the row,

- position ids restart at 0 for each sample, so RoPE sees each sample as if it ran alone;
- the attention mask is block-diagonal causal: a token attends to earlier tokens of its own sample
  only, never across a sample boundary.

With both, a sample's log-probs in a packed row equal its log-probs computed alone (the tests pin
this), so packing changes the cost of a step, not its result. Rows have different lengths and are
never padded: a micro-batch is exactly its samples' tokens, and no padding appears anywhere.

    bins = first_fit_pack([len(s) for s in samples], budget=8192)
    for batch in (pack(samples, b) for b in bins):
        logp = per_token_logprobs(model, batch)                       # [1, T], aligned like the samples
        loss = -sample_token_means(logp, batch).sum() / len(samples)  # per-sample token mean
        loss.backward()                                               # accumulates the full-batch grad

Attention mask format. `PackedBatch.attention_mask` is a boolean [1, 1, T, T] tensor (True: the
query token may attend to the key token). transformers 5 passes a 4D mask to the attention function
as is (`masking_utils._preprocess_mask_arguments` returns early on `ndim == 4`), and what the
function does with it differs: "sdpa" gives it to `scaled_dot_product_attention`, which accepts a
boolean or an additive mask, but "eager" ADDS it to the attention scores, so a boolean mask there
would add 0/1 and silently attend across samples. `per_token_logprobs` therefore always passes the
additive float form (0 where allowed, the dtype's minimum elsewhere; `additive_mask`), which is right
for both. Other implementations (flash_attention_2, flex_attention) do not take a dense 4D mask and
are refused; at production lengths a varlen kernel driven by the restarting position ids is the
memory-sane route (a dense T x T mask at T = 24K is 2.4 GB in float32).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from trainer.data import Sample

# Attention implementations that apply a custom dense 4D mask (see the module docstring).
MASKED_ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa")


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
    attention_mask: torch.Tensor  # [1, 1, T, T] bool, True where query t may attend to key s
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

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """The attention mask as added to attention scores: 0.0 where allowed, dtype's min elsewhere."""
        allowed = torch.zeros((), dtype=dtype)
        blocked = torch.tensor(torch.finfo(dtype).min, dtype=dtype)
        return torch.where(self.attention_mask, allowed, blocked)


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
    sample_index = torch.tensor(owner, dtype=torch.int64)
    arange = torch.arange(len(token_ids))
    same_sample = sample_index[:, None] == sample_index[None, :]
    causal = arange[:, None] >= arange[None, :]
    return PackedBatch(
        input_ids=torch.tensor([token_ids], dtype=torch.int64),
        position_ids=torch.tensor([positions], dtype=torch.int64),
        attention_mask=(same_sample & causal)[None, None],
        loss_mask=torch.tensor([loss_mask], dtype=torch.float32),
        rollout_logprobs=torch.tensor([logprobs], dtype=torch.float32),
        sample_index=sample_index[None],
        indices=tuple(indices),
        slices=tuple(slices),
    )


def pack_micro_batches(
    samples_or_sequences: Sequence[Sample | Sequence[int]], budget: int
) -> list[PackedBatch]:
    """All samples packed into micro-batches of at most `budget` tokens each (first fit decreasing)."""
    lengths = [len(_sequence_parts(s)[0]) for s in samples_or_sequences]
    return [pack(samples_or_sequences, b) for b in first_fit_pack(lengths, budget)]


def per_token_logprobs(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """log p(token t | the earlier tokens of its own sample), [1, T] float32, aligned like the samples.

    Position t holds the log-prob of `input_ids[t]`, as a trajectory's rollout log-probs do; a
    sample's first token has no context and gets 0.0 (it is a prompt token, loss mask 0). The model
    is a transformers causal LM (Qwen3) using "eager" or "sdpa" attention; gradients flow when the
    caller has them enabled.
    """
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation not in MASKED_ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"packed batches need an attention implementation that applies a 4D mask "
            f"({' or '.join(MASKED_ATTENTION_IMPLEMENTATIONS)}); the model uses {implementation!r}"
        )
    device = next(model.parameters()).device
    output = model(
        input_ids=batch.input_ids.to(device),
        position_ids=batch.position_ids.to(device),
        attention_mask=batch.additive_mask(model.dtype).to(device),
        use_cache=False,
    )
    logits = output.logits[0, :-1].float()  # [T-1, V]: logits[t] predicts token t+1
    targets = batch.input_ids[0, 1:].to(device)
    next_logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    logprobs = torch.cat([next_logprobs.new_zeros(1), next_logprobs])
    # Across a boundary the "previous token" belongs to another sample: no prediction there.
    starts = batch.position_ids[0].to(device) == 0
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
