"""A copy-inducing stage for a model trained from scratch, before SFT (`bcstack train copy`).

Seed 001 fine-tunes a pretrained Qwen3-4B, which can already copy a name from its context. A tiny
model initialised at random cannot, and SFT on expert trajectories alone does not teach it in the
time a CPU has: it learns the call format perfectly and then memorises training names instead of
copying the question's (held-out loss flat while training loss falls; measured in issue #15's
probes). Copying in-context is what induction heads do (Olsson et al., 2022, "In-context Learning
and Induction Heads"), and they form fastest on the task that needs nothing else: a random token
sequence followed by itself, with the loss on the repeat, where only copying lowers the loss below
log(vocabulary). nanochat starts its chat stages from a base model for the same reason; this stage
is the smallest base model that has the one skill the worker's job needs.

    copy_pretrain(Path("tiny"), Path("base"), steps=800)   # writes an HF model folder to base/

Sequences are `batch` rows of `span` random ids (drawn from the tokenizer's learned vocabulary,
not the added chat tokens) followed by the same ids again; the loss is the cross-entropy of the
second copy's tokens after its first. Progress reports the copy accuracy (argmax == the token to
copy) on each batch, which jumps from ~0 to near 1 when the heads form.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


def copy_batch(generator: torch.Generator, vocab: int, batch: int, span: int) -> torch.Tensor:
    """[batch, 2*span] ids: random ids, then the same ids again."""
    first = torch.randint(0, vocab, (batch, span), generator=generator)
    return torch.cat([first, first], dim=1)


def copy_loss(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Cross-entropy of the repeat's tokens (each predicted from the one before), and the accuracy."""
    span = ids.shape[1] // 2
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[:, span:-1]
    logits = model.lm_head(hidden).float()
    targets = ids[:, span + 1 :]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    accuracy = float((logits.argmax(-1) == targets).float().mean())
    return loss, accuracy


def copy_pretrain(
    model_dir: Path,
    out_dir: Path,
    *,
    steps: int,
    lr: float = 2e-3,
    batch: int = 32,
    span: int = 64,
    warmup: int = 30,
    seed: int = 0,
    on_step: Callable[[int, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Train `steps` copy steps from `model_dir` and save the model (and its tokenizer) to `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.sft import SFTConfig, make_optimizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab = len(tokenizer) - len(tokenizer.get_added_vocab())
    optimizer = make_optimizer(model, SFTConfig(lr=lr))
    generator = torch.Generator().manual_seed(seed)
    model.train()
    started = time.perf_counter()
    stats: dict[str, Any] = {}
    for step in range(1, steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, step / warmup)
        loss, accuracy = copy_loss(model, copy_batch(generator, vocab, batch, span))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        stats = {
            "step": step,
            "loss": float(loss.detach()),
            "copy_accuracy": accuracy,
            "lr": optimizer.param_groups[0]["lr"],
        }
        if on_step is not None:
            on_step(step, stats)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    for path in Path(model_dir).iterdir():  # the tokenizer files as they are, not re-serialised
        if path.is_file() and (path.name.startswith("tokenizer") or path.name == "special_tokens_map.json"):
            shutil.copy2(path, out_dir / path.name)
    return {**stats, "seconds": time.perf_counter() - started, "tokens": steps * batch * 2 * span}
