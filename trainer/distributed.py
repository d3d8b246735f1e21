"""One training step for every layout: a `[dp, tp]` device mesh, TP by plan, FSDP2 on dp (issue 16).

Under `torchrun` the trainer commands build a 2-D mesh, `dp = world size / tp`, as torchtitan does
(`torchtitan/distributed/parallel_dims.py`, `models/llama3/infra/parallelize.py`):

- the "tp" dimension shards every decoder layer, the embedding and the output head by the
  declarative plan of `trainer.parallel` (`parallelize_module`);
- the "dp" dimension shards parameters, gradients and optimizer state with FSDP2 (`fully_shard`):
  one FSDP unit per decoder layer (its all-gather overlaps the previous layer's compute) and one for
  the root (embedding, final norm and the tied output head, which must share a unit);
- one process is the same code with `dp = tp = 1` and no mesh: every helper here is then the
  identity, so the step code (`trainer.grpo.grpo_step`, `trainer.sft.sft_step`) never asks whether
  it is distributed.

What the step needs from the layout, and why:

- `schedule`: every dp rank runs the same number of micro-batches (FSDP's collectives are matched
  call for call; slime's dynamic batching makes the same demand). The micro-batches of an update
  are dealt to the dp ranks longest first onto the rank with the fewest tokens; a rank left with
  fewer gets "padding" slots, a re-run of one of its own micro-batches with loss scale 0.
- Gradients are SUMMED over dp (`set_gradient_divide_factor(1)`): each rank's losses are already
  scaled by its share of the whole update's normaliser, so the sum is the full batch's gradient,
  as one process computes it.
- `sum_over_dp`: the step's statistics (loss, token counts) are added up across dp ranks; tp
  ranks within a dp group hold identical (replicated) values.
- `grad_norm_clip`: the global L2 norm over DTensor gradients of several meshes (TP-sharded
  weights live on [dp, tp], norms on [dp]), then the same clip as `clip_grad_norm_`.
- `train_context`: `loss_parallel()` when tp > 1, around forward AND backward (its backward kernels
  are swapped in by the context), so the vocab-sharded logits are never gathered on one rank.
- `PACKED_FORWARD`: the trainer runs the decoder and the chunked output head as one call
  (`trainer.packing.packed_logprobs`, attached to the model as that method), not through
  `forward`; `register_fsdp_forward_method` makes FSDP's root unit all-gather and reduce-scatter
  around that call too.

Not here: pipeline parallelism and context parallelism (a 24,576-token trajectory fits one rank
with the varlen attention of `trainer.attention`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from trainer.layout import check_layout, requested_world_size
from trainer.packing import PACKED_FORWARD, packed_logprobs
from trainer.parallel import DistributedEnv, apply_tensor_parallel, init_distributed

DP_MESH_DIM = "dp"
TP_MESH_DIM = "tp"

T = TypeVar("T")  # a micro-batch


@dataclass(frozen=True)
class Layout:
    """Where this process sits in the [dp, tp] mesh; one process is dp = tp = 1 with no mesh."""

    env: DistributedEnv
    dp: int = 1
    tp: int = 1
    mesh: DeviceMesh | None = None

    @classmethod
    def single(cls) -> Layout:
        """One process on the CPU or the first GPU: no mesh, every collective the identity."""
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return cls(DistributedEnv(0, 1, 0, None, device))

    @property
    def is_main(self) -> bool:
        """Rank 0 alone writes metrics, logs and exports."""
        return self.env.rank == 0

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank(DP_MESH_DIM) if self.mesh is not None else 0

    @property
    def device(self) -> torch.device:
        return self.env.device

    def describe(self) -> str:
        backend = self.env.backend or "one process"
        return f"world {self.env.world_size} = dp {self.dp} x tp {self.tp} ({backend})"

    def train_context(self) -> AbstractContextManager[None]:
        """Wrap a step's forward and backward: vocab-parallel cross-entropy when tp > 1."""
        return loss_parallel() if self.tp > 1 else nullcontext()

    def schedule(self, items: Sequence[T], sizes: Sequence[int]) -> list[tuple[T, bool]]:
        """This dp rank's share of `items` (micro-batches of `sizes` tokens) as (item, real) pairs,
        by `dp_schedule`: a slot with `real` False is padding, to be run with loss scale 0."""
        return [(items[i], real) for i, real in dp_schedule(sizes, self.dp)[self.dp_rank]]

    def sum_over_dp(self, values: Sequence[float]) -> list[float]:
        """Each value summed over the dp ranks (the identity for dp = 1)."""
        if self.dp == 1 or self.mesh is None:
            return [float(v) for v in values]
        # On the rank's device: NCCL reduces CUDA tensors only.
        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, group=self.mesh.get_group(DP_MESH_DIM))
        return tensor.tolist()

    def max_over_world(self, value: float) -> float:
        if self.env.world_size == 1:
            return value
        tensor = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return float(tensor.item())

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank, pickled (the RL loop's samples and credit: a few MB)."""
        if self.env.world_size == 1:
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]

    def barrier(self) -> None:
        if self.env.world_size > 1:
            dist.barrier()

    def close(self) -> None:
        """Leave the torchrun job cleanly (destroys the process group; nothing for one process)."""
        if self.env.world_size > 1 and dist.is_initialized():
            # Every rank past its last collective before any tears down: a gloo rank that destroyed
            # its group and exited while its peer was still in one killed the peer with
            # "terminate called without an active exception" (SIGABRT), once in a two-worker suite.
            dist.barrier()
            dist.destroy_process_group()


def dp_schedule(sizes: Sequence[int], dp: int) -> list[list[tuple[int, bool]]]:
    """Which micro-batches (indices into `sizes`, their token counts) each of `dp` ranks runs.

    Every rank gets the same number of slots, ceil(len / dp); the micro-batches are dealt longest
    first to the rank with the fewest tokens so far (ties: lower rank) that still has a free slot,
    and each rank runs its own in index order. A rank left with fewer fills its slots with padding,
    (index, False): a re-run of its first micro-batch (of micro-batch 0 for a rank that got none)
    with loss scale 0. Deterministic, so every rank computes the whole plan and no message is needed.
    """
    if not sizes:
        return [[] for _ in range(dp)]
    slots = math.ceil(len(sizes) / dp)
    plans: list[list[int]] = [[] for _ in range(dp)]
    loads = [0] * dp
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min((r for r in range(dp) if len(plans[r]) < slots), key=lambda r: (loads[r], r))
        plans[rank].append(index)
        loads[rank] += sizes[index]
    schedule = []
    for plan in plans:
        mine = sorted(plan)
        pad = mine[0] if mine else 0
        schedule.append([(i, True) for i in mine] + [(pad, False)] * (slots - len(mine)))
    return schedule


class Followers:
    """A job whose rank 0 runs an outer loop (the RL loop: rollouts, grading, reloads) and whose other
    ranks only take part in its training collectives.

    Before each collective step rank 0 calls `send(op, *args)`; every other rank sits in `serve` and
    makes the same call with the same arguments (samples, credit: pickled by `broadcast_object_list`),
    so every collective is matched. `send("stop")` ends `serve`. One process: `send` does nothing.
    """

    STOP = "stop"

    def __init__(self, layout: Layout) -> None:
        self.layout = layout

    def send(self, op: str, *args: Any) -> None:
        if self.layout.env.world_size > 1 and self.layout.is_main:
            self.layout.broadcast((op, args))

    def serve(self, handlers: Mapping[str, Callable[..., Any]]) -> None:
        while True:
            op, args = self.layout.broadcast(None)
            if op == self.STOP:
                return
            handlers[op](*args)


def init_layout(tp: int = 1) -> Layout:
    """Join the torchrun job (if any) and build its [dp, tp] mesh; one process gets dp = tp = 1."""
    world_size = requested_world_size()
    dp = check_layout(world_size, tp)
    env = init_distributed()
    if env.world_size == 1:
        return Layout(env)
    mesh = init_device_mesh(env.device.type, (dp, tp), mesh_dim_names=(DP_MESH_DIM, TP_MESH_DIM))
    return Layout(env, dp=dp, tp=tp, mesh=mesh)


def parallelize(model: nn.Module, layout: Layout) -> nn.Module:
    """Shard `model` (a Qwen3 causal LM, the same weights on every rank) for `layout`, in place.

    TP by `trainer.parallel`'s plan on the "tp" mesh dimension, then FSDP2 on "dp": a unit per
    decoder layer and the root. Call before building the optimizer (it must see the sharded
    parameters). A frozen model (the KL reference) is sharded the same way.
    """
    # The trainer's one-call forward (decoder + chunked head) as a method FSDP can hook.
    setattr(model, PACKED_FORWARD, packed_logprobs.__get__(model))
    if layout.mesh is None:
        return model
    check_layout(layout.env.world_size, layout.tp, model.config)
    if layout.tp > 1:
        apply_tensor_parallel(model, layout.mesh[TP_MESH_DIM])
    if layout.dp > 1:
        from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

        dp_mesh = layout.mesh[DP_MESH_DIM]
        for block in model.model.layers:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
        register_fsdp_forward_method(model, PACKED_FORWARD)
        for unit in model.modules():  # each unit keeps its own setting
            if isinstance(unit, FSDPModule):
                # Sum, not mean, over dp: each rank scales its losses by its share of the global normaliser.
                unit.set_gradient_divide_factor(1.0)
                # Plain SUM collectives, not NCCL PreMulSum: gloo has none, and a factor 1 needs no scaling.
                unit.set_force_sum_reduction_for_comms(True)
    return model


def _group_key(tensor: torch.Tensor) -> Any:
    if isinstance(tensor, DTensor):
        return (tensor.device_mesh, tuple(tensor.placements))
    return None


def grad_norm_clip(parameters: Iterable[torch.Tensor], max_norm: float) -> float:
    """The global L2 norm of the gradients (before clipping), and clip them to `max_norm` in place.

    The same as `torch.nn.utils.clip_grad_norm_` for plain tensors; for DTensor gradients on
    different meshes (which `clip_grad_norm_` cannot stack) the norm is taken per (mesh, placements)
    group, gathered to a plain number and combined.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    groups: dict[Any, list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault(_group_key(grad), []).append(grad)
    squares = 0.0
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares += float(norm) ** 2
    total = math.sqrt(squares)
    coefficient = min(1.0, max_norm / (total + 1e-6))  # clip_grad_norm_'s formula
    if coefficient < 1.0:
        for grad in grads:
            grad.mul_(coefficient)
    return total


def silent(_: str) -> None:
    """The `say` of ranks other than 0: one log per job, not one per rank."""


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer as a full plain tensor (all ranks take part; cheap for one process)."""
    return {
        name: (value.full_tensor() if isinstance(value, DTensor) else value).detach()
        for name, value in model.state_dict().items()
    }
