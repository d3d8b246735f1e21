"""Benchmark: a GRPO step with packed micro-batches vs the same samples padded; TP=2 vs TP=1 step time.

    python bench/trainer.py [--repeats 3] [--budgets 2048,1024] [--threads 1] [--max-len 1024]
                            [--tp-shapes 8x256,8x1024] [--shape 64x2] [--work DIR] [--json FILE]
                            [--results FILE] [--dirty-ok]

All on the CPU with the tiny float32 Qwen3 of `devkit.modelkit` (built into --work once), or a
wider one of the same design (`--shape 256x4`: width x layers). The
tables, with the command, commit, machine and date, go to bench/results/trainer.md (--results);
that file is where the README's numbers come from, so it is refused from a checkout with
uncommitted changes unless --dirty-ok (the report then says DIRTY). A quick run that only checks
the machinery:
`--repeats 1 --max-len 256 --budgets 512 --tp-shapes 2x64`.

Packing. A synthetic GRPO rollout batch: 8 prompts x 8 episodes = 64 worker trajectories, lengths
lognormal (median 256 tokens, sigma 0.7, clipped to 64..--max-len; seeded), random token ids, a loss
mask of prompt / generated / tool-observation spans, rollout log-probs from the model itself,
random 0/1 rewards and contribution scores turned into advantages and weights by
`trainer.grpo.sample_credit`. One step is the trainer's update, `trainer.grpo.grpo_step`: build
the micro-batches, no-grad passes for logp_old (policy) and logp_ref (a frozen copy), then per
micro-batch log-probs, `grpo_loss` and a backward scaled for gradient accumulation, a gradient-norm
clip and one AdamW step. The variants, each on its own copy of the same weights:

- packed N: `grpo_step` itself with a micro-batch budget of N tokens (`trainer.packing`: first fit
  decreasing, one row per micro-batch, no padding) and the trainer's attention, `trainer.attention`'s
  varlen function (causal attention on each sample's slice of the row; no mask tensor);
- packed N dense: the same step with "sdpa" attention given the row's block-diagonal causal 4D mask
  (what the trainer did before: T x T mask, every cross-sample pair computed and masked);
- padded: the same update (`padded_grpo_step` below) on B = round(64 / micro-batches of the first
  packed budget) samples per micro-batch, in rollout order, each micro-batch right-padded to its
  own longest sample (2-D padding mask, the plain transformers path): as many micro-batches as
  packing, the same samples, the same loss;
- padded sorted: the same B after sorting the samples by length (length-grouped batching);
- padded global: the micro-batches of "padded", all padded to the step's longest sample (static
  shapes).

Per variant: median wall time of --repeats steps after one warm-up step (the variants take turns,
so background load hits them alike), real tokens/s (non-padding tokens / step time), the padding
fraction (padding slots / all slots), the attention query-key pairs computed against those the
samples need (a packed row's dense mask computes every cross-sample pair and masks it), and tokens/s
relative to "padded". Building the micro-batches (packing, padding) is part of the step and is also
timed alone.

Every variant computes the same update, and every run checks it: the warm-up step starts every
variant from the same weights, and the gradient each one hands to AdamW (after clipping) must equal
the first packed variant's parameter by parameter: max |g - g_first| <= GRAD_TOLERANCE (1e-4) x
max |g_first|.
Likewise TP=2's first-step gradient (gathered from the shards) against TP=1's. A run that fails
either check prints the largest difference and the parameter it is in, and exits with status 1
after writing its results. (The loss itself is ~0 on a first on-policy update, the ratio being 1
and each group's advantages summing to 0, so it cannot serve as the check.)

The packing comparison runs on --threads torch threads (default 1): on a 2-core machine that other
work shares, two intra-op threads wait on each other at every operator and a step ran 5-8x slower than
on one thread, more so for many small operators (short padded micro-batches) than for few large
ones, which would bias the comparison by the background load.

Tensor parallelism. Forward + vocab-parallel loss (`trainer.parallel.causal_lm_loss`) + backward
+ AdamW (`trainer.grpo.make_optimizer`) on a fixed random batch of each --tp-shapes shape: TP=2
under `torch.distributed.run` (2 processes, gloo, one thread each; this script's `tp-worker` mode,
sharded by `trainer.parallel.apply_tensor_parallel`) against TP=1 in this process with all threads
(the same cores) and with 1 thread (the same per-process compute). On a 2-core CPU with gloo, TP=2
is expected to be slower: every layer adds all-reduces through the loopback network, and no
hardware works in parallel that TP=1's threads could not already use. The number checks the
machinery (it runs, its first-step gradient equals TP=1's) and prices its communication; it is not
a speed-up.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from common import RESULTS_DIR, Table, machine, print_machine, require_clean_tree, write_results  # noqa: E402

from trainer.advantages import HierarchicalCredit  # noqa: E402
from trainer.data import Sample  # noqa: E402
from trainer.grpo import (  # noqa: E402
    MAX_GRAD_NORM,
    grpo_step,
    load_policy,
    load_reference,
    make_optimizer,
    sample_credit,
)
from trainer.loss import grpo_loss  # noqa: E402
from trainer.packing import pack_micro_batches, per_token_logprobs  # noqa: E402

DENSE = "sdpa"  # the dense-mask implementation the "packed N dense" and padded variants run

PROMPTS = 8
EPISODES = 8
MIN_LEN, MAX_LEN = 64, 1024
MEDIAN_LEN, LEN_SIGMA = 256, 0.7
PROMPT_TOKENS = 32
GENERATED_SPAN = (16, 96)  # tokens the worker model writes per turn (loss mask 1)
OBSERVATION_SPAN = (32, 160)  # tool output between turns (loss mask 0)
TP = 2
# Float32 gradients of one update computed in other shapes (packed rows, padded batches, TP shards)
# differ by summation order only: 3e-7 to 7e-7 of the largest entry in the runs so far. A wrong mask,
# loss normalisation or a missing all-reduce moves them by a large fraction of it.
GRAD_TOLERANCE = 1e-4


# --- the synthetic rollout batch -----------------------------------------------------------------


def rollout_lengths(n: int, seed: int, max_len: int = MAX_LEN) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    normal = torch.randn(n, generator=generator, dtype=torch.float64)
    raw = torch.exp(torch.log(torch.tensor(float(MEDIAN_LEN))) + LEN_SIGMA * normal)
    return [int(x) for x in raw.round().clamp(MIN_LEN, max_len)]


def loss_mask(length: int, generator: torch.Generator) -> list[int]:
    """Prompt, then alternating generated turns (1) and tool observations (0) up to `length`."""
    mask = [0] * PROMPT_TOKENS
    generated = True
    while len(mask) < length:
        low, high = GENERATED_SPAN if generated else OBSERVATION_SPAN
        span = int(torch.randint(low, high + 1, (1,), generator=generator))
        mask += [int(generated)] * span
        generated = not generated
    return mask[:length]


def rollout_batch(model: torch.nn.Module, budget: int, seed: int, max_len: int = MAX_LEN) -> list[Sample]:
    """8 prompts x 8 episodes of one worker trajectory each, with the model's own rollout log-probs,
    random 0/1 rewards (40% correct) and random contribution scores."""
    generator = torch.Generator().manual_seed(seed + 1)
    lengths = rollout_lengths(PROMPTS * EPISODES, seed, max_len)
    vocab = model.config.vocab_size
    bare = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]
    masks = [loss_mask(n, generator) for n in lengths]
    logprobs: list[list[float]] = [[] for _ in bare]
    with torch.no_grad():
        for batch in pack_micro_batches(bare, budget):
            row = per_token_logprobs(model, batch)[0]
            for index, part in zip(batch.indices, batch.slices, strict=True):
                logprobs[index] = row[part].tolist()
    rewards = (torch.rand(len(bare), generator=generator) < 0.4).tolist()
    scores = torch.rand(len(bare), generator=generator).tolist()
    return [
        Sample(
            token_ids=ids,
            loss_mask=mask,
            rollout_logprobs=[lp if m else 0.0 for lp, m in zip(lps, mask, strict=True)],
            group_id=f"g{i // EPISODES}",
            episode_id=f"e{i}",
            worker_episode_id=f"e{i}-w0",
            question_id=f"q{i // EPISODES}",
            episode_reward=float(rewards[i]),
            contribution=scores[i],
            weight_versions=("v0",),
        )
        for i, (ids, mask, lps) in enumerate(zip(bare, masks, logprobs, strict=True))
    ]


# --- the padded baseline of trainer.grpo.grpo_step -------------------------------------------------


def padded_batch(samples: Sequence[Sample], indices: Sequence[int], length: int, pad_id: int) -> dict:
    """The samples at `indices` right-padded to `length`: [B, length] tensors and a 2-D padding mask."""

    def rows(field: str, fill, dtype) -> torch.Tensor:
        return torch.tensor(
            [list(getattr(samples[i], field)) + [fill] * (length - len(samples[i])) for i in indices],
            dtype=dtype,
        )

    return {
        "input_ids": rows("token_ids", pad_id, torch.int64),
        "attention_mask": torch.tensor(
            [[1] * len(samples[i]) + [0] * (length - len(samples[i])) for i in indices]
        ),
        "loss_mask": rows("loss_mask", 0, torch.float32),
        "rollout_logprobs": rows("rollout_logprobs", 0.0, torch.float32),
        "indices": list(indices),
    }


def padded_logprobs(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """[B, L]: log p(token t | earlier tokens), 0.0 at t = 0; `per_token_logprobs` for padded rows."""
    ids = batch["input_ids"]
    logits = model(input_ids=ids, attention_mask=batch["attention_mask"], use_cache=False).logits
    logits = logits[:, :-1].float()
    next_logprobs = logits.gather(-1, ids[:, 1:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return torch.cat([next_logprobs.new_zeros(ids.shape[0], 1), next_logprobs], dim=1)


def padded_grpo_step(
    policy: torch.nn.Module,
    ref: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: Sequence[Sample],
    credit: Sequence[HierarchicalCredit],
    bins: Sequence[Sequence[int]],
    width: int | None,
    pad_id: int,
) -> dict[str, float]:
    """`trainer.grpo.grpo_step`'s update with padded micro-batches (the samples of each bin, padded to
    `width` or to the bin's longest) instead of packed ones: the same no-grad logp_old and reference
    passes, the same loss and accumulation, gradient clip and AdamW step. Returns the loss and the
    gradient norm before clipping (as `grpo_step` does), for the check that both compute one update."""
    batches = [padded_batch(samples, b, width or max(len(samples[i]) for i in b), pad_id) for b in bins]
    advantages = torch.tensor([c.advantage for c in credit], dtype=torch.float32)
    weights = torch.tensor([c.weight for c in credit], dtype=torch.float32)
    with torch.no_grad():
        logp_old = [padded_logprobs(policy, b) for b in batches]
        logp_ref = [padded_logprobs(ref, b) for b in batches]
    total_weight = sum(c.weight for s, c in zip(samples, credit, strict=True) if any(s.loss_mask))
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for batch, old, reference in zip(batches, logp_old, logp_ref, strict=True):
        which = batch["indices"]
        loss, stats = grpo_loss(
            padded_logprobs(policy, batch),
            old,
            batch["rollout_logprobs"],
            reference,
            advantages[which],
            batch["loss_mask"],
            sample_weights=weights[which],
        )
        share = stats["sample_weight_sum"] / total_weight
        (loss * share).backward()
        total += stats["loss"] * share
    grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), MAX_GRAD_NORM))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": total, "grad_norm": grad_norm}


def chunks(indices: Sequence[int], size: int) -> list[list[int]]:
    return [list(indices[i : i + size]) for i in range(0, len(indices), size)]


# --- the same-update check -----------------------------------------------------------------------


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's gradient as a full tensor (a TP shard's DTensor gathered), zeros where none."""
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
    return grads


@contextmanager
def first_update_gradients(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> Iterator[dict]:
    """Inside the block, the yielded dict receives the gradients of the optimizer's first step,
    as the step applies them (after any clipping), from a pre-step hook."""
    grads: dict[str, torch.Tensor] = {}

    def hook(*_):
        if not grads:
            grads.update(gradients(model))

    handle = optimizer.register_step_pre_hook(hook)
    try:
        yield grads
    finally:
        handle.remove()


def gradient_difference(name: str, grads: dict, reference: dict) -> dict:
    """max |g - g_ref| over every parameter against max |g_ref|, and whether it is within tolerance."""
    if grads.keys() != reference.keys() or not reference:
        names = sorted(grads.keys() ^ reference.keys())
        return {
            "comparison": name,
            "max_abs_diff": math.inf,
            "max_abs_grad": math.nan,
            "ratio": math.inf,
            "parameter": f"not the same parameters: {names[:3]}",
            "ok": False,
        }
    diffs = {k: float((grads[k].float() - reference[k].float()).abs().max()) for k in reference}
    worst = max(diffs, key=diffs.get)
    scale = max(float(g.abs().max()) for g in reference.values())
    ratio = diffs[worst] / scale if scale else (0.0 if diffs[worst] == 0 else math.inf)
    return {
        "comparison": name,
        "max_abs_diff": diffs[worst],
        "max_abs_grad": scale,
        "ratio": ratio,
        "parameter": worst,
        "ok": ratio <= GRAD_TOLERANCE,
    }


# --- packed vs padded -----------------------------------------------------------------------------


def bench_packing(kit: Path, budgets: Sequence[int], repeats: int, seed: int, max_len: int = MAX_LEN) -> dict:
    from transformers import AutoTokenizer

    torch.manual_seed(seed)
    policy, ref = load_policy(kit), load_reference(kit)
    pad_id = AutoTokenizer.from_pretrained(kit).pad_token_id
    if min(budgets) < max_len:
        raise SystemExit(f"every --budgets value must hold the longest sample (--max-len {max_len})")
    samples = rollout_batch(policy, max(budgets), seed, max_len)
    credit = sample_credit(samples)
    lengths = [len(s) for s in samples]
    real_tokens = sum(lengths)
    trained = sum(sum(s.loss_mask) for s in samples)
    stats = {
        "samples": len(samples),
        "tokens": real_tokens,
        "loss_tokens": trained,
        "min": min(lengths),
        "p50": int(statistics.median(lengths)),
        "mean": real_tokens / len(lengths),
        "p90": sorted(lengths)[int(0.9 * len(lengths))],
        "max": max(lengths),
    }
    print(
        f"\nrollout batch: {stats['samples']} samples, {real_tokens:,} tokens ({trained:,} trained); "
        f"length min {stats['min']} / p50 {stats['p50']} / mean {stats['mean']:.0f} / "
        f"p90 {stats['p90']} / max {stats['max']}",
        flush=True,
    )

    # The dense-mask variants' frozen reference: the same weights with "sdpa" attention.
    dense_ref = copy.deepcopy(ref)
    dense_ref.set_attn_implementation(DENSE)
    # Each variant: its step function, the micro-batch widths [(rows, width)] it will run, its
    # attention implementation, the attention pairs it computes, and the bytes per query-key pair of
    # the largest mask it allocates: a packed row's dense bool + additive float32 T x T masks (5); a
    # padded batch's boolean [B, 1, T, T] mask that transformers builds for sdpa (1); nothing for
    # the varlen route (its cumulative lengths are O(samples)).
    variants: dict[str, tuple[Callable, list[tuple[int, int]], str, int, int]] = {}
    build_s = {}
    for budget in budgets:
        started = time.perf_counter()
        packed = pack_micro_batches(samples, budget)
        build_s[f"packed {budget}"] = build_s[f"packed {budget} dense"] = time.perf_counter() - started
        shapes = [(1, b.num_tokens) for b in packed]

        def step(policy, optimizer, budget=budget):
            return grpo_step(policy, ref, optimizer, samples, credit, micro_batch_tokens=budget)

        def dense_step(policy, optimizer, budget=budget):
            return grpo_step(policy, dense_ref, optimizer, samples, credit, micro_batch_tokens=budget)

        own_pairs = sum(n * n for n in lengths)
        variants[f"packed {budget}"] = (step, shapes, policy.config._attn_implementation, own_pairs, 0)
        variants[f"packed {budget} dense"] = (dense_step, shapes, DENSE, sum(w * w for _, w in shapes), 5)
    # The padded baselines get as many micro-batches as packing under the first budget.
    size = max(1, round(len(samples) / len(variants[f"packed {budgets[0]}"][1])))
    # (A varlen model would drop a 2-D padding mask: transformers builds no mask for an attention
    # function it does not know. The padded variants run the dense implementation.)
    in_order = chunks(range(len(samples)), size)
    by_length = chunks(sorted(range(len(samples)), key=lambda i: lengths[i]), size)
    for name, bins, width in (
        ("padded", in_order, None),
        ("padded sorted", by_length, None),
        ("padded global", in_order, max(lengths)),
    ):
        started = time.perf_counter()
        shapes = [
            tuple(padded_batch(samples, b, width or max(lengths[i] for i in b), pad_id)["input_ids"].shape)
            for b in bins
        ]
        build_s[name] = time.perf_counter() - started

        def step(policy, optimizer, bins=bins, width=width):
            return padded_grpo_step(policy, dense_ref, optimizer, samples, credit, bins, width, pad_id)

        variants[name] = (step, shapes, DENSE, sum(rows * width**2 for rows, width in shapes), 1)

    # Attention scores the step computes (query x key pairs, causal or not) against the ones its
    # samples need (sum of length^2): a packed row's dense mask pays for every cross-sample pair.
    needed_pairs = sum(n * n for n in lengths)
    results = {}
    for name, (_, shapes, implementation, pairs, mask_bytes_per_pair) in variants.items():
        slots = sum(rows * width for rows, width in shapes)
        widths = [width for _, width in shapes]
        model = copy.deepcopy(policy)
        model.set_attn_implementation(implementation)
        mask_bytes = mask_bytes_per_pair * max(rows * width**2 for rows, width in shapes)
        results[name] = {
            "attention": implementation,
            "mask_bytes": mask_bytes,
            "micro_batches": len(shapes),
            "shape": f"{len(shapes)} x [{shapes[0][0]}, {min(widths)}..{max(widths)}]",
            "slots": slots,
            "padding_fraction": 1 - real_tokens / slots,
            "attention_pairs_vs_needed": pairs / needed_pairs,
            "build_s": build_s[name],
            "model": model,
            "optimizer": make_optimizer(model),
            "times": [],
        }

    for rep in range(repeats + 1):
        for name, (step, *_) in variants.items():
            r = results[name]
            with first_update_gradients(r["optimizer"], r["model"]) as grads:
                started = time.perf_counter()
                update = step(r["model"], r["optimizer"])
                elapsed = time.perf_counter() - started
            if rep == 0:
                r["warmup_s"], r["warmup_loss"] = elapsed, update["loss"]
                r["warmup_grad_norm"], r["warmup_grads"] = update["grad_norm"], grads
            else:
                r["times"].append(elapsed)
        print(f"  {'warm-up' if rep == 0 else f'step {rep}'} done", flush=True)

    first = next(iter(results))
    same_update = [
        gradient_difference(f"{name} vs {first}", r["warmup_grads"], results[first]["warmup_grads"])
        for name, r in results.items()
        if name != first
    ]

    rows = []
    for name, r in results.items():
        step_s = statistics.median(r["times"])
        rows.append(
            {
                "variant": name,
                "attention": r["attention"],
                "mask_bytes": r["mask_bytes"],
                "micro_batches": r["micro_batches"],
                "shape": r["shape"],
                "step_s": step_s,
                "step_times_s": r["times"],
                "warmup_s": r["warmup_s"],
                "build_s": r["build_s"],
                "real_tokens_per_s": real_tokens / step_s,
                "slots_per_s": r["slots"] / step_s,
                "padding_fraction": r["padding_fraction"],
                "attention_pairs_vs_needed": r["attention_pairs_vs_needed"],
                "warmup_loss": r["warmup_loss"],
                "warmup_grad_norm": r["warmup_grad_norm"],
            }
        )
    padded_rate = next(row["real_tokens_per_s"] for row in rows if row["variant"] == "padded")
    for row in rows:
        row["tokens_per_s_vs_padded"] = row["real_tokens_per_s"] / padded_rate
        row["loss_diff_vs_first"] = abs(row["warmup_loss"] - rows[0]["warmup_loss"])
        first_norm = rows[0]["warmup_grad_norm"]
        row["grad_norm_rel_diff_vs_first"] = abs(row["warmup_grad_norm"] - first_norm) / first_norm
    return {
        "budgets": list(budgets),
        "max_len": max_len,
        "same_update": same_update,
        "threads": torch.get_num_threads(),
        "padded_batch_size": size,
        "lengths": lengths,
        "length_stats": stats,
        "rows": rows,
    }


def print_packing(result: dict) -> None:
    print(
        f"\nGRPO step, {result['length_stats']['samples']} samples, "
        f"{result['length_stats']['tokens']:,} real tokens, padded B = {result['padded_batch_size']}, "
        f"{result['threads']} torch thread(s); median of the timed steps"
    )
    header = (
        ("variant", 18),
        ("attention", 14),
        ("micro-batches", 22),
        ("step s", 7),
        ("real tok/s", 10),
        ("slots/s", 9),
        ("padding", 8),
        ("attn pairs", 10),
        ("tok/s ÷ padded", 14),
        ("build ms", 8),
        ("warm-up |g| Δ", 13),
    )
    print(" ".join(f"{name:>{width}}" for name, width in header))
    for r in result["rows"]:
        print(
            f"{r['variant']:>18} {r['attention']:>14} {r['shape']:>22} {r['step_s']:>7.2f} "
            f"{r['real_tokens_per_s']:>10,.0f} "
            f"{r['slots_per_s']:>9,.0f} {r['padding_fraction']:>8.1%} "
            f"{r['attention_pairs_vs_needed']:>9.2f}x {r['tokens_per_s_vs_padded']:>14.2f} "
            f"{r['build_s'] * 1e3:>8.0f} {r['grad_norm_rel_diff_vs_first']:>13.1e}"
        )
    print(
        "(attn pairs: query-key pairs the step's attention computes ÷ the sum of squared sample "
        "lengths it needs; build: making the micro-batches, inside the step; |g| Δ: relative difference "
        f"of the warm-up step's gradient norm from {result['rows'][0]['variant']}'s, from the same weights)"
    )


# --- tensor parallelism ---------------------------------------------------------------------------


def tp_step(model, optimizer, input_ids: torch.Tensor) -> float:
    from trainer.parallel import causal_lm_loss, loss_context

    optimizer.zero_grad(set_to_none=True)
    logits = model(input_ids=input_ids, use_cache=False).logits
    with loss_context(logits):
        loss = causal_lm_loss(logits, input_ids)
        loss.backward()
    optimizer.step()
    return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss.detach())


def time_tp_steps(model, input_ids: torch.Tensor, repeats: int, barrier: Callable[[], None]) -> dict:
    """Median step time after a warm-up step, and the warm-up step's loss and gradients."""
    optimizer = make_optimizer(model)
    times, first_loss = [], None
    with first_update_gradients(optimizer, model) as first_grads:
        for rep in range(repeats + 1):
            barrier()
            started = time.perf_counter()
            loss = tp_step(model, optimizer, input_ids)
            barrier()
            if rep == 0:
                first_loss = loss
            else:
                times.append(time.perf_counter() - started)
    return {
        "step_s": statistics.median(times),
        "step_times_s": times,
        "first_loss": first_loss,
        "first_grads": first_grads,
    }


def tp_model(kit: str | Path) -> torch.nn.Module:
    """The policy for the TP comparison, which runs whole unpacked rows: dense attention, no packing."""
    model = load_policy(Path(kit))
    model.set_attn_implementation(DENSE)
    return model


def tp_worker(kit: str, batch_file: str, out_file: str, repeats: str) -> None:
    """Under torchrun: shard the tiny model over all ranks, time TP steps per batch; rank 0 writes."""
    import torch.distributed as dist

    from trainer.parallel import apply_tensor_parallel, init_distributed, tensor_parallel_mesh

    env = init_distributed()
    mesh = tensor_parallel_mesh(env)
    results, grads = {}, {}
    for shape, input_ids in torch.load(batch_file).items():
        model = tp_model(kit)
        apply_tensor_parallel(model, mesh)
        results[shape] = time_tp_steps(model, input_ids, int(repeats), dist.barrier)
        grads[shape] = results[shape].pop("first_grads")
    results["threads_per_rank"] = torch.get_num_threads()
    if env.is_main:
        Path(out_file).write_text(json.dumps(results))
        torch.save(grads, Path(out_file).with_suffix(".grads.pt"))
    dist.barrier()
    dist.destroy_process_group()


def bench_tp(
    kit: Path, work: Path, shapes: list[tuple[int, int]], repeats: int, seed: int, all_threads: int
) -> dict:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(kit).vocab_size
    generator = torch.Generator().manual_seed(seed + 2)
    batches = {f"{b}x{s}": torch.randint(0, vocab, (b, s), generator=generator) for b, s in shapes}
    torch.save(batches, work / "tp_batches.pt")

    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(TP), "--standalone"]
    command += [__file__, "tp-worker", str(kit), str(work / "tp_batches.pt"), str(work / "tp2.json")]
    command += [str(repeats)]
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    launch_s = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"torchrun failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    tp2 = json.loads((work / "tp2.json").read_text())
    tp2_grads = torch.load(work / "tp2.grads.pt")

    default_threads, threads_before = all_threads, torch.get_num_threads()
    rows, same_update = [], []
    for shape, input_ids in batches.items():
        tp1 = {}
        for threads in (default_threads, 1):
            torch.set_num_threads(threads)
            model = tp_model(kit)
            tp1[threads] = time_tp_steps(model, input_ids, repeats, lambda: None)
        torch.set_num_threads(threads_before)
        same_update.append(
            gradient_difference(
                f"TP=2 vs TP=1, {shape}", tp2_grads[shape], tp1[default_threads]["first_grads"]
            )
        )
        rows.append(
            {
                "shape": shape,
                "tokens": input_ids.numel(),
                "tp1_threads": default_threads,
                "tp1_step_s": tp1[default_threads]["step_s"],
                "tp1_1thread_step_s": tp1[1]["step_s"],
                "tp2_step_s": tp2[shape]["step_s"],
                "tp1_step_times_s": tp1[default_threads]["step_times_s"],
                "tp1_1thread_step_times_s": tp1[1]["step_times_s"],
                "tp2_step_times_s": tp2[shape]["step_times_s"],
                "tp2_over_tp1": tp2[shape]["step_s"] / tp1[default_threads]["step_s"],
                "tp2_over_tp1_1thread": tp2[shape]["step_s"] / tp1[1]["step_s"],
                "first_loss_diff": abs(tp2[shape]["first_loss"] - tp1[default_threads]["first_loss"]),
            }
        )
    return {
        "tp": TP,
        "backend": "gloo",
        "torchrun_wall_s": launch_s,
        "rows": rows,
        "same_update": same_update,
    }


def print_tp(result: dict) -> None:
    threads = result["rows"][0]["tp1_threads"]
    print(
        f"\nTP step (forward + vocab-parallel loss + backward + AdamW), TP=2 = 2 processes x 1 thread "
        f"over gloo; TP=1 = this process with {threads} threads and with 1"
    )
    header = (
        ("batch", 8),
        ("tokens", 7),
        (f"TP=1 ({threads}t) s", 12),
        ("TP=1 (1t) s", 11),
        ("TP=2 s", 7),
        (f"TP=2 ÷ TP=1 ({threads}t)", 16),
        ("TP=2 ÷ TP=1 (1t)", 16),
        ("loss Δ", 8),
    )
    print(" ".join(f"{name:>{width}}" for name, width in header))
    for r in result["rows"]:
        print(
            f"{r['shape']:>8} {r['tokens']:>7,} {r['tp1_step_s']:>12.3f} {r['tp1_1thread_step_s']:>11.3f} "
            f"{r['tp2_step_s']:>7.3f} {r['tp2_over_tp1']:>16.2f} {r['tp2_over_tp1_1thread']:>16.2f} "
            f"{r['first_loss_diff']:>8.1e}"
        )
    print(
        f"(torchrun with start-up and model loading took {result['torchrun_wall_s']:.1f} s; TP=2 on a CPU "
        "with gloo checks the machinery and prices its all-reduces, it is not expected to be faster)"
    )


# --- the same-update check and the results file -----------------------------------------------------


def print_same_update(checks: list[dict]) -> None:
    print(f"\nsame update: gradients against the reference, max |Δg| ÷ max |g| <= {GRAD_TOLERANCE:g}")
    for c in checks:
        print(
            f"  {'ok  ' if c['ok'] else 'FAIL'} {c['comparison']:<34} max |Δg| {c['max_abs_diff']:.3e} "
            f"(÷ max |g| {c['max_abs_grad']:.3e} = {c['ratio']:.2e}) in {c['parameter']}"
        )


# (column heading, key) of each results table: every raw number the printout rounds.
PACKING_COLUMNS = (
    ("variant", "variant"),
    ("attention", "attention"),
    ("micro-batches × [rows, width]", "shape"),
    ("step s (median)", "step_s"),
    ("step times s", "step_times_s"),
    ("warm-up s", "warmup_s"),
    ("real tokens/s", "real_tokens_per_s"),
    ("slots/s", "slots_per_s"),
    ("padding fraction", "padding_fraction"),
    ("attention pairs ÷ needed", "attention_pairs_vs_needed"),
    ("largest mask bytes", "mask_bytes"),
    ("tokens/s ÷ padded", "tokens_per_s_vs_padded"),
    ("build s", "build_s"),
    ("warm-up loss", "warmup_loss"),
    ("warm-up grad norm", "warmup_grad_norm"),
)
TP_COLUMNS = (
    ("batch", "shape"),
    ("tokens", "tokens"),
    ("TP=1 (all threads) s", "tp1_step_s"),
    ("TP=1 (1 thread) s", "tp1_1thread_step_s"),
    ("TP=2 s", "tp2_step_s"),
    ("TP=2 ÷ TP=1 (all threads)", "tp2_over_tp1"),
    ("TP=2 ÷ TP=1 (1 thread)", "tp2_over_tp1_1thread"),
    ("first-step loss Δ", "first_loss_diff"),
    ("TP=1 (all threads) step times s", "tp1_step_times_s"),
    ("TP=1 (1 thread) step times s", "tp1_1thread_step_times_s"),
    ("TP=2 step times s", "tp2_step_times_s"),
)
CHECK_COLUMNS = (
    ("comparison", "comparison"),
    ("max abs Δg", "max_abs_diff"),
    ("max abs g (reference)", "max_abs_grad"),
    ("ratio", "ratio"),
    ("tolerance", "tolerance"),
    ("parameter", "parameter"),
    ("within", "ok"),
)


def results_tables(packing: dict, tp: dict, checks: list[dict]) -> list[Table]:
    """The tables of bench/results/trainer.md."""

    def table(title: str, columns: tuple, rows: list[dict], notes: list[str]) -> Table:
        return Table(title, [c for c, _ in columns], [[row[k] for _, k in columns] for row in rows], notes)

    stats = packing["length_stats"]
    return [
        table(
            f"GRPO step, packed vs padded ({packing['threads']} torch thread(s))",
            PACKING_COLUMNS,
            packing["rows"],
            [
                f"Rollout batch: {stats['samples']} samples, {stats['tokens']} tokens "
                f"({stats['loss_tokens']} trained); length min {stats['min']}, p50 {stats['p50']}, "
                f"mean {stats['mean']:.1f}, p90 {stats['p90']}, max {stats['max']} "
                f"(--max-len {packing['max_len']}); padded B = {packing['padded_batch_size']}."
            ],
        ),
        table(
            f"TP step, TP={tp['tp']} ({tp['backend']}, 1 thread per rank) vs TP=1 "
            f"({tp['rows'][0]['tp1_threads']} threads = all, and 1)",
            TP_COLUMNS,
            tp["rows"],
            [f"torchrun with start-up and model loading: {tp['torchrun_wall_s']:.1f} s."],
        ),
        table(
            "Same update: first-step gradients against the reference",
            CHECK_COLUMNS,
            [{**c, "tolerance": GRAD_TOLERANCE, "parameter": f"`{c['parameter']}`"} for c in checks],
            ["Gradients as AdamW receives them (after clipping), every parameter, from the same weights."],
        ),
    ]


# --- main -------------------------------------------------------------------------------------------


def parse_shapes(text: str) -> list[tuple[int, int]]:
    return [(int(b), int(s)) for b, s in (part.split("x") for part in text.split(","))]


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per variant after a warm-up")
    parser.add_argument(
        "--budgets", default="2048,1024", help="packed token budgets; the first sizes the padded B"
    )
    parser.add_argument("--tp-shapes", default="8x256,8x1024", help="TP batches, BATCHxSEQ, comma-separated")
    parser.add_argument(
        "--shape",
        default="64x2",
        help="model width x layers: 64x2 is the tiny kit; wider ones keep its tokenizer and ratios "
        "(head_dim 32 or less, 2 query heads per KV head, MLP 3x the width)",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads for the packing comparison (see the docstring)"
    )
    parser.add_argument(
        "--max-len", type=int, default=MAX_LEN, help="longest rollout sample; every budget must hold it"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "bcstack-bench-trainer")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--results",
        type=Path,
        default=RESULTS_DIR / "trainer.md",
        help="the Markdown tables, written each run",
    )
    parser.add_argument("--dirty-ok", action="store_true", help="write the report from uncommitted changes")
    args = parser.parse_args()
    require_clean_tree("trainer", args.dirty_ok)  # before the run, not after it

    print(f"trainer benchmark (Qwen3-architecture model {args.shape}, CPU)")
    print_machine()
    all_threads = torch.get_num_threads()
    print(f"  torch     {torch.__version__}, {all_threads} threads by default")
    load_before = os.getloadavg()
    print(f"  load avg  {load_before[0]:.2f} / {load_before[1]:.2f} / {load_before[2]:.2f} (1 / 5 / 15 min)")

    args.work.mkdir(parents=True, exist_ok=True)
    width, layers = (int(part) for part in args.shape.split("x"))
    kit = args.work / ("tiny" if (width, layers) == (64, 2) else f"wide-{width}x{layers}")
    if not (kit / "tokenizer.json").exists():
        from devkit.modelkit.build import build_tiny_kit
        from devkit.modelkit.model import TinyQwen3Shape

        heads = max(4, width // 32)
        shape = TinyQwen3Shape(
            hidden_size=width,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads // 2,
            head_dim=width // heads,
            intermediate_size=3 * width,
        )
        print(f"building the model kit ({width} wide, {layers} layers) ...", flush=True)
        build_tiny_kit(kit, force=True, shape=shape)
    print(f"  model     {args.shape} (width x layers), {kit}")

    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    budgets = [int(b) for b in args.budgets.split(",")]
    packing = bench_packing(kit, budgets, args.repeats, args.seed, args.max_len)
    print_packing(packing)
    tp = bench_tp(kit, args.work, parse_shapes(args.tp_shapes), args.repeats, args.seed, all_threads)
    print_tp(tp)
    checks = packing["same_update"] + tp["same_update"]
    print_same_update(checks)
    load_after = os.getloadavg()
    wall_s = time.perf_counter() - started
    print(
        f"\nload average after: {load_after[0]:.2f} / {load_after[1]:.2f} / {load_after[2]:.2f}; "
        f"benchmark wall time {wall_s:.0f} s"
    )
    extra = {
        "model": f"{args.shape} (width x layers), {kit.name}",
        "torch": f"{torch.__version__}, {all_threads} threads by default",
        "load average (1 min)": f"{load_before[0]:.2f} before, {load_after[0]:.2f} after",
        "wall time": f"{wall_s:.0f} s",
    }
    tables = results_tables(packing, tp, checks)
    print(f"results: {write_results('trainer', tables, extra, args.results, dirty_ok=args.dirty_ok)}")
    if args.json:
        report = {
            "machine": machine(),
            "torch": torch.__version__,
            "default_threads": all_threads,
            "packing_threads": args.threads,
            "load_before": load_before,
            "load_after": load_after,
            "packing": packing,
            "tp": tp,
        }
        args.json.write_text(json.dumps(report, indent=2))
    failed = [c for c in checks if not c["ok"]]
    if failed:
        worst = max(failed, key=lambda c: c["ratio"])
        raise SystemExit(
            f"NOT the same update: {len(failed)} of {len(checks)} gradient checks failed; the worst, "
            f"{worst['comparison']}, differs by {worst['max_abs_diff']:.3e} in {worst['parameter']} "
            f"({worst['ratio']:.2e} of max |g|, tolerance {GRAD_TOLERANCE:g})"
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "tp-worker":
        tp_worker(*sys.argv[2:6])
    else:
        main()
