"""Benchmark: the CPU engine's batched decode with the cache `transformers` grows by concatenation
against the one this engine grows in place.

    python bench/engine_decode.py [--repeats 3] [--steps 48] [--results FILE] [--dirty-ok]

Two caches hold a stacked decode batch's keys and values (services/engine/models.py `_stack`):
- `concatenating`: `transformers`' `DynamicLayer`, which the engine used before 2026-12-08: every
  step's `update` is a `torch.cat` of everything cached with the new position, so a step copies the
  whole batch's keys and values, layer by layer;
- `in place` (`_GrowingLayer`): the same tensors kept in buffers with room for `DECODE_ROOM` more
  positions (doubled when full); a step writes its position and hands attention a view.
The tokens and log-probs are the same (tests/test_engine_decode_cache.py checks the second
against one forward pass over each whole sequence); only the copying differs.

Measured: tokens/s of `TransformersModel.decode` after a prefill, for 1 and 16 sequences (16 is
what `make speedrun`'s workers keep in flight) with prompts of 400, 1,500 and 2,800 tokens (a
worker's turns run up to its 2,960-token budget), on two tiny Qwen3 shapes built into a temporary
folder: the test kit's (hidden 64, 2 layers) and `make speedrun`'s (hidden 128, 4 layers).
Variants take turns in every repeat (concatenating, in place, in place, concatenating, ...), on one
torch thread; the table gives each repeat and the medians' ratio.

The table, with the command, commit, machine and date, goes to bench/results/engine_decode.md
(--results); refused from a checkout with uncommitted changes unless --dirty-ok."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from common import Table, print_machine, require_clean_tree, write_results  # noqa: E402

SHAPES = {"test kit (hidden 64, 2 layers)": (64, 2), "speedrun (hidden 128, 4 layers)": (128, 4)}
CASES = ((1, 400), (16, 400), (16, 1500), (16, 2800))  # (sequences, prompt tokens)
VARIANTS = ("concatenating", "in place")


def concatenating_layer() -> type:
    """The cache layer the engine stacked before: `transformers`' own, fed the same tensors."""
    from transformers.cache_utils import DynamicLayer

    class Concatenating(DynamicLayer):
        def __init__(self, keys, values, length: int) -> None:
            super().__init__()
            self.update(keys[:, :, :length].contiguous(), values[:, :, :length].contiguous())

    return Concatenating


def order(repeat: int) -> tuple[str, ...]:
    return VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]


def decode_rate(model, batch: int, prompt: int, steps: int, seed: int) -> float:
    """Tokens/s of `steps` decode steps of `batch` sequences after a prefill of `prompt` tokens."""
    import torch

    from services.engine.protocol import parse_generate_request
    from services.engine.sampling import new_generator
    from services.engine.sequence import Sequence

    rng = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(batch):
        body = {
            "input_ids": torch.randint(10, 4000, (prompt,), generator=rng).tolist(),
            "sampling_params": {
                "temperature": 1.0,
                "top_p": 1.0,
                "max_new_tokens": steps + 2,
                "ignore_eos": True,
            },
        }
        request = parse_generate_request(body)
        seqs.append(Sequence(request, list(request.input_ids), frozenset(), None, new_generator(i)))
    for seq in seqs:
        seq.output_ids.append(model.prefill(seq)[0])
    for seq, (token, _) in zip(seqs, model.decode(seqs), strict=True):  # stacks the batch
        seq.output_ids.append(token)
    start = time.perf_counter()
    for _ in range(steps):
        for seq, (token, _) in zip(seqs, model.decode(seqs), strict=True):
            seq.output_ids.append(token)
    rate = batch * steps / (time.perf_counter() - start)
    for seq in seqs:
        model.release(seq, reusable=False)
    return rate


def measure(repeats: int, steps: int) -> Table:
    from devkit.modelkit.build import build_tiny_kit
    from devkit.modelkit.model import TinyQwen3Shape
    from services.engine import models

    layers = {"concatenating": concatenating_layer(), "in place": models._growing_layer()}
    original = models._growing_layer
    rows = []
    try:
        for shape_name, (hidden, depth) in SHAPES.items():
            with tempfile.TemporaryDirectory() as tmp:
                shape = TinyQwen3Shape(
                    hidden_size=hidden, num_hidden_layers=depth, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=hidden // 4, intermediate_size=3 * hidden,
                )  # fmt: skip
                build_tiny_kit(Path(tmp) / "kit", shape=shape)
                model = models.TransformersModel.load(Path(tmp) / "kit", tokenizer=None)
            for batch, prompt in CASES:
                rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
                for repeat in range(repeats):
                    for name in order(repeat):
                        models._growing_layer = lambda name=name: layers[name]
                        rates[name].append(decode_rate(model, batch, prompt, steps, repeat))
                base, this = (statistics.median(rates[name]) for name in VARIANTS)
                each = [" ".join(f"{r:.0f}" for r in rates[name]) for name in VARIANTS]
                rows.append(
                    [shape_name, batch, prompt, *each, round(base), round(this), round(this / base, 2)]
                )
                print(
                    f"  {shape_name}, {batch} x {prompt} tokens: {base:.0f} -> {this:.0f} tokens/s",
                    flush=True,
                )
    finally:
        models._growing_layer = original
    return Table(
        f"Decode tokens/s after a prefill, {steps} steps, top-p 1, one torch thread",
        ["model", "sequences", "prompt tokens", "concatenating, each repeat", "in place, each repeat",
         "concatenating median", "in place median", "in place / concatenating"],
        rows,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of each variant, alternating")
    parser.add_argument("--steps", type=int, default=48, help="decode steps per run")
    parser.add_argument("--results", type=Path, default=None, help="the results file to write")
    parser.add_argument("--dirty-ok", action="store_true", help="write a report from uncommitted changes")
    args = parser.parse_args(argv)
    if min(args.repeats, args.steps) < 1:
        parser.error("--repeats and --steps must be at least 1")
    require_clean_tree("engine_decode", args.dirty_ok)
    import torch

    torch.set_num_threads(1)
    print_machine()
    path = write_results(
        "engine_decode", [measure(args.repeats, args.steps)], path=args.results, dirty_ok=args.dirty_ok
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
