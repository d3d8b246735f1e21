"""The GRPO policy loss (DESIGN.md §5, REFERENCE.md "RL recipe"): pure functions of [batch, seq] tensors.

Notation, per sample i and token t; m_it = 1 on loss tokens (the worker's own generated tokens),
0 on prompt, tool-observation and padding tokens::

    ratio_it = exp(logp_it − logp_old_it)                         π_θ / π_θ_old, same trainer
    pg_it    = −min(ratio_it · A_it, clip(ratio_it, 1 − ε_low, 1 + ε_high) · A_it)
    ρ_it     = min(exp(logp_old_it − logp_rollout_it), C)         TIS weight, constant
    d_it     = logp_it − logp_ref_it
    k3_it    = clamp(exp(−d_it) − 1 + d_it, −10, 10)
    l_i      = Σ_t m_it · (ρ_it · pg_it + β · k3_it) / Σ_t m_it    per-sample token mean (default)
    l_i      = Σ_t m_it · (ρ_it · pg_it + β · k3_it) / N            token sum over a constant
    L        = Σ_i w_i · l_i / Σ_i w_i                            w_i = sample_weights (default 1)

with ε_low = 0.2, ε_high = 0.28 (asymmetric "clip-higher", DAPO, Yu et al. 2025, arXiv:2503.14476),
C = 2.0, β = 0.001. Samples without loss tokens are left out of L (their w_i does not count).

- PPO clip: Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. (7).
- TIS: truncated importance sampling between the rollout engine's log-probs and the trainer's
  (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training";
  slime ``--use-tis``): the engine samples from a slightly different distribution than the trainer
  computes, so the policy-gradient term is reweighted by π_old / π_rollout, truncated at C. The
  weight is a constant (no gradient). The icepop variant, which zeroes weights outside a band
  instead of truncating them, is not implemented.
- k3: Schulman, "Approximating KL Divergence" (2020, joschu.net/blog/kl-approx.html). With
  samples x ~ π_θ and r = π_ref(x) / π_θ(x) = exp(−d), k3 = (r − 1) − log r = exp(−d) − 1 + d is an
  unbiased, always non-negative estimator of KL(π_θ ‖ π_ref); slime's ``low_var_kl`` clamps it to
  [−10, 10] (only the upper end can bind). Its gradient w.r.t. logp is 1 − exp(−d).
- Loss aggregation (``aggregation``): "sample-mean" (the default) averages each sample's loss
  tokens first, so a long trajectory and a short one count equally; "token-sum" sums them and
  divides by a constant N (``token_norm``, e.g. the generation budget), as Dr. GRPO argues (Liu et
  al. 2025, arXiv:2503.20783, §3.1: the per-sample mean gives each token of a long response less
  weight, which biases towards long wrong answers and short right ones); every token then counts the
  same. Either way samples are then averaged with the weights from
  ``trainer.advantages.balanced_weights`` (each episode counts once). DESIGN §5 has no entropy
  bonus, so there is none here.

Only ``logp`` carries gradient: logp_old, logp_rollout, logp_ref and the advantages are detached.
Tokens off the mask contribute exactly 0 to the loss and receive exactly 0 gradient, whatever
their log-probs hold (inf and nan included): differences are masked with ``torch.where`` before
any exp, so no 0 · inf reaches the backward pass.

Gradient accumulation: ``grpo_loss`` normalizes by the Σ w_i of the samples it was given. To
reproduce the loss of a whole batch split into micro-batches, scale each micro-batch's loss by
``stats["sample_weight_sum"] / (Σ w_i over the batch)`` and add them up.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

PPO_EPS_LOW = 0.2
PPO_EPS_HIGH = 0.28
TIS_CAP = 2.0
KL_COEF = 0.001
KL_CLAMP = 10.0
# |d| ≥ 20 already puts k3 above KL_CLAMP (k3(−20) = e^20 − 21, k3(20) ≈ 19), so clamping d there
# changes neither the value nor the (zero) gradient, and keeps exp(−d) finite.
_KL_D_BOUND = 20.0


class PPOClip(NamedTuple):
    loss: Tensor  # [B, S] pg_it, 0 off the mask
    ratio: Tensor  # [B, S] exp(logp − logp_old), 1 off the mask
    clipped: Tensor  # [B, S] bool: the clipped term binds (gradient 0), False off the mask


class TISWeights(NamedTuple):
    weights: Tensor  # [B, S] min(exp(logp_old − logp_rollout), cap), detached, 1 off the mask
    clip_fraction: float  # share of loss tokens whose weight was capped


def _loss_tokens(mask: Tensor | None, like: Tensor) -> Tensor:
    if mask is None:
        return torch.ones_like(like, dtype=torch.bool)
    if mask.shape != like.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != log-prob shape {tuple(like.shape)}")
    return mask.bool()


def _masked_diff(a: Tensor, b: Tensor, m: Tensor) -> Tensor:
    """a − b on loss tokens, exactly 0 elsewhere (forward and backward)."""
    if a.shape != b.shape:
        raise ValueError(f"log-prob shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    d = a.float() - b.float()
    return torch.where(m, d, torch.zeros_like(d))


def _per_token(advantages: Tensor, like: Tensor, m: Tensor) -> Tensor:
    adv = advantages.detach().float()
    if adv.dim() == 1 and adv.shape[0] == like.shape[0]:
        adv = adv[:, None].expand_as(like)
    elif adv.shape != like.shape:
        raise ValueError(f"advantages must be [batch] or [batch, seq], got {tuple(advantages.shape)}")
    return torch.where(m, adv, torch.zeros_like(adv))


def _fraction(flags: Tensor, m: Tensor) -> float:
    n = int(m.sum())
    return float((flags & m).sum()) / n if n else 0.0


def ppo_clip_loss(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = PPO_EPS_LOW,
    eps_high: float = PPO_EPS_HIGH,
) -> PPOClip:
    """pg = −min(ratio·A, clip(ratio, 1 − eps_low, 1 + eps_high)·A) per token; A is [B] or [B, S]."""
    m = _loss_tokens(mask, logp)
    ratio = torch.exp(_masked_diff(logp, logp_old.detach(), m))
    adv = _per_token(advantages, logp, m)
    surrogate = ratio * adv
    clipped_surrogate = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    loss = -torch.minimum(surrogate, clipped_surrogate)
    clipped = (clipped_surrogate < surrogate) & m
    return PPOClip(loss=torch.where(m, loss, torch.zeros_like(loss)), ratio=ratio, clipped=clipped)


def tis_weights(
    logp_old: Tensor, logp_rollout: Tensor, cap: float = TIS_CAP, *, mask: Tensor | None = None
) -> TISWeights:
    """ρ = clamp(exp(logp_old − logp_rollout), 0, cap), detached; clip_fraction over loss tokens."""
    m = _loss_tokens(mask, logp_old)
    raw = torch.exp(_masked_diff(logp_old.detach(), logp_rollout.detach(), m))
    return TISWeights(weights=raw.clamp(0.0, cap), clip_fraction=_fraction(raw > cap, m))


def kl_k3(logp: Tensor, logp_ref: Tensor, *, mask: Tensor | None = None) -> Tensor:
    """k3 = clamp(exp(−d) − 1 + d, −10, 10) with d = logp − logp_ref; 0 off the mask."""
    m = _loss_tokens(mask, logp)
    d = _masked_diff(logp, logp_ref.detach(), m).clamp(-_KL_D_BOUND, _KL_D_BOUND)
    return (torch.exp(-d) - 1.0 + d).clamp(-KL_CLAMP, KL_CLAMP)


AGGREGATIONS = ("sample-mean", "token-sum")


def _token_mean(per_token: Tensor, m: Tensor) -> Tensor:
    """[B]: Σ_t m_it·x_it / Σ_t m_it (per_token is already 0 off the mask); 0 for an empty sample."""
    return per_token.sum(dim=-1) / m.sum(dim=-1).clamp_min(1)


def _aggregate(per_token: Tensor, m: Tensor, aggregation: str, token_norm: float) -> Tensor:
    """[B]: each sample's loss tokens, as its token mean or as their sum over the constant token_norm."""
    if aggregation == "sample-mean":
        return _token_mean(per_token, m)
    if aggregation == "token-sum":
        return per_token.sum(dim=-1) / token_norm
    raise ValueError(f"loss aggregation must be one of {', '.join(AGGREGATIONS)}, got {aggregation!r}")


def grpo_loss(
    logp: Tensor,
    logp_old: Tensor,
    logp_rollout: Tensor,
    logp_ref: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = PPO_EPS_LOW,
    eps_high: float = PPO_EPS_HIGH,
    tis_cap: float = TIS_CAP,
    kl_coef: float = KL_COEF,
    sample_weights: Tensor | None = None,
    aggregation: str = "sample-mean",
    token_norm: float = 1.0,
) -> tuple[Tensor, dict[str, float]]:
    """L = Σ_i w_i·l_i / Σ_i w_i, l_i = token mean of ρ·pg + kl_coef·k3, or with
    aggregation="token-sum" their token sum / token_norm (module docstring).

    Returns the scalar loss (gradient through ``logp`` only) and float stats: loss, pg_loss and kl
    (the same weighted per-sample means, pg including ρ), tis_clip_fraction, ppo_clip_fraction,
    ratio_mean (token shares and mean over loss tokens) and sample_weight_sum.
    """
    if logp.dim() != 2:
        raise ValueError(f"log-probs must be [batch, seq], got {tuple(logp.shape)}")
    if aggregation == "token-sum" and not token_norm > 0:
        raise ValueError(f"token_norm must be > 0, got {token_norm}")
    m = _loss_tokens(mask, logp)
    ppo = ppo_clip_loss(logp, logp_old, advantages, m, eps_low=eps_low, eps_high=eps_high)
    tis = tis_weights(logp_old, logp_rollout, tis_cap, mask=m)
    kl = kl_k3(logp, logp_ref, mask=m)

    sample_pg = _aggregate(tis.weights * ppo.loss, m, aggregation, token_norm)
    sample_kl = _aggregate(kl, m, aggregation, token_norm)
    if sample_weights is None:
        w = torch.ones_like(sample_pg)
    else:
        w = sample_weights.detach().to(sample_pg)
        if w.shape != sample_pg.shape:
            raise ValueError(f"sample_weights must be [batch], got {tuple(sample_weights.shape)}")
    w = torch.where(m.any(dim=-1), w, torch.zeros_like(w))
    # Every per-sample value is exactly 0 where w is 0, so a tiny floor turns 0/0 into 0, not nan.
    w_sum = w.sum()
    denom = w_sum.clamp_min(torch.finfo(w.dtype).tiny)
    pg_loss = (w * sample_pg).sum() / denom
    kl_mean = (w * sample_kl).sum() / denom
    loss = pg_loss + kl_coef * kl_mean

    n_tokens = int(m.sum())
    stats = {
        "loss": float(loss.detach()),
        "pg_loss": float(pg_loss.detach()),
        "kl": float(kl_mean.detach()),
        "tis_clip_fraction": tis.clip_fraction,
        "ppo_clip_fraction": _fraction(ppo.clipped, m),
        "ratio_mean": float(ppo.ratio.detach()[m].sum()) / n_tokens if n_tokens else 1.0,
        "sample_weight_sum": float(w_sum),
    }
    return loss, stats
