"""The CPU engine's sampler (services/engine/sampling.py) against the rule it implements, SGLang's
filters over the whole sorted row: the same tokens survive whether or not the short `topk` head
sufficed, the draw follows the survivors' weights, a seeded draw repeats, and the reported
log-prob is the temperature-scaled one before filtering."""

from __future__ import annotations

import math

import pytest
import torch

from services.engine.protocol import SamplingParams
from services.engine.sampling import PREFIX, draw, new_generator, sample_token, survivors

VOCAB = 4101  # the tiny kit's vocabulary


def reference_kept(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """SGLang's `top_k_top_p_min_p_sampling_from_probs_torch`: sort the whole row, drop rank >= top_k,
    mass ranked above > top_p (top_p < 1), p < min_p * p_max (min_p > 0); the first token stays.
    Only tokens of nonzero probability, which a draw can pick."""
    sorted_probs, order = probs.sort(descending=True)
    drop = torch.zeros(probs.shape[0], dtype=torch.bool)
    if top_k != -1:
        drop[top_k:] = True
    if top_p < 1.0:
        drop |= sorted_probs.cumsum(0) - sorted_probs > top_p
    if min_p > 0.0:
        drop |= sorted_probs < sorted_probs[0] * min_p
    drop[0] = False
    return set(order[~drop & (sorted_probs > 0)].tolist())  # a zero probability is never drawn


def rows() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(VOCAB, generator=generator)
    return [
        ("flat (an untrained model)", torch.softmax(logits * 0.3, -1)),
        ("peaked (a trained one)", torch.softmax(logits * 4.0, -1)),
        ("one token", torch.softmax(logits * 40.0, -1)),
        ("short row", torch.softmax(logits[:20], -1)),
    ]


FILTERS = [  # (top_k, top_p, min_p)
    (-1, 0.95, 0.0),
    (-1, 0.5, 0.0),
    (5, 1.0, 0.0),
    (PREFIX + 40, 0.99, 0.0),
    (-1, 1.0, 0.05),
    (-1, 1.0, 0.001),
    (3, 0.9, 0.1),
    (VOCAB, 1.0, 0.0),
]


@pytest.mark.parametrize(("top_k", "top_p", "min_p"), FILTERS)
def test_the_survivors_are_those_of_the_whole_sorted_row(top_k, top_p, min_p):
    for name, probs in rows():
        ids, weights = survivors(probs, top_k, top_p, min_p)
        assert ids is not None and ids.shape == weights.shape, name
        kept = {int(i) for i, w in zip(ids, weights, strict=True) if w > 0}
        assert kept == reference_kept(probs, top_k, top_p, min_p), name
        # A survivor's weight is its probability, unchanged (the draw renormalises).
        survived = weights > 0
        assert torch.equal(weights[survived], probs[ids[survived]]), name


def test_no_filter_keeps_every_token_in_vocabulary_order():
    probs = rows()[0][1]
    ids, weights = survivors(probs, -1, 1.0, 0.0)
    assert ids is None and weights is probs


def test_the_draw_follows_the_weights():
    weights = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    generator = new_generator(11)
    n = 20_000
    counts = torch.bincount(torch.tensor([draw(weights, generator) for _ in range(n)]), minlength=6)
    assert counts[0] == counts[2] == counts[5] == 0  # a dropped token is never drawn
    expected = weights * n
    chi2 = sum(float((counts[i] - expected[i]) ** 2 / expected[i]) for i in (1, 3, 4))
    assert chi2 < 13.8  # two degrees of freedom: p > 0.001


def test_a_seeded_token_repeats_and_its_logprob_is_scaled_before_filtering():
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=50)
    first = [sample_token(logits, params, gen) for gen in [new_generator(5)] for _ in range(10)]
    again = [sample_token(logits, params, gen) for gen in [new_generator(5)] for _ in range(10)]
    assert first == again
    scaled = torch.log_softmax(logits / 0.7, -1)
    kept = reference_kept(torch.softmax(logits / 0.7, -1), 50, 0.9, 0.0)
    for token, logprob in first:
        assert token in kept
        assert math.isclose(logprob, float(scaled[token]), rel_tol=0, abs_tol=1e-6)


def test_banned_tokens_are_never_drawn():
    logits = torch.zeros(VOCAB)
    logits[7] = 30.0  # nearly all the mass
    params = SamplingParams(temperature=1.0, top_p=1.0)
    generator = new_generator(1)
    assert all(sample_token(logits, params, generator, banned=[7])[0] != 7 for _ in range(50))
