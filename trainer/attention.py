"""Attention that stays inside each packed sample, with no T x T mask (the trainer's default).

A packed micro-batch (`trainer.packing`) is one row of several samples. The dense route gives the
model a [1, 1, T, T] block-diagonal causal mask: O(T^2) memory (2.4 GB in float32 at the episode
budget of 24,576 tokens) and, worse, attention over all T^2 / 2 query-key pairs although only
sum_i T_i^2 / 2 belong to a sample (4.05x more at a 2,048-token budget in `bench/`).

`varlen_attention_forward` instead takes the samples' cumulative lengths (`cu_seq_lens_q`, the
name transformers' flash-attention path uses for the same thing) and runs causal
`scaled_dot_product_attention` on each sample's slice of the row: no mask tensor at all, and the
kernel's own causal path (flash attention on CPU and CUDA) does only the pairs a sample needs.
A sample's output is bit-for-bit what it would be alone in its own row, which is what packing
promises (tests/test_packing.py).

It is registered with transformers' `AttentionInterface` under `VARLEN` (the documented way to
add an attention function; masks are not built for a name the mask interface does not know, so
nothing T x T is ever allocated). transformers' own packed-sequence detection was not used: for
"sdpa" it turns the restarting position ids into the same dense 4D mask, and its varlen kernels
(flash_attention_2/3) exist only on CUDA. On a GPU with flash-attn installed, its varlen kernel
takes the same `cu_seq_lens_*` arguments and would replace the per-sample loop.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

VARLEN = "bcstack_varlen"


def varlen_kwargs(position_ids: torch.Tensor) -> dict[str, Any]:
    """cu_seq_lens_q/k and max_length_q/k of a packed row from its restarting position ids ([1, T])."""
    if position_ids.dim() != 2 or position_ids.shape[0] != 1:
        raise ValueError(f"a packed row has position ids of shape [1, T], got {list(position_ids.shape)}")
    positions = position_ids[0]
    starts = torch.nonzero(positions == 0).flatten()
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError("a packed row's position ids must start at 0")
    cu = torch.cat([starts, starts.new_tensor([positions.numel()])]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention per packed sample: query [1, H, T, D], key/value [1, H_kv, T, D] -> [1, T, H, D]."""
    if cu_seq_lens_q is None:
        raise ValueError(f"{VARLEN} attention needs cu_seq_lens_q (trainer.attention.varlen_kwargs)")
    if cu_seq_lens_k is not None and not torch.equal(cu_seq_lens_k, cu_seq_lens_q):
        raise ValueError(f"{VARLEN} attention is self-attention: cu_seq_lens_k must equal cu_seq_lens_q")
    if attention_mask is not None:
        raise ValueError(f"{VARLEN} attention takes sample boundaries, not an attention mask")
    if sliding_window is not None:
        raise ValueError(f"{VARLEN} attention does not implement sliding windows")
    if query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        raise ValueError(f"{VARLEN} attention expects one packed row without a KV cache")
    gqa = query.shape[1] != key.shape[1]
    bounds = cu_seq_lens_q.tolist()
    if bounds[0] != 0 or bounds[-1] != query.shape[2]:
        raise ValueError(f"cu_seq_lens_q {bounds} does not span the row's {query.shape[2]} tokens")
    parts = [
        F.scaled_dot_product_attention(
            query[:, :, s:e],
            key[:, :, s:e],
            value[:, :, s:e],
            dropout_p=dropout,
            is_causal=True,
            scale=scaling,
            enable_gqa=gqa,
        )  # fmt: skip
        for s, e in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(VARLEN, varlen_attention_forward)
