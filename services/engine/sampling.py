"""Next-token sampling and the log-prob reported for it, as SGLang's sampler does it.

SGLang (`srt/layers/sampler.py`, `Sampler.forward`, default settings):
- greedy (`temperature` < 1e-6, which SGLang turns into top_k = 1): the arg-max token, and the
  reported log-prob is `log_softmax(logits)` at that token, unscaled;
- otherwise: `logits / temperature` -> softmax -> top-k, top-p and min-p filtering -> a draw from
  the renormalised survivors; the reported log-prob is `log(softmax(logits / temperature))` at the
  drawn token: temperature-scaled, but *before* the top-k/top-p/min-p filters.
  (`SGLANG_RETURN_ORIGINAL_LOGPROB=1` would report the unscaled log-softmax instead; the CPU
  engine keeps SGLang's default, so the trainer's TIS ratio sees the same numbers from both.)
- the filters use the sorted probabilities: keep rank < top_k, keep a token when the mass of the
  tokens ranked above it is at most top_p, keep p >= min_p * p_max
  (`top_k_top_p_min_p_sampling_from_probs_torch`).
- log-probs are clamped at the dtype's most negative finite value, so -inf never reaches JSON.

Each request draws from its own `torch.Generator`, seeded with `sampling_seed` when given, so a
seeded request gives the same tokens whatever else is in the batch (up to float round-off in
the batched forward pass).

The draw is the same distribution as SGLang's, made with less work: one uniform number placed
on the survivors' cumulative sum, where `torch.multinomial` draws an exponential number for every
vocabulary entry; and when the filters keep a few tokens, the candidates are the `topk` of a
short prefix instead of a sort of the whole vocabulary. On a row of the tiny kit's 4,101 tokens
(2-core AMD EPYC, one thread, 2026-12-07) the sort took 53 µs, `torch.multinomial` 95 µs and
`topk(64)` 12 µs; a sampled token at top-p 0.95 233 → 148 µs (a flat row) and 230 → 66 µs (a
peaked one), at top-p 1 116 → 30 µs (bench/results/engine_sampling.md, both ways side by side).
"""

from __future__ import annotations

import secrets
from collections.abc import Collection

import torch

from services.engine.protocol import SamplingParams


def new_generator(seed: int | None) -> torch.Generator:
    """A CPU generator for one request: seeded with `seed`, or with fresh entropy."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed if seed is not None else secrets.randbits(63))
    return generator


PREFIX = 64  # candidates tried before sorting the whole row: a trained model's top-p mass is in them


def _drop(sorted_probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Which of these probabilities, sorted descending (the head of a row), the filters drop:
    rank >= top_k, the mass ranked above > top_p, p < min_p * p_max; never the first."""
    drop = torch.zeros_like(sorted_probs, dtype=torch.bool)
    if top_k != -1:
        drop[top_k:] = True
    if top_p < 1.0:
        mass_above = sorted_probs.cumsum(0) - sorted_probs
        drop |= mass_above > top_p
    if min_p > 0.0:
        drop |= sorted_probs < sorted_probs[0] * min_p
    drop[0] = False  # the most likely token always survives
    return drop


def survivors(
    probs: torch.Tensor, top_k: int, top_p: float, min_p: float
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(ids, weights): the tokens the filters keep and their probabilities (the dropped ones'
    weights are zero); ids None means every token, in vocabulary order (no filter).

    Only the head of the sorted row can survive, so the `PREFIX` most likely tokens are taken
    first (`topk`); the whole row is sorted only when the filters may keep a token past them.
    """
    if top_k == -1 and top_p >= 1.0 and min_p <= 0.0:
        return None, probs
    width = probs.shape[0] if top_k == -1 else min(top_k, probs.shape[0])
    if width > PREFIX:
        head, ids = probs.topk(PREFIX)
        # Every token past the head is dropped when the head's mass already exceeds top_p (with a
        # margin for the rounding of the two sums), or its last probability is below min_p's bar.
        if (top_p < 1.0 and float(head.sum()) > top_p + 1e-4) or (min_p > 0.0 and head[-1] < head[0] * min_p):
            return ids, head.masked_fill(_drop(head, top_k, top_p, min_p), 0.0)
        head, ids = probs.sort(descending=True)
    else:
        head, ids = probs.topk(width)
    return ids, head.masked_fill(_drop(head, top_k, top_p, min_p), 0.0)


def draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """An index of `weights` (1-D, not negative, not all zero) with probability proportional to its
    weight: one uniform number from `generator` placed on their cumulative sum."""
    cumulative = weights.double().cumsum(0)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cumulative[-1]
    index = int(torch.searchsorted(cumulative, u, right=True))
    if index >= weights.shape[0]:  # u rounded up to the total: the last token with weight
        index = int(weights.nonzero()[-1])
    return index


def clamp_logprob(value: float) -> float:
    return max(value, torch.finfo(torch.float32).min)


def sample_token(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    banned: Collection[int] = (),
) -> tuple[int, float]:
    """Pick the next token from one row of logits; return it with the log-prob SGLang reports.

    `banned` tokens get no probability at all (SGLang's min_new_tokens penalizer masks the stop
    tokens the same way, before the softmax).
    """
    logits = logits.float()
    if banned:
        logits = logits.clone()
        logits[list(banned)] = float("-inf")
    if params.greedy:
        token = int(torch.argmax(logits))
        return token, clamp_logprob(float(torch.log_softmax(logits, dim=-1)[token]))
    logprobs = torch.log_softmax(logits / params.temperature, dim=-1)
    ids, weights = survivors(logprobs.exp(), params.top_k, params.top_p, params.min_p)
    index = draw(weights, generator)
    token = index if ids is None else int(ids[index])
    return token, clamp_logprob(float(logprobs[token]))


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, chunk: int = 1024) -> list[float]:
    """log_softmax(logits[i])[targets[i]] per row, in float32, a chunk of rows at a time.

    Prompt scoring (`logprob_start_len`): the raw model distribution, no temperature, as SGLang's
    logits processor computes input log-probs.
    """
    values: list[float] = []
    for start in range(0, logits.shape[0], chunk):
        rows = torch.log_softmax(logits[start : start + chunk].float(), dim=-1)
        picked = rows.gather(1, targets[start : start + chunk].view(-1, 1)).view(-1)
        values.extend(clamp_logprob(v) for v in picked.tolist())
    return values
