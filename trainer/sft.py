"""Supervised fine-tuning, seed 001's recipe: one epoch of a token-balanced mixture (DESIGN.md §9).

Read top to bottom, a run is:

1. mixture  the sources' rows (`trainer.sft_data`), repeated or sampled to a supervised-token target,
            shuffled with seed 42; the epoch is ``floor(rows / global batch)`` steps, as Miles
            computes it (seed 001: 43,760 rows / 32 = 1,367 rollout slots), so the last partial
            batch is not trained on;
2. step     32 rows per step, packed into micro-batches under a token budget (`trainer.packing`:
            one row per micro-batch, block-diagonal causal attention, positions restarting per
            sample); the loss is the cross-entropy of every supervised token, averaged over the
            step's supervised tokens (Megatron's per-token loss), so a long trajectory weighs by its
            tokens, not as one sample; the gradient norm is clipped at 1.0 and AdamW takes one step;
3. schedule linear warm-up over the first 10% of the steps to LR 1e-5, then cosine to 1e-6;
            AdamW weight decay 0.1 (not on 1-D parameters, as Megatron), betas (0.9, 0.95);
4. keep     a crash-safe checkpoint (`trainer.checkpoint`) every `checkpoint_every` steps and at the
            end, the metrics of every step through `on_metrics`, the final model exported in the
            serving format (`trainer.export`: BF16, trimmed vocabulary, SHA256SUMS).

Every number above is an `SFTConfig` field, overridable for small models: a model trained from
scratch wants a learning rate a hundred times seed 001's, which fine-tunes a pretrained 4B.

The logits are computed only where a token is supervised: the LM head and the cross-entropy over the
vocabulary are most of a tiny model's cost per token, and an SFT row supervises ~10% of its tokens.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from trainer.distributed import Layout, grad_norm_clip, parallelize, silent
from trainer.packing import PackedBatch, next_token_logprobs, pack_micro_batches
from trainer.sft_data import Mixture, SFTSample

CHECKPOINTS_DIR = "checkpoints"
SERVING_DIR = "serving"


class SFTError(ValueError):
    """A run that cannot start or continue; the message says what to change."""


@dataclass(frozen=True)
class SFTConfig:
    """Seed 001's settings (Miles on Qwen3-4B); every one can be overridden."""

    lr: float = 1e-5
    min_lr: float = 1e-6
    warmup_fraction: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    global_batch: int = 32
    micro_batch_tokens: int = 8192
    epochs: float = 1.0
    grad_clip: float = 1.0
    seed: int = 42
    checkpoint_every: int = 50

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def epoch_steps(rows: int, config: SFTConfig) -> int:
    """Optimizer steps of the run: floor(rows x epochs / global batch), Miles' epoch length."""
    return int(rows * config.epochs) // config.global_batch


def row_order(rows: int, needed: int, seed: int) -> list[int]:
    """Row indices for `needed` slots: the mixture's own (shuffled) order first, then a new seeded
    permutation for each further pass (`epochs` > 1), so no pass repeats the previous one's order."""
    import random

    order = list(range(rows))
    rng = random.Random(seed)
    while len(order) < needed:
        again = list(range(rows))
        rng.shuffle(again)
        order += again
    return order[:needed]


def lr_at(step: int, total_steps: int, config: SFTConfig) -> float:
    """The learning rate of optimizer step `step` (1-based): linear warm-up, then cosine to min_lr."""
    warmup = math.ceil(config.warmup_fraction * total_steps)
    if step <= warmup:
        return config.lr * step / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return config.min_lr + (config.lr - config.min_lr) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(model: torch.nn.Module, config: SFTConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr,
        betas=config.betas,
    )


def supervised_loss_sum(model: torch.nn.Module, batch: PackedBatch) -> tuple[torch.Tensor, int]:
    """Σ cross-entropy over the batch's supervised tokens, and how many there are.

    Token t is predicted from the hidden state at t-1 of its own sample; a sample's first token is a
    prompt token (mask 0), so no prediction crosses a sample boundary.
    """
    chosen = batch.loss_mask[0, 1:] > 0
    try:
        # Cross-entropy is minus the chosen token's log-prob: the chunked head never holds [T, V] logits.
        logprobs = next_token_logprobs(model, batch, chosen)
    except ValueError as e:
        raise SFTError(str(e)) from None
    return -logprobs.sum(), int(chosen.sum())


def sft_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rows: Sequence[SFTSample],
    *,
    lr: float,
    micro_batch_tokens: int,
    grad_clip: float,
    layout: Layout | None = None,
) -> dict[str, Any]:
    """One optimizer step on `rows`: token-mean cross-entropy over all their supervised tokens.

    Under a [dp, tp] `layout` every dp rank trains its share of the micro-batches (the same number
    on each), scaled by the step's global supervised-token count; FSDP sums the gradients.
    """
    started = time.perf_counter()
    layout = layout or Layout.single()
    model.train()
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    supervised = sum(r.supervised_tokens for r in rows)
    if supervised == 0:
        raise SFTError("a step's rows supervise no token")
    too_long = [r for r in rows if len(r) > micro_batch_tokens]
    if too_long:
        raise SFTError(
            f"{too_long[0].origin}: {len(too_long[0]):,} tokens do not fit --micro-batch-tokens "
            f"{micro_batch_tokens:,}; raise it"
        )
    total = 0.0
    batches = pack_micro_batches(list(rows), micro_batch_tokens)
    with layout.train_context():
        for batch, real in layout.schedule(batches, [b.num_tokens for b in batches]):
            loss_sum, _ = supervised_loss_sum(model, batch)
            (loss_sum * ((1.0 / supervised) if real else 0.0)).backward()  # padding slots: scale 0
            if real:
                total += float(loss_sum.detach())
    (total,) = layout.sum_over_dp([total])
    grad_norm = grad_norm_clip(model.parameters(), grad_clip)
    optimizer.step()
    seconds = layout.max_over_world(time.perf_counter() - started)
    tokens = sum(len(r) for r in rows)
    return {
        "loss": total / supervised,
        "lr": lr,
        "grad_norm": float(grad_norm),
        "rows": len(rows),
        "tokens": tokens,
        "supervised_tokens": supervised,
        "micro_batches": len(batches),
        "step_seconds": seconds,
        "train_tokens_per_s": tokens / seconds,
    }


@torch.no_grad()
def evaluate_loss(
    model: torch.nn.Module,
    rows: Sequence[SFTSample],
    micro_batch_tokens: int,
    layout: Layout | None = None,
) -> float:
    """Token-mean cross-entropy of the supervised tokens of `rows` (held-out rows: the overfitting check)."""
    layout = layout or Layout.single()
    model.eval()
    total, count = 0.0, 0
    batches = pack_micro_batches(list(rows), micro_batch_tokens)
    with layout.train_context():
        for batch, real in layout.schedule(batches, [b.num_tokens for b in batches]):
            loss_sum, n = supervised_loss_sum(model, batch)
            if real:
                total += float(loss_sum)
                count += n
    total, count = layout.sum_over_dp([total, count])
    model.train()
    return total / max(1, count)


def train_sft(
    model_dir: Path,
    mixture: Mixture,
    out_dir: Path,
    *,
    config: SFTConfig = SFTConfig(),
    resume: bool = False,
    max_steps: int | None = None,
    eval_rows: Sequence[SFTSample] = (),
    eval_every: int = 0,
    on_metrics: Callable[[int, dict[str, Any]], None] | None = None,
    on_step: Callable[[int, int, dict[str, Any]], None] | None = None,
    layout: Layout | None = None,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train one epoch of `mixture` from `model_dir`; returns a summary (steps, last metrics, export).

    `max_steps` stops this process after that many steps in all (a later `resume` continues). With
    `resume` the newest checkpoint under OUT/checkpoints is restored (model, optimizer, RNG, step) and
    the mixture must be the one it was trained on (same digest). Under torchrun (`layout`) every
    rank trains its share; `on_metrics`, `on_step` and `say` run on rank 0 only, which alone exports.
    """
    layout = layout or Layout.single()
    if not layout.is_main:
        on_metrics = on_step = None
        say = silent
    from trainer.grpo import export_serving, load_policy

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    total_steps = epoch_steps(len(mixture.rows), config)
    if total_steps < 1:
        raise SFTError(
            f"the mixture has {len(mixture.rows)} rows, fewer than one global batch of "
            f"{config.global_batch}; add rows, raise --epochs or lower --global-batch"
        )
    checkpoints = out_dir / CHECKPOINTS_DIR
    latest = latest_checkpoint(checkpoints)
    if latest is not None and not resume:
        raise SFTError(
            f"{out_dir} already holds checkpoints (latest {latest.name}); pass --resume or a new --out"
        )
    torch.manual_seed(config.seed)
    model = parallelize(load_policy(model_dir, layout.device), layout)
    optimizer = make_optimizer(model, config)
    step = 0
    if latest is not None:
        state = load_checkpoint(latest, model=model, optimizer=optimizer, layout=layout)
        if state["data_cursor"].get("mixture") != mixture.digest():
            raise SFTError(
                f"{latest} was trained on another mixture ({state['data_cursor'].get('mixture')}, now "
                f"{mixture.digest()}): same sources, options and seed are needed to resume"
            )
        step = state["step"]
        say(f"resumed from {latest} (step {step} of {total_steps})")
    if layout.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
    layout.barrier()
    stop_at = total_steps if max_steps is None else min(total_steps, max_steps)
    order = row_order(len(mixture.rows), total_steps * config.global_batch, config.seed)
    metrics: dict[str, Any] = {}
    started = time.perf_counter()
    trained_tokens = 0
    while step < stop_at:
        step += 1
        rows = [mixture.rows[i] for i in order[(step - 1) * config.global_batch : step * config.global_batch]]
        metrics = sft_step(
            model,
            optimizer,
            rows,
            lr=lr_at(step, total_steps, config),
            micro_batch_tokens=config.micro_batch_tokens,
            grad_clip=config.grad_clip,
            layout=layout,
        )
        trained_tokens += metrics["tokens"]
        metrics["step"] = step  # as `bcstack train grpo` names it (the sinks add "update" too)
        metrics["epoch"] = step / total_steps
        if eval_rows and eval_every and (step % eval_every == 0 or step == stop_at):
            metrics["eval_loss"] = evaluate_loss(model, eval_rows, config.micro_batch_tokens, layout)
        if on_metrics is not None:
            on_metrics(step, metrics)
        if on_step is not None:
            on_step(step, total_steps, metrics)
        if step % config.checkpoint_every == 0 or step == stop_at:
            save_checkpoint(
                checkpoints,
                step,
                model=model,
                optimizer=optimizer,
                data_cursor={"mixture": mixture.digest(), "step": step},
                extra={"model": str(model_dir), "config": config.as_dict(), "total_steps": total_steps},
                layout=layout,
            )
    summary: dict[str, Any] = {
        "steps": step,
        "total_steps": total_steps,
        "metrics": metrics,
        "seconds": time.perf_counter() - started,
        "tokens": trained_tokens,
    }
    if step >= total_steps:
        export_started = time.perf_counter()
        summary["export"] = export_serving(model, model_dir, out_dir / SERVING_DIR, layout=layout)
        summary["export_seconds"] = time.perf_counter() - export_started
        summary["serving"] = str(out_dir / SERVING_DIR)
    return summary
