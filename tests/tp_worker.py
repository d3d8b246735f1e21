"""One TP training step on the tiny model, run by tests/test_trainer_tp.py under torchrun.

    torchrun --nproc_per_node 2 --standalone tests/tp_worker.py MODEL_DIR BATCH_FILE OUT_FILE

BATCH_FILE (torch.save) holds `input_ids`, `labels` and `adamw` (AdamW keyword arguments). Every
rank loads the same checkpoint, shards it with trainer.parallel's plan, runs forward,
vocab-parallel loss, backward and one AdamW step; rank 0 writes the gathered (full) logits, loss,
gradients and updated weights, plus each sharded module's local weight shape, to OUT_FILE.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer.parallel import (  # noqa: E402
    apply_tensor_parallel,
    causal_lm_loss,
    init_distributed,
    loss_context,
    tensor_parallel_mesh,
)


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def main(model_dir: str, batch_file: str, out_file: str) -> None:
    from transformers import AutoModelForCausalLM

    env = init_distributed()
    mesh = tensor_parallel_mesh(env)
    batch = torch.load(batch_file)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    apply_tensor_parallel(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), **batch["adamw"])

    logits = model(input_ids=batch["input_ids"], use_cache=False).logits
    with loss_context(logits):
        loss = causal_lm_loss(logits, batch["labels"])
        loss.backward()
    result = {
        "backend": env.backend,
        "world_size": env.world_size,
        "logits_type": type(logits).__name__,
        "logits": full(logits),
        "loss": full(loss),
        "grads": {name: full(p.grad) for name, p in model.named_parameters()},
        "local_shapes": {
            name: tuple((p.to_local() if isinstance(p, DTensor) else p).shape)
            for name, p in model.named_parameters()
        },
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
    }
    optimizer.step()
    result["weights"] = {name: full(p) for name, p in model.named_parameters()}
    if env.is_main:
        torch.save(result, out_file)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
