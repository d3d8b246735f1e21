"""GRPO loss pieces (PPO clip, TIS, k3 KL, per-sample token mean), pinned by hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.advantages import EpisodeCredit, hierarchical_credit
from trainer.loss import grpo_loss, kl_k3, ppo_clip_loss, tis_weights

LN2 = math.log(2.0)


def _t(rows, requires_grad=False):
    return torch.tensor(rows, dtype=torch.float32, requires_grad=requires_grad)


def test_ppo_clip_at_both_ends_for_both_signs():
    # logp_old = 0, so ratio = exp(logp). Columns: ratio 1.5 (above 1.28), 0.5 (below 0.8), 1.1 (inside).
    # A = +2: min(3.0, 1.28·2 = 2.56) = 2.56 -> -2.56 clipped | min(1.0, 0.8·2 = 1.6) = 1.0 -> -1.0 | -2.2
    # A = -2: min(-3.0, -2.56) = -3.0 -> 3.0 | min(-1.0, 0.8·-2 = -1.6) = -1.6 -> 1.6 clipped | 2.2
    logp = torch.log(_t([[1.5, 0.5, 1.1], [1.5, 0.5, 1.1]])).requires_grad_()
    out = ppo_clip_loss(logp, torch.zeros(2, 3), _t([2.0, -2.0]), torch.ones(2, 3))
    assert out.loss.tolist() == [
        [pytest.approx(-2.56), pytest.approx(-1.0), pytest.approx(-2.2)],
        [pytest.approx(3.0), pytest.approx(1.6), pytest.approx(2.2)],
    ]
    assert out.clipped.tolist() == [[True, False, False], [False, True, False]]
    assert out.ratio.tolist() == [pytest.approx([1.5, 0.5, 1.1])] * 2
    # d(-ratio·A)/d logp = -A·ratio where the unclipped term binds, 0 where the clipped one does
    out.loss.sum().backward()
    assert logp.grad.tolist() == [
        [0.0, pytest.approx(-1.0), pytest.approx(-2.2)],
        [pytest.approx(3.0), 0.0, pytest.approx(2.2)],
    ]


def test_ppo_clip_range_is_configurable_and_advantages_may_be_per_token():
    # Symmetric ε = 0.2: ratio 1.25 is now above 1.2, A = 1 -> -1.2
    logp = torch.log(_t([[1.25, 1.0]]))
    out = ppo_clip_loss(logp, torch.zeros(1, 2), _t([1.0]), torch.ones(1, 2), eps_low=0.2, eps_high=0.2)
    assert out.loss.tolist() == [[pytest.approx(-1.2), pytest.approx(-1.0)]]
    # Default ε_high = 0.28: 1.25 is inside, -1.25
    out = ppo_clip_loss(logp, torch.zeros(1, 2), _t([1.0]), torch.ones(1, 2))
    assert out.loss.tolist() == [[pytest.approx(-1.25), pytest.approx(-1.0)]]
    per_token = ppo_clip_loss(logp, torch.zeros(1, 2), _t([[1.0, 1.0]]), torch.ones(1, 2))
    assert torch.equal(per_token.loss, out.loss)
    with pytest.raises(ValueError, match="advantages"):
        ppo_clip_loss(logp, torch.zeros(1, 2), _t([1.0, 2.0, 3.0]), torch.ones(1, 2))


def test_tis_weight_is_capped_at_two_and_reports_the_clipped_fraction():
    # exp(logp_old - logp_rollout) = [3, 0.5, 1, 2.5]; the last token is off the mask.
    # weights = [min(3, 2), 0.5, 1, 1 (off the mask)]; capped loss tokens: 1 of 3
    logp_old = _t([[math.log(3.0), math.log(0.5), 0.0, math.log(2.5)]], requires_grad=True)
    tis = tis_weights(logp_old, torch.zeros(1, 4), mask=_t([[1, 1, 1, 0]]))
    assert tis.weights.tolist() == [[2.0, pytest.approx(0.5), 1.0, 1.0]]
    assert tis.clip_fraction == pytest.approx(1 / 3)
    assert not tis.weights.requires_grad
    # Without a mask every token counts: 3 and 2.5 are capped -> 2 of 4; a custom cap of 4 caps none
    assert tis_weights(logp_old, torch.zeros(1, 4)).clip_fraction == 0.5
    assert tis_weights(logp_old, torch.zeros(1, 4), 4.0).weights.tolist() == [
        pytest.approx([3.0, 0.5, 1.0, 2.5])
    ]


def test_k3_values_and_clamp():
    # d = logp - logp_ref; k3 = exp(-d) - 1 + d
    #   d = 0      -> 0
    #   d = ln 2   -> 0.5 - 1 + 0.693147 = 0.193147
    #   d = -ln 2  -> 2 - 1 - 0.693147   = 0.306853
    #   d = 12     -> e^-12 - 1 + 12 = 11.000006 -> clamped to 10
    #   d = -3     -> e^3 - 1 - 3 = 16.0855      -> clamped to 10
    #   d = -1e4   -> e^1e4 overflows float32; still 10, with a finite (zero) gradient
    logp = _t([[0.0, LN2, -LN2, 12.0, -3.0, -1e4]], requires_grad=True)
    kl = kl_k3(logp, torch.zeros(1, 6))
    assert kl.tolist() == [
        [0.0, pytest.approx(0.193147, abs=1e-6), pytest.approx(0.306853, abs=1e-6), 10.0, 10.0, 10.0]
    ]
    # d k3 / d logp = 1 - exp(-d): 0, 0.5, -1, and 0 where the clamp binds
    kl.sum().backward()
    assert logp.grad.tolist() == [[0.0, pytest.approx(0.5), pytest.approx(-1.0), 0.0, 0.0, 0.0]]
    # The sign of d matters: swapping logp and logp_ref turns 0.193147 into 0.306853
    assert kl_k3(torch.zeros(1, 1), _t([[LN2]])).item() == pytest.approx(0.306853, abs=1e-6)


def test_grpo_loss_hand_computed_with_tis_and_kl():
    # One sample, two loss tokens, A = 1, kl_coef = 0.001.
    # token 0: ratio e^{ln 1.5} = 1.5 -> pg = -min(1.5, 1.28) = -1.28 (clipped); ρ = min(3, 2) = 2 -> -2.56
    #          d = ln 2 -> k3 = 0.193147
    # token 1: ratio 1 -> pg = -1; ρ = 0.5 -> -0.5; d = -ln 2 -> k3 = 0.306853
    # pg_loss = (-2.56 - 0.5) / 2 = -1.53; kl = (0.193147 + 0.306853) / 2 = 0.25 (exactly 0.5 / 2)
    # loss = -1.53 + 0.001 · 0.25 = -1.52975
    logp = _t([[math.log(1.5), 0.0]], requires_grad=True)
    logp_old = torch.zeros(1, 2)
    logp_rollout = _t([[-math.log(3.0), LN2]])
    logp_ref = _t([[math.log(1.5) - LN2, LN2]])
    loss, stats = grpo_loss(logp, logp_old, logp_rollout, logp_ref, _t([1.0]), torch.ones(1, 2))
    assert loss.item() == pytest.approx(-1.52975, rel=1e-6)
    assert stats == {
        "loss": pytest.approx(-1.52975, rel=1e-6),
        "pg_loss": pytest.approx(-1.53, rel=1e-6),
        "kl": pytest.approx(0.25, rel=1e-6),
        "tis_clip_fraction": 0.5,
        "ppo_clip_fraction": 0.5,
        "ratio_mean": pytest.approx(1.25, rel=1e-6),
        "sample_weight_sum": 1.0,
    }
    assert all(isinstance(v, float) for v in stats.values())
    # Gradient, each token / 2 for the token mean:
    # token 0: pg clipped -> 0; KL 0.001·(1 - e^{-ln 2}) = 0.0005 -> 0.00025
    # token 1: pg -A·ratio·ρ = -0.5; KL 0.001·(1 - 2) = -0.001 -> (-0.5 - 0.001) / 2 = -0.2505
    loss.backward()
    assert logp.grad.tolist() == [[pytest.approx(0.00025, rel=1e-4), pytest.approx(-0.2505, rel=1e-6)]]


def test_per_sample_token_mean_counts_long_and_short_samples_equally():
    # No clipping, TIS or KL (all log-probs equal): pg_it = -A_it.
    # sample 0, 4 loss tokens, A = [1, 2, 3, 4] -> l_0 = -(1 + 2 + 3 + 4) / 4 = -2.5
    # sample 1, 1 loss token,  A = 5           -> l_1 = -5
    # L = (-2.5 - 5) / 2 = -3.75   (a global token mean would give -15 / 5 = -3)
    logp = torch.zeros(2, 4, requires_grad=True)
    same = torch.zeros(2, 4)
    adv = _t([[1, 2, 3, 4], [5, 0, 0, 0]])
    mask = _t([[1, 1, 1, 1], [1, 0, 0, 0]])
    loss, _ = grpo_loss(logp, same, same, same, adv, mask)
    assert loss.item() == pytest.approx(-3.75)
    # dL/dlogp_it = (1/B)·(1/n_i)·(-A_it): sample 0 -> -A/8, sample 1 -> -5/2 on its one token
    loss.backward()
    assert logp.grad.tolist() == [[-0.125, -0.25, -0.375, -0.5], [-2.5, 0.0, 0.0, 0.0]]


def test_token_sum_aggregation_counts_every_token_once_over_a_constant():
    # The same two samples as above, aggregation="token-sum", N = 10:
    # l_0 = -(1 + 2 + 3 + 4) / 10 = -1, l_1 = -5 / 10 = -0.5, L = (-1 - 0.5) / 2 = -0.75
    logp = torch.zeros(2, 4, requires_grad=True)
    same = torch.zeros(2, 4)
    adv = _t([[1, 2, 3, 4], [5, 0, 0, 0]])
    mask = _t([[1, 1, 1, 1], [1, 0, 0, 0]])
    loss, stats = grpo_loss(logp, same, same, same, adv, mask, aggregation="token-sum", token_norm=10)
    assert loss.item() == pytest.approx(-0.75) and stats["pg_loss"] == pytest.approx(-0.75)
    # dL/dlogp_it = (1/B)·(1/N)·(-A_it): every token's gradient scales with its own advantage alone,
    # whatever the length of its sample (sample-mean gives the one-token sample's token 8x the weight).
    loss.backward()
    assert logp.grad.flatten().tolist() == pytest.approx([-0.05, -0.1, -0.15, -0.2, -0.25, 0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="loss aggregation"):
        grpo_loss(logp, same, same, same, adv, mask, aggregation="token-mean")
    with pytest.raises(ValueError, match="token_norm"):
        grpo_loss(logp, same, same, same, adv, mask, aggregation="token-sum", token_norm=0)


def test_observation_tokens_contribute_nothing():
    gen = torch.Generator().manual_seed(0)
    logp, old, rollout, ref = (-torch.rand(3, 6, generator=gen) for _ in range(4))
    adv = _t([1.0, -0.5, 2.0])
    mask = _t([[0, 0, 1, 1, 1, 0], [1, 1, 0, 0, 1, 1], [0, 1, 1, 1, 1, 1]])

    def run(lp, *others):
        lp = lp.clone().requires_grad_()
        loss, stats = grpo_loss(lp, *others, adv, mask)
        loss.backward()
        return loss.detach(), lp.grad, stats

    base_loss, base_grad, base_stats = run(logp, old, rollout, ref)
    off = mask == 0
    wild = [50.0, -1e4, float("inf"), float("-inf"), float("nan")]
    values = torch.tensor([wild[i % len(wild)] for i in range(int(off.sum()))])

    def scramble(x):
        x = x.clone()
        x[off] = values
        return x

    loss, grad, stats = run(scramble(logp), scramble(old), scramble(rollout), scramble(ref))
    assert torch.equal(loss, base_loss) and torch.equal(grad, base_grad)
    assert stats == base_stats
    assert torch.all(grad[off] == 0.0)
    assert torch.all(grad[~off] != 0.0)


def test_sample_weights_weight_the_per_sample_losses():
    # ratio 1, no TIS/KL: l_0 = -A_0 = -1, l_1 = -A_1 = 3. L = Σ w·l / Σ w
    logp = torch.zeros(2, 3, requires_grad=True)
    same = torch.zeros(2, 3)
    adv, mask = _t([1.0, -3.0]), torch.ones(2, 3)
    cases = {
        (1.0, 1.0): (-1 + 3) / 2,
        (3.0, 1.0): (-3 + 3) / 4,
        (1.0, 0.0): -1.0,
        (0.5, 2.0): (-0.5 + 6) / 2.5,
    }
    for weights, expected in cases.items():
        loss, stats = grpo_loss(logp, same, same, same, adv, mask, sample_weights=_t(list(weights)))
        assert loss.item() == pytest.approx(expected)
        assert stats["sample_weight_sum"] == sum(weights)


def test_balanced_weights_make_each_episode_count_once():
    # Episode 0 (reward 1) has 1 worker, episode 1 (reward 0) has 4; equal contributions -> A_w = 0,
    # A = ±a with a = 0.5 · 0.5 / (sqrt(.5) + 1e-6). At ratio 1 the loss is -Σ w·A / Σ w:
    # weights [1, .25 x4] -> -(a - 4·.25·a) / 2 = 0;  unweighted -> -(a - 4a) / 5 = 0.6a
    credit = hierarchical_credit([EpisodeCredit(1.0, [0.5]), EpisodeCredit(0.0, [0.5] * 4)])
    flat = [c for ep in credit for c in ep]
    adv = _t([c.advantage for c in flat])
    weights = _t([c.weight for c in flat])
    logp, same, mask = torch.zeros(5, 2), torch.zeros(5, 2), torch.ones(5, 2)
    balanced, _ = grpo_loss(logp, same, same, same, adv, mask, sample_weights=weights)
    plain, _ = grpo_loss(logp, same, same, same, adv, mask)
    a = 0.5 * 0.5 / (math.sqrt(0.5) + 1e-6)
    assert balanced.item() == pytest.approx(0.0, abs=1e-7)
    assert plain.item() == pytest.approx(0.6 * a, rel=1e-6)


def test_micro_batches_rescaled_by_weight_sum_reproduce_the_batch_loss():
    gen = torch.Generator().manual_seed(1)
    logp, old, rollout, ref = (-torch.rand(4, 5, generator=gen) for _ in range(4))
    adv, weights = _t([1.0, -1.0, 0.5, 2.0]), _t([1.0, 0.25, 0.25, 0.5])
    mask = (torch.rand(4, 5, generator=gen) > 0.3).float()
    mask[:, 0] = 1.0
    whole, _ = grpo_loss(logp, old, rollout, ref, adv, mask, sample_weights=weights)
    total = float(weights.sum())
    parts = []
    for rows in (slice(0, 1), slice(1, 4)):
        part, stats = grpo_loss(
            logp[rows],
            old[rows],
            rollout[rows],
            ref[rows],
            adv[rows],
            mask[rows],
            sample_weights=weights[rows],
        )
        parts.append(part * stats["sample_weight_sum"] / total)
    assert sum(parts).item() == pytest.approx(whole.item(), rel=1e-6)


def test_samples_without_loss_tokens_are_left_out():
    # sample 1 has no loss token: L = l_0 = -A_0 = -2 whatever sample 1's weight and advantage
    logp = torch.zeros(2, 3, requires_grad=True)
    same = torch.zeros(2, 3)
    mask = _t([[1, 1, 0], [0, 0, 0]])
    loss, stats = grpo_loss(logp, same, same, same, _t([2.0, 7.0]), mask, sample_weights=_t([1.0, 5.0]))
    assert loss.item() == pytest.approx(-2.0) and stats["sample_weight_sum"] == 1.0
    # Nothing on the mask at all: loss 0, a zero gradient, no nan
    empty, stats = grpo_loss(logp, same, same, same, _t([2.0, 7.0]), torch.zeros(2, 3))
    empty.backward()
    assert empty.item() == 0.0 and torch.equal(logp.grad, torch.zeros(2, 3))
    assert (
        stats["tis_clip_fraction"] == 0.0 and stats["ppo_clip_fraction"] == 0.0 and stats["ratio_mean"] == 1.0
    )


def test_gradient_flows_only_through_logp():
    gen = torch.Generator().manual_seed(2)
    logp, old, rollout, ref = ((-torch.rand(2, 4, generator=gen)).requires_grad_() for _ in range(4))
    adv, weights = _t([1.0, -1.0], requires_grad=True), _t([1.0, 2.0], requires_grad=True)
    loss, _ = grpo_loss(logp, old, rollout, ref, adv, torch.ones(2, 4), sample_weights=weights)
    loss.backward()
    assert logp.grad is not None and torch.all(logp.grad != 0)
    assert all(t.grad is None for t in (old, rollout, ref, adv, weights))
