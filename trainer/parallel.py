"""Megatron-style tensor parallelism for the Qwen3 causal LM (DESIGN.md §5), as a declarative plan.

The model stays the stock `transformers` Qwen3ForCausalLM; how it is sharded is the data in
`QWEN3_TP_PLAN` (module path pattern → `ParallelStyle`), applied by `parallelize_module` over a
1-D DeviceMesh, as torchtitan does:

- q/k/v and gate/up projections are column-parallel (output features split: each rank owns
  whole attention heads and a slice of the MLP), o/down projections are row-parallel (input
  features split; their partial outputs are all-reduced). One all-reduce per attention block and
  one per MLP in the forward, one each in the backward: the Megatron f/g pair.
- The embedding is vocab-parallel (`RowwiseParallel` on `nn.Embedding`: rows split, token ids
  replicated, out-of-shard ids masked, outputs all-reduced). `lm_head` is column-parallel with
  its output left as a DTensor sharded on the vocabulary, for a vocab-parallel cross entropy
  (`loss_parallel()`, see `causal_lm_loss`): the full (tokens × vocab) logits never exist on
  one rank. Both shard the vocabulary dimension (dim 0) of the weight, so Qwen3's tied
  embedding stays one parameter; `apply_tensor_parallel` re-ties it after sharding.
- q_norm/k_norm (RMSNorm over head_dim, one weight shared by all heads) stay replicated.
  Each rank sees only its own heads, so each rank's gradient for that shared weight is a partial
  sum; `SequenceParallel(sequence_dim=2)` on the (batch, seq, heads, head_dim) input says so
  (heads sharded, weight `Replicate`), and DTensor all-reduces the weight's gradient. The other
  norms see replicated activations and need nothing.

Heads: transformers 5's Qwen3Attention reshapes with `(*input_shape, -1, head_dim)` and its GQA
ratio `num_key_value_groups` is unchanged when query and KV heads are split alike, so the local
head counts follow from the local projection widths and no attribute needs changing. Older
attention modules that store `num_heads`/`num_key_value_heads` get them divided by the TP size
(torchtitan's `n_heads // tp`); tests/test_trainer_tp.py checks TP=2 against TP=1 either way.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

TP_MESH_DIM = "tp"

# Patterns are matched per path component with fnmatch by `parallelize_module`.
QWEN3_TP_PLAN: Mapping[str, ParallelStyle] = {
    "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
    "model.layers.*.self_attn.q_proj": ColwiseParallel(),
    "model.layers.*.self_attn.k_proj": ColwiseParallel(),
    "model.layers.*.self_attn.v_proj": ColwiseParallel(),
    "model.layers.*.self_attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
    "model.layers.*.self_attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
    "model.layers.*.self_attn.o_proj": RowwiseParallel(),
    "model.layers.*.mlp.gate_proj": ColwiseParallel(),
    "model.layers.*.mlp.up_proj": ColwiseParallel(),
    "model.layers.*.mlp.down_proj": RowwiseParallel(),
    "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
}

# Per-rank head counts some attention implementations keep as attributes (not transformers 5's).
LOCAL_HEAD_ATTRIBUTES = ("num_heads", "num_key_value_heads")


@dataclass(frozen=True)
class DistributedEnv:
    """Where this process sits in a torchrun job; world_size 1 and no process group outside one."""

    rank: int
    world_size: int
    local_rank: int
    backend: str | None
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> DistributedEnv:
    """Join the torchrun job from its env (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).

    NCCL with one GPU per local rank when CUDA is available, gloo on the CPU otherwise. Outside
    torchrun (no WORLD_SIZE) nothing is initialised and a single-process env is returned.
    Idempotent: a process group that already exists is reused.
    """
    cuda = torch.cuda.is_available()
    if "WORLD_SIZE" not in os.environ:
        return DistributedEnv(0, 1, 0, None, torch.device("cuda" if cuda else "cpu"))
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if cuda else "gloo",
            rank=rank,
            world_size=world_size,
            device_id=device if cuda else None,
        )
    return DistributedEnv(rank, world_size, local_rank, dist.get_backend(), device)


def tensor_parallel_mesh(env: DistributedEnv, tp_size: int | None = None) -> DeviceMesh:
    """A 1-D mesh named "tp" over `tp_size` ranks (default: the whole job)."""
    return init_device_mesh(env.device.type, (tp_size or env.world_size,), mesh_dim_names=(TP_MESH_DIM,))


def _check_divisible(model: nn.Module, tp_size: int) -> None:
    config = model.config
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
    }
    uneven = {name: size for name, size in sizes.items() if size % tp_size}
    if uneven:
        raise ValueError(f"tensor parallel size {tp_size} does not divide {uneven}")


def apply_tensor_parallel(
    model: nn.Module, mesh: DeviceMesh, plan: Mapping[str, ParallelStyle] = QWEN3_TP_PLAN
) -> nn.Module:
    """Shard `model` (a Qwen3ForCausalLM) in place over the 1-D `mesh` by `plan`; returns it.

    Weights must already be identical on every rank (same checkpoint or same seed): each rank keeps
    its own slice of its own copy. Afterwards sharded parameters are DTensors (`full_tensor()`
    gathers one) and the logits are a DTensor sharded on the vocabulary.
    """
    tp_size = mesh.size()
    _check_divisible(model, tp_size)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    parallelize_module(model, mesh, dict(plan))
    if tied:
        embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
        if isinstance(embedding.weight, DTensor) and embedding.weight.placements != head.weight.placements:
            raise ValueError("the plan shards the tied embedding and lm_head differently")
        head.weight = embedding.weight  # parallelize_module gave each module its own copy
    for module in model.modules():
        if hasattr(module, "q_proj"):  # an attention block
            for name in LOCAL_HEAD_ATTRIBUTES:
                if isinstance(getattr(module, name, None), int):
                    setattr(module, name, getattr(module, name) // tp_size)
    return model


def loss_context(logits: torch.Tensor) -> AbstractContextManager[None]:
    """`loss_parallel()` for vocab-sharded DTensor logits, a no-op for plain ones.

    The forward loss *and* its `backward()` must run inside it (its backward kernels are swapped in
    by the context): `with loss_context(logits): causal_lm_loss(logits, ids).backward()`.
    """
    return loss_parallel() if isinstance(logits, DTensor) else nullcontext()


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross entropy: position t predicts labels[t + 1]; `ignore_index` is skipped.

    Takes plain logits or vocab-sharded DTensor logits (then call it under `loss_context`); the
    result is a plain scalar or a replicated DTensor scalar with the same value.
    """
    vocab = logits.shape[-1]
    shifted = logits[:, :-1, :].reshape(-1, vocab)
    targets = labels[:, 1:].reshape(-1).to(shifted.device)
    return F.cross_entropy(shifted.float(), targets, ignore_index=ignore_index)
