"""Benchmark: the CPU engine's sampler, the whole-row way against the one it uses.

    python bench/engine_sampling.py [--repeats 5] [--tokens 2000] [--decode-steps 96]
                                    [--results FILE] [--dirty-ok]

Two samplers draw the next token from the same rows of logits:
- `whole row`: the sampler the engine had before 2026-12-07, as SGLang's torch path
  (`top_k_top_p_min_p_sampling_from_probs_torch`) does it: sort the whole row, zero what top-k,
  top-p and min-p drop, `torch.multinomial` over the vocabulary;
- `this engine` (services/engine/sampling.py `sample_token`): the filters over the `topk` head of
  the row when it holds every survivor (the whole row sorted otherwise), and one uniform number on
  the survivors' cumulative sum.
Both report the temperature-scaled log-prob of the drawn token before filtering, so only the draw
differs (the same distribution; tests/test_engine_sampling.py).

Part 1, the sampler alone: microseconds per token on rows of the tiny kit's vocabulary (4,101)
and Qwen3's (151,936), of a flat distribution (an untrained model) and a peaked one (a trained
model), at the worker's evaluation sampling (temperature 1, top-p 0.95) and the RL rollouts'
(top-p 1). Part 2, the engine's decode: tokens/s of `TransformersModel.decode` on the tiny
Qwen3 (devkit.modelkit, built into a temporary folder) for 1 and 4 sequences of 400 prompt
tokens at top-p 0.95, the sampler swapped in the module that calls it. Variants take turns in
every repeat (whole row, this engine, this engine, whole row, ...), on one torch thread; the
tables give each repeat and the medians' ratio.

The tables, with the command, commit, machine and date, go to bench/results/engine_sampling.md
(--results); refused from a checkout with uncommitted changes unless --dirty-ok."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from common import Table, print_machine, require_clean_tree, write_results  # noqa: E402

VOCABS = {"tiny kit": 4101, "Qwen3": 151936}
SHAPES = {"flat": 0.3, "peaked": 4.0}  # logit scale of standard normal logits
TOP_PS = (0.95, 1.0)


def whole_row_sample(logits, params, generator, banned=()):
    """The previous sampler: SGLang's torch path over the whole sorted row, torch.multinomial (the
    bench samples at temperature 1 with no banned token: the steps before the draw are those of
    `sample_token`, and only the draw is compared)."""
    import torch

    from services.engine.sampling import clamp_logprob

    assert not banned and not params.greedy, "the bench compares sampled draws only"
    logprobs = torch.log_softmax(logits.float() / params.temperature, dim=-1)
    probs = logprobs.exp()
    if params.top_k != -1 or params.top_p < 1.0 or params.min_p > 0.0:
        sorted_probs, order = probs.sort(descending=True)
        drop = torch.zeros_like(sorted_probs, dtype=torch.bool)
        if params.top_k != -1:
            drop[params.top_k :] = True
        if params.top_p < 1.0:
            drop |= sorted_probs.cumsum(0) - sorted_probs > params.top_p
        if params.min_p > 0.0:
            drop |= sorted_probs < sorted_probs[0] * params.min_p
        drop[0] = False
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    token = int(torch.multinomial(probs, 1, generator=generator))
    return token, clamp_logprob(float(logprobs[token]))


def variants() -> dict[str, Callable]:
    from services.engine.sampling import sample_token

    return {"whole row": whole_row_sample, "this engine": sample_token}


def order(repeat: int) -> list[str]:
    names = list(variants())
    return names if repeat % 2 == 0 else names[::-1]


def sampler_alone(repeats: int, tokens: int) -> Table:
    import torch

    from services.engine.protocol import SamplingParams
    from services.engine.sampling import new_generator

    rows = []
    for vocab_name, vocab in VOCABS.items():
        n = tokens if vocab < 10_000 else max(tokens // 10, 50)
        for shape, scale in SHAPES.items():
            logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * scale
            for top_p in TOP_PS:
                params = SamplingParams(temperature=1.0, top_p=top_p)
                times: dict[str, list[float]] = {name: [] for name in variants()}
                for repeat in range(repeats):
                    for name in order(repeat):
                        sample, generator = variants()[name], new_generator(repeat)
                        start = time.perf_counter()
                        for _ in range(n):
                            sample(logits, params, generator)
                        times[name].append((time.perf_counter() - start) / n * 1e6)
                base, this = (statistics.median(times[name]) for name in variants())
                rows.append([
                    f"{vocab_name} ({vocab:,})", shape, top_p,
                    " ".join(f"{t:.0f}" for t in times["whole row"]),
                    " ".join(f"{t:.0f}" for t in times["this engine"]),
                    round(base, 1), round(this, 1), round(this / base, 3),
                ])  # fmt: skip
                print(
                    f"  {vocab_name:9s} {shape:6s} top-p {top_p}: {base:8.1f} -> {this:8.1f} us/token",
                    flush=True,
                )
    return Table(
        "The sampler alone: microseconds per token (one torch thread)",
        ["vocabulary", "distribution", "top-p", "whole row, each repeat", "this engine, each repeat",
         "whole row median", "this engine median", "this / whole row"],
        rows,
    )  # fmt: skip


def engine_decode(repeats: int, steps: int) -> Table:
    import torch

    from devkit.modelkit.build import build_tiny_kit
    from services.engine import models
    from services.engine.protocol import parse_generate_request
    from services.engine.sampling import new_generator
    from services.engine.sequence import Sequence

    with tempfile.TemporaryDirectory() as tmp:
        kit = Path(tmp) / "kit"
        build_tiny_kit(kit)
        model = models.TransformersModel.load(kit, tokenizer=None)
    rows = []
    original = models.sample_token
    try:
        for batch in (1, 4):
            rates: dict[str, list[float]] = {name: [] for name in variants()}
            for repeat in range(repeats):
                for name in order(repeat):
                    models.sample_token = variants()[name]
                    rng = torch.Generator().manual_seed(repeat)
                    seqs = []
                    for i in range(batch):
                        sampling = {"temperature": 1.0, "top_p": 0.95, "max_new_tokens": steps + 1}
                        body = {
                            "input_ids": torch.randint(10, 4000, (400,), generator=rng).tolist(),
                            "sampling_params": {**sampling, "ignore_eos": True},
                        }
                        request = parse_generate_request(body)
                        seqs.append(
                            Sequence(request, list(request.input_ids), frozenset(), None, new_generator(i))
                        )
                    for seq in seqs:
                        seq.output_ids.append(model.prefill(seq)[0])
                    start = time.perf_counter()
                    for _ in range(steps):
                        for seq, (token, _logprob) in zip(seqs, model.decode(seqs), strict=True):
                            seq.output_ids.append(token)
                    rates[name].append(batch * steps / (time.perf_counter() - start))
                    for seq in seqs:
                        model.release(seq, reusable=False)
            base, this = (statistics.median(rates[name]) for name in variants())
            each = [" ".join(f"{r:.0f}" for r in rates[name]) for name in variants()]
            rows.append([batch, *each, round(base), round(this), round(this / base, 3)])
            print(f"  decode, {batch} sequence(s): {base:.0f} -> {this:.0f} tokens/s", flush=True)
    finally:
        models.sample_token = original
    return Table(
        f"The tiny model's decode: tokens/s, {steps} steps after a 400-token prompt, top-p 0.95",
        ["sequences", "whole row, each repeat", "this engine, each repeat", "whole row median",
         "this engine median", "this / whole row"],
        rows,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5, help="runs of each variant, alternating")
    parser.add_argument("--tokens", type=int, default=2000, help="draws per run on the small vocabulary")
    parser.add_argument("--decode-steps", type=int, default=96, help="decode steps per run")
    parser.add_argument("--results", type=Path, default=None, help="the results file to write")
    parser.add_argument("--dirty-ok", action="store_true", help="write a report from uncommitted changes")
    args = parser.parse_args(argv)
    if min(args.repeats, args.tokens, args.decode_steps) < 1:
        parser.error("--repeats, --tokens and --decode-steps must be at least 1")
    require_clean_tree("engine_sampling", args.dirty_ok)
    import torch

    torch.set_num_threads(1)
    print_machine()
    tables = [sampler_alone(args.repeats, args.tokens), engine_decode(args.repeats, args.decode_steps)]
    path = write_results("engine_sampling", tables, path=args.results, dirty_ok=args.dirty_ok)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
