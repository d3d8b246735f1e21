"""Advantages for GRPO with balanced worker-judge hierarchical credit (DESIGN.md §5).

Plain floats in, plain floats out: these run once per question group on the rollout side, before
any tensor exists, and the tests pin every formula with hand-computed numbers.

Group-relative advantage (GRPO, Shao et al. 2024, "DeepSeekMath", §4.1.2), over one group of
samples of the same prompt::

    A_i = (r_i − mean(r)) / (std(r) + eps)        normalize_std=True (GRPO)
    A_i =  r_i − mean(r)                           normalize_std=False (Dr. GRPO)

std is the sample standard deviation (Bessel-corrected, ddof=1) because that is what slime
(``RolloutManager._post_process_rewards``: ``rewards.std(dim=-1)`` then ``/ (std + 1e-6)``), TRL
and verl compute with ``torch.std``. Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like
Training: A Critical Perspective", arXiv:2503.20783, §3.1) drops the std division because it
up-weights questions that are nearly always or nearly never solved. A group whose values are all
equal (or that has one member) carries no relative signal: every advantage is exactly 0.0, never
nan and never a rounding residue like 1e-17.

Balanced hierarchical credit, over one question group of episodes e = 1..E, where episode e has
reward R_e (the answer judge's 0/1 verdict) and n_e worker trajectories j with contribution
scores c_ej (the contribution judge's score, or None when it is missing)::

    A_episode[e]    = grpo(R_1..R_E)[e]
    A_worker[e, j]  = grpo({c_ej : c_ej is not None, over all episodes of the group})[e, j]
                      = 0.0 where c_ej is None
                      = min(A_worker[e, j], 0) where R_e <= 0 (the final answer is wrong)
    advantage[e, j] = w_episode · A_episode[e] + w_worker · A_worker[e, j]     (0.5 / 0.5)
    weight[e, j]    = 1 / n_e

A wrong final answer never earns a positive advantage from its workers' grades: in a group with
rewards [1, 1, 0, 0, 0, 0, 0, 0] and contributions [1, 1, 1, 0, 0, 0, 0, 0] (the third episode's
worker found the gold answer, its coordinator answered something else), the third episode would get
0.5 · (−0.54) + 0.5 · 1.21 = +0.33 without the clamp: the policy would be pushed towards an episode
that answered wrongly. With it, −0.27. The worker term still ranks the workers of wrong episodes
among themselves downwards (a report graded below the group's mean gets its negative A_worker).

A missing contribution score is left out of the worker statistics (mean and std are over the
scores that exist) and its trajectory gets A_worker = 0, i.e. only the episode term. That is the
same as imputing the observed mean, except that imputed values would shrink the std and inflate
everyone else's A_worker. If the whole group is missing, every A_worker is 0 and the advantage is
w_episode · A_episode. An episode with no worker trajectories still takes part in the episode
normalization (its outcome is part of the group's baseline) and contributes no samples.

How the trainer uses ``weight`` (``trainer.loss.grpo_loss(..., sample_weights=weight)``): with
l_ej the per-sample loss of trajectory (e, j) — its token mean over the loss mask —

    L = Σ_{e,j} weight[e, j] · l_ej / Σ_{e,j} weight[e, j]

summed over the whole update (all groups of the batch). Σ_j weight[e, j] = 1 for every episode,
so each episode counts once however many workers it launched: an episode with 4 workers would
otherwise repeat its A_episode four times and outweigh an episode with one worker fourfold. With
one worker per episode every weight is 1 and L is the plain per-sample mean; with w_episode = 1,
w_worker = 0 the advantages are exactly GRPO's.

Negative-sample weight (``scale_negative_advantages``, off by default: scale 1 is the recipe above)::

    advantage'[e, j] = λ · advantage[e, j]   where advantage[e, j] < 0,   unchanged elsewhere

The policy gradient splits into a positive-sample part (raise the log-probs of samples better than
their group) and a negative-sample part (lower those of worse ones); Zhu et al. 2025, "The
Surprising Effectiveness of Negative Reinforcement in LLM Reasoning", find that the positive part
alone sharpens the policy (pass@1 up, entropy down) and the negative part alone keeps it broad.
On a near-deterministic small policy the negative part dominates a step: its samples' tokens are the
ones with probability mass left to remove, so the mass goes to tokens nobody sampled and the entropy
rises (the speedrun's runs, issue #15's notes). λ < 1 weighs the two parts towards sharpening;
λ = 0 trains on the better-than-group samples alone (Zhu et al.'s PSR), which the speedrun uses: on
its tiny policy it gained twice what λ = 1 did on held-out questions (bench/README.md, "RL variants").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

GRPO_EPS = 1e-6
W_EPISODE = 0.5
W_WORKER = 0.5


def grpo_advantages(
    rewards: Sequence[float], *, normalize_std: bool = True, eps: float = GRPO_EPS
) -> list[float]:
    """A_i = (r_i − mean) / (std + eps), or r_i − mean without std; see the module docstring."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1:
        raise ValueError(f"rewards must be a flat sequence, got shape {r.shape}")
    if not np.all(np.isfinite(r)):
        raise ValueError(f"rewards must be finite, got {list(rewards)}")
    if r.size < 2 or r.min() == r.max():
        return [0.0] * int(r.size)
    centred = r - r.mean()
    if normalize_std:
        centred = centred / (r.std(ddof=1) + eps)
    return [float(a) for a in centred]


@dataclass(frozen=True)
class EpisodeCredit:
    """One episode of a question group: its reward and one contribution score per worker trajectory."""

    reward: float
    contributions: Sequence[float | None]


@dataclass(frozen=True)
class HierarchicalCredit:
    """What one worker trajectory trains with: its advantage and its loss weight (1 / n_e)."""

    advantage: float  # w_episode · episode_advantage + w_worker · worker_advantage
    weight: float  # sample weight for grpo_loss: Σ weight · l / Σ weight
    episode_advantage: float
    worker_advantage: float  # 0.0 when the contribution score is missing


def _worker_advantages(episodes: Sequence[EpisodeCredit], *, normalize_std: bool) -> list[list[float]]:
    present = [c for ep in episodes for c in ep.contributions if c is not None]
    if not all(math.isfinite(c) for c in present):
        raise ValueError("contribution scores must be finite; use None for a missing score")
    normalized = iter(grpo_advantages(present, normalize_std=normalize_std))
    out = [[0.0 if c is None else next(normalized) for c in ep.contributions] for ep in episodes]
    # A wrong final answer earns nothing positive from its workers' grades (module docstring).
    return [
        [min(a, 0.0) for a in a_ws] if ep.reward <= 0 else a_ws
        for ep, a_ws in zip(episodes, out, strict=True)
    ]


def hierarchical_credit(
    episodes: Sequence[EpisodeCredit],
    *,
    w_episode: float = W_EPISODE,
    w_worker: float = W_WORKER,
    normalize_std: bool = True,
) -> list[list[HierarchicalCredit]]:
    """Per episode, per worker trajectory: advantage and loss weight (formulas in the module docstring)."""
    episode_adv = grpo_advantages([ep.reward for ep in episodes], normalize_std=normalize_std)
    worker_adv = _worker_advantages(episodes, normalize_std=normalize_std)
    weights = balanced_weights(episodes)
    return [
        [
            HierarchicalCredit(
                advantage=w_episode * a_ep + w_worker * a_w,
                weight=w,
                episode_advantage=a_ep,
                worker_advantage=a_w,
            )
            for a_w, w in zip(a_ws, ws, strict=True)
        ]
        for a_ep, a_ws, ws in zip(episode_adv, worker_adv, weights, strict=True)
    ]


def scale_negative_advantages(credit: Sequence[HierarchicalCredit], scale: float) -> list[HierarchicalCredit]:
    """Every negative advantage multiplied by ``scale`` (module docstring); weights unchanged."""
    if not (math.isfinite(scale) and scale >= 0):
        raise ValueError(f"the negative-advantage scale must be a finite number >= 0, got {scale}")
    return [replace(c, advantage=c.advantage * scale) if c.advantage < 0 else c for c in credit]


def hierarchical_advantages(
    episodes: Sequence[EpisodeCredit],
    *,
    w_episode: float = W_EPISODE,
    w_worker: float = W_WORKER,
    normalize_std: bool = True,
) -> list[list[float]]:
    """advantage[e][j] = w_episode · A_episode[e] + w_worker · A_worker[e][j]."""
    credit = hierarchical_credit(
        episodes, w_episode=w_episode, w_worker=w_worker, normalize_std=normalize_std
    )
    return [[c.advantage for c in ep] for ep in credit]


def balanced_weights(episodes: Sequence[EpisodeCredit]) -> list[list[float]]:
    """weight[e][j] = 1 / n_e, so each episode's trajectories sum to 1 in Σ w·l / Σ w."""
    return [[1.0 / n] * n if (n := len(ep.contributions)) else [] for ep in episodes]
