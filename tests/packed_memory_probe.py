"""Peak memory of one training forward + backward on a 24,576-token packed micro-batch, run by
tests/test_trainer_packing.py in a fresh process (so the peak RSS is this step's alone):

    python tests/packed_memory_probe.py MODEL_DIR ATTENTION

Prints one JSON line: tokens, the RSS before the step, the process's peak RSS after it (bytes),
and the loss (finite). ATTENTION is the trainer's varlen route or "sdpa" (the dense-mask route).
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.budget import BudgetLimits  # noqa: E402
from trainer.packing import pack, per_token_logprobs  # noqa: E402

LENGTHS = (12_000, 6_000, 4_000, 2_576)  # one episode-budget micro-batch: 24,576 tokens


def rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * resource.getpagesize()


def main(model_dir: str, attention: str) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=attention
    )
    model.train()
    assert sum(LENGTHS) == BudgetLimits().max_tokens
    vocab = model.config.vocab_size
    rows = [torch.randint(0, vocab, (n,)).tolist() for n in LENGTHS]
    batch = pack(rows, list(range(len(rows))))
    before = rss_bytes()
    logprobs = per_token_logprobs(model, batch)
    loss = -(logprobs * batch.loss_mask).sum() / batch.loss_mask.sum()
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(json.dumps({"tokens": batch.num_tokens, "rss_before": before, "peak": peak, "loss": float(loss)}))


if __name__ == "__main__":
    main(*sys.argv[1:])
