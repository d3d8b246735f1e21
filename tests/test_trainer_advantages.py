"""GRPO advantages and balanced hierarchical credit, pinned by hand-computed cases."""

from __future__ import annotations

import math

import pytest

from trainer.advantages import (
    EpisodeCredit,
    HierarchicalCredit,
    balanced_weights,
    grpo_advantages,
    hierarchical_advantages,
    hierarchical_credit,
    scale_negative_advantages,
)

EPS = 1e-6


def test_grpo_hand_computed_with_sample_std():
    # r = [1, 0, 0, 0]: mean 0.25; deviations .75, -.25 x3; Σ dev² = .5625 + 3·.0625 = .75;
    # sample std (ddof=1) = sqrt(.75 / 3) = 0.5  ->  A = [.75, -.25, -.25, -.25] / (0.5 + 1e-6)
    adv = grpo_advantages([1.0, 0.0, 0.0, 0.0])
    assert adv == pytest.approx(
        [0.75 / (0.5 + EPS), -0.25 / (0.5 + EPS), -0.25 / (0.5 + EPS), -0.25 / (0.5 + EPS)]
    )
    assert adv[0] == pytest.approx(1.499997, abs=1e-6)
    assert sum(adv) == pytest.approx(0.0, abs=1e-12)


def test_grpo_eps_is_added_to_std():
    # r = [2, 0]: mean 1, sample std = sqrt((1 + 1) / 1) = sqrt(2); eps = 0.5 shows up in the denominator
    assert grpo_advantages([2.0, 0.0], eps=0.5) == pytest.approx(
        [1 / (math.sqrt(2) + 0.5), -1 / (math.sqrt(2) + 0.5)]
    )


def test_dr_grpo_only_centres():
    # Dr. GRPO: A = r - mean, no std division. mean([1, 0, 0, 0]) = .25
    assert grpo_advantages([1.0, 0.0, 0.0, 0.0], normalize_std=False) == [0.75, -0.25, -0.25, -0.25]


@pytest.mark.parametrize("rewards", [[0.1, 0.1, 0.1], [1.0] * 8, [0.0] * 8, [0.7]])
@pytest.mark.parametrize("normalize_std", [True, False])
def test_zero_variance_group_is_exactly_zero(rewards, normalize_std):
    # mean([.1, .1, .1]) = 0.10000000000000002 in floating point; the result must still be exactly 0.0
    adv = grpo_advantages(rewards, normalize_std=normalize_std)
    assert adv == [0.0] * len(rewards)
    assert all(a == 0.0 and not math.isnan(a) for a in adv)


def test_grpo_empty_and_invalid():
    assert grpo_advantages([]) == []
    with pytest.raises(ValueError):
        grpo_advantages([1.0, float("nan")])


def test_one_worker_per_episode_is_half_episode_half_worker():
    # Rewards [1, 0]: mean .5, sample std sqrt(.25 + .25) = sqrt(.5)  ->  A_ep = ±.5 / (sqrt(.5) + eps)
    # Contributions [.2, .6]: mean .4, sample std sqrt(.04 + .04) = sqrt(.08) -> A_w = ∓.2 / (sqrt(.08) + eps)
    # (both ≈ ±0.70711); advantage = .5·A_ep + .5·A_w = 0 for the first; weights 1 (one worker each)
    a_ep = 0.5 / (math.sqrt(0.5) + EPS)
    a_w = 0.2 / (math.sqrt(0.08) + EPS)
    episodes = [EpisodeCredit(1.0, [0.2]), EpisodeCredit(0.0, [0.6])]
    credit = hierarchical_credit(episodes)
    first = credit[0][0]
    assert isinstance(first, HierarchicalCredit) and first.weight == 1.0
    assert first.episode_advantage == pytest.approx(a_ep) and first.worker_advantage == pytest.approx(-a_w)
    assert first.advantage == pytest.approx(0.5 * a_ep - 0.5 * a_w)
    # The second episode answered wrongly: its worker's better grade (+a_w) is clamped to 0.
    assert credit[1][0].worker_advantage == 0.0
    assert credit[1][0].advantage == pytest.approx(-0.5 * a_ep)
    assert first.advantage == pytest.approx(0.0, abs=1e-5)  # a_ep and a_w differ only through eps
    assert balanced_weights(episodes) == [[1.0], [1.0]]


def test_several_workers_hand_computed():
    # Rewards [1, 0, 0, 1]: mean .5, Σ dev² = 4·.25 = 1, sample std = sqrt(1/3)
    # -> A_ep = ±.5 / (sqrt(1/3) + eps)
    # (≈ ±0.866025). Contributions of all workers of the group, None left out: [.9, .1, .5, .3, .7]:
    # mean .5, deviations .4 -.4 0 -.2 .2, Σ dev² = .4, sample std = sqrt(.4 / 4) = sqrt(.1) ≈ .316228
    # -> A_w = dev / (sqrt(.1) + eps) ≈ [1.264911, -1.264911, 0, -0.632456, 0.632456]; missing -> 0.
    a_ep = 0.5 / (math.sqrt(1 / 3) + EPS)
    s = math.sqrt(0.1) + EPS
    episodes = [
        EpisodeCredit(1.0, [0.9]),
        EpisodeCredit(0.0, [0.1, 0.5]),
        EpisodeCredit(0.0, [None, 0.3]),
        EpisodeCredit(1.0, [0.7]),
    ]
    expected = [
        [0.5 * a_ep + 0.5 * 0.4 / s],  # ≈ 1.065468
        [-0.5 * a_ep - 0.5 * 0.4 / s, -0.5 * a_ep + 0.0],  # ≈ -1.065468, -0.433013
        [-0.5 * a_ep, -0.5 * a_ep - 0.5 * 0.2 / s],  # missing: episode term only; ≈ -0.433013, -0.749241
        [0.5 * a_ep + 0.5 * 0.2 / s],  # ≈ 0.749241
    ]
    adv = hierarchical_advantages(episodes)
    for got, want in zip(adv, expected, strict=True):
        assert got == pytest.approx(want)
    assert adv[0][0] == pytest.approx(1.065468, abs=1e-5)
    assert adv[2] == pytest.approx([-0.433013, -0.749241], abs=1e-5)
    assert balanced_weights(episodes) == [[1.0], [0.5, 0.5], [0.5, 0.5], [1.0]]
    credit = hierarchical_credit(episodes)
    assert [[c.advantage for c in ep] for ep in credit] == adv
    assert [[c.weight for c in ep] for ep in credit] == balanced_weights(episodes)
    assert credit[2][0].worker_advantage == 0.0 and credit[2][0].episode_advantage == pytest.approx(-a_ep)


def test_uneven_counts_each_episode_weighs_the_same():
    # Episode 0 (reward 1) has 1 worker, episode 1 (reward 0) has 4. A_ep = ±.5 / (sqrt(.5) + eps) ≈ ±0.7071.
    episodes = [EpisodeCredit(1.0, [0.5]), EpisodeCredit(0.0, [0.5, 0.5, 0.5, 0.5])]
    weights = balanced_weights(episodes)
    assert weights == [[1.0], [0.25, 0.25, 0.25, 0.25]]
    assert [sum(w) for w in weights] == [1.0, 1.0]
    # All contributions equal -> A_w = 0, advantage = .5·A_ep. Weighted, the two episodes cancel
    # (1·.354 + 4·.25·(-.354) = 0); unweighted, the 4-worker failure would count four times.
    adv = hierarchical_advantages(episodes)
    a = 0.5 * 0.5 / (math.sqrt(0.5) + EPS)
    assert adv == [[pytest.approx(a)], [pytest.approx(-a)] * 4]
    weighted = sum(w * x for ws, xs in zip(weights, adv, strict=True) for w, x in zip(ws, xs, strict=True))
    assert weighted == pytest.approx(0.0, abs=1e-12)
    assert sum(x for xs in adv for x in xs) == pytest.approx(-3 * a)


def test_all_equal_rewards_leave_only_the_worker_term():
    # Rewards all 1 -> A_ep = 0 exactly. Contributions [.2, .4, .6]: mean .4, sample std
    # sqrt((.04 + 0 + .04) / 2) = .2 -> A_w = [-.2, 0, .2] / (.2 + eps) ≈ [-1, 0, 1]; advantage = .5·A_w
    episodes = [EpisodeCredit(1.0, [0.2, 0.4]), EpisodeCredit(1.0, [0.6])]
    credit = hierarchical_credit(episodes)
    assert all(c.episode_advantage == 0.0 for ep in credit for c in ep)
    assert hierarchical_advantages(episodes) == [
        [pytest.approx(0.5 * -0.2 / (0.2 + EPS)), pytest.approx(0.0, abs=1e-12)],
        [pytest.approx(0.5 * 0.2 / (0.2 + EPS))],
    ]


def test_missing_contributions_get_only_the_episode_term():
    # Every score missing: A_w = 0 everywhere, advantage = .5·A_ep; A_ep = ±.5 / (sqrt(.5) + eps)
    a_ep = 0.5 / (math.sqrt(0.5) + EPS)
    episodes = [EpisodeCredit(1.0, [None, None]), EpisodeCredit(0.0, [None])]
    assert hierarchical_advantages(episodes) == [
        [pytest.approx(0.5 * a_ep)] * 2,
        [pytest.approx(-0.5 * a_ep)],
    ]
    # One score present: a single value has no spread -> its A_w is 0 as well
    episodes = [EpisodeCredit(1.0, [0.9, None]), EpisodeCredit(0.0, [None])]
    assert all(c.worker_advantage == 0.0 for ep in hierarchical_credit(episodes) for c in ep)
    # Missing scores are left out of the statistics rather than imputed: [.2, None, .6] normalizes
    # exactly like [.2, .6] (an imputed .4 would shrink the std from sqrt(.08) to .2)
    with_gap = hierarchical_credit([EpisodeCredit(1.0, [0.2, None]), EpisodeCredit(1.0, [0.6])])
    without = hierarchical_credit([EpisodeCredit(1.0, [0.2]), EpisodeCredit(1.0, [0.6])])
    assert (
        with_gap[0][0].worker_advantage
        == without[0][0].worker_advantage
        == pytest.approx(-0.2 / (math.sqrt(0.08) + EPS))
    )
    assert with_gap[1][0].worker_advantage == without[1][0].worker_advantage


def test_episode_only_weights_reduce_to_grpo():
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    episodes = [EpisodeCredit(r, [0.1 * i]) for i, r in enumerate(rewards)]
    adv = hierarchical_advantages(episodes, w_episode=1.0, w_worker=0.0)
    assert [a for (a,) in adv] == grpo_advantages(rewards)
    assert balanced_weights(episodes) == [[1.0]] * 8
    # Several workers per episode: each worker repeats its episode's GRPO advantage
    multi = [EpisodeCredit(r, [0.3] * (1 + i % 3)) for i, r in enumerate(rewards)]
    adv = hierarchical_advantages(multi, w_episode=1.0, w_worker=0.0)
    assert adv == [[g] * (1 + i % 3) for i, g in enumerate(grpo_advantages(rewards))]


def test_weights_are_configurable_and_std_optional():
    # w_episode = .2, w_worker = .8, no std: A_ep = r - mean = ±.5, A_w = c - mean = [-.2, .2]
    episodes = [EpisodeCredit(1.0, [0.2]), EpisodeCredit(0.0, [0.6])]
    adv = hierarchical_advantages(episodes, w_episode=0.2, w_worker=0.8, normalize_std=False)
    # (the wrong second episode's worker term, +.2, is clamped to 0)
    assert adv == [[pytest.approx(0.2 * 0.5 - 0.8 * 0.2)], [pytest.approx(-0.2 * 0.5)]]


def test_episode_without_workers_counts_in_the_baseline_only():
    # Rewards [1, 0, 0]: mean 1/3, the worker-less episode still pulls the mean down.
    # sample std = sqrt((4/9 + 1/9 + 1/9) / 2) = sqrt(1/3); A_ep[0] = (2/3) / (sqrt(1/3) + eps)
    episodes = [EpisodeCredit(1.0, [None]), EpisodeCredit(0.0, []), EpisodeCredit(0.0, [None])]
    adv = hierarchical_advantages(episodes, w_episode=1.0, w_worker=0.0)
    assert adv == [
        [pytest.approx((2 / 3) / (math.sqrt(1 / 3) + EPS))],
        [],
        [pytest.approx((-1 / 3) / (math.sqrt(1 / 3) + EPS))],
    ]
    assert balanced_weights(episodes) == [[1.0], [], [1.0]]
    assert hierarchical_advantages([]) == [] and balanced_weights([]) == []


def test_nan_contribution_is_an_error_not_a_missing_score():
    with pytest.raises(ValueError, match="None"):
        hierarchical_advantages([EpisodeCredit(1.0, [float("nan")]), EpisodeCredit(0.0, [0.5])])


def test_scaling_negative_advantages_leaves_positive_and_zero_ones_and_the_weights():
    episodes = [EpisodeCredit(1.0, [1.0]), EpisodeCredit(0.0, [0.0, None]), EpisodeCredit(1.0, [])]
    credit = [c for ep in hierarchical_credit(episodes) for c in ep]
    scaled = scale_negative_advantages(credit, 0.1)
    assert len(scaled) == len(credit) == 3
    for before, after in zip(credit, scaled, strict=True):
        assert after.weight == before.weight
        expected = before.advantage * 0.1 if before.advantage < 0 else before.advantage
        assert after.advantage == pytest.approx(expected)
    assert any(c.advantage < 0 for c in credit) and any(c.advantage > 0 for c in credit)
    assert scale_negative_advantages(credit, 1.0) == credit  # 1: the recipe unchanged
    assert all(c.advantage >= 0 for c in scale_negative_advantages(credit, 0.0))  # positives only
    for bad in (-0.5, math.nan, math.inf):
        with pytest.raises(ValueError, match="negative-advantage scale"):
            scale_negative_advantages(credit, bad)


def test_a_wrong_final_answer_never_earns_a_positive_advantage_from_its_workers_grade():
    # Rewards [1, 1, 0, ...]: the third episode's worker found the gold answer (decisive, 1.0) but its
    # coordinator answered wrongly. Unclamped, its advantage would be 0.5 · (−0.54) + 0.5 · 1.21 = +0.33.
    rewards = [1, 1, 0, 0, 0, 0, 0, 0]
    contributions = [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    episodes = [EpisodeCredit(r, [c]) for r, c in zip(rewards, contributions, strict=True)]
    credit = hierarchical_credit(episodes)
    a_ep = grpo_advantages(rewards)
    a_w = grpo_advantages(contributions)
    assert 0.5 * a_ep[2] + 0.5 * a_w[2] == pytest.approx(0.334, abs=1e-3)  # what the clamp prevents
    third = credit[2][0]
    assert (
        third.worker_advantage == 0.0
        and third.advantage == pytest.approx(0.5 * a_ep[2])
        and third.advantage < 0
    )
    # Every wrong episode's advantage is at most its episode term; the right ones keep their worker term.
    for ep, (c,) in zip(episodes, credit, strict=True):
        if ep.reward <= 0:
            assert c.worker_advantage <= 0 and c.advantage <= 0.5 * c.episode_advantage + 1e-12
    assert credit[0][0].worker_advantage == pytest.approx(a_w[0]) and a_w[0] > 0
    # All wrong: no worker term is positive (a report below the mean still gets its negative one).
    all_wrong = hierarchical_credit([EpisodeCredit(0, [c]) for c in (1.0, 0.5, 0.0)])
    assert [c.advantage for (c,) in all_wrong][:2] == [0.0, 0.0] and all_wrong[2][0].advantage < 0
