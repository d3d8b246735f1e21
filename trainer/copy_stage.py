"""A copy-inducing stage for a model trained from scratch, before SFT (run by `make speedrun`).

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

Sequences are `batch` rows of `span` ids followed by the same ids again; the loss is the
cross-entropy of the second copy's tokens after its first. Progress reports the copy accuracy
(argmax == the token to copy) on each batch, which jumps from ~0 to near 1 when the heads form.
The ids are random (drawn from the tokenizer's learned vocabulary, not the added chat tokens) or,
for a `text_fraction` of the rows, windows of a text: random ids are all distinct, so one token of
context says where to copy from, but text repeats its common tokens (` in`, digits, `---`), so
copying it needs the longer match that finding the token after "born in" in a search snippet needs.
Measured in #15's probes on held-out questions (README, "the learning proof").
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


def copy_batch(
    generator: torch.Generator,
    vocab: int,
    batch: int,
    span: int,
    text: torch.Tensor | None = None,
    text_rows: int = 0,
) -> torch.Tensor:
    """[batch, 2*span] ids: `span` ids, then the same ids again. The first `text_rows` rows are
    windows of `text` (a 1-D id tensor longer than `span`), the others random ids below `vocab`."""
    first = torch.randint(0, vocab, (batch, span), generator=generator)
    if text is not None and text_rows:
        starts = torch.randint(0, len(text) - span + 1, (text_rows,), generator=generator)
        first[:text_rows] = torch.stack([text[int(s) : int(s) + span] for s in starts])
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
    texts: Sequence[str] = (),
    text_fraction: float = 0.0,
    on_step: Callable[[int, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Train `steps` copy steps from `model_dir` and save the model (and its tokenizer) to `out_dir`.

    `texts` (documents, joined by newlines and tokenized) supply `text_fraction` of each batch's
    rows; keep them free of the held-out questions' entities (the speedrun uses the fixed toy text
    the tokenizer is trained on)."""
    if not 0.0 <= text_fraction <= 1.0:
        raise ValueError(f"text_fraction must be in [0, 1], got {text_fraction}")
    if text_fraction and not texts:
        raise ValueError("text_fraction > 0 needs texts to copy from")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.sft import SFTConfig, make_optimizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab = len(tokenizer) - len(tokenizer.get_added_vocab())
    text = None
    text_rows = round(batch * text_fraction)
    if text_rows:
        ids = tokenizer("\n".join(texts), add_special_tokens=False, verbose=False)["input_ids"]
        if len(ids) <= span:
            raise ValueError(f"texts hold {len(ids)} tokens; copying needs more than the span ({span})")
        text = torch.tensor(ids)
    optimizer = make_optimizer(model, SFTConfig(lr=lr))
    generator = torch.Generator().manual_seed(seed)
    model.train()
    started = time.perf_counter()
    stats: dict[str, Any] = {}
    for step in range(1, steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, step / warmup)
        loss, accuracy = copy_loss(model, copy_batch(generator, vocab, batch, span, text, text_rows))
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
