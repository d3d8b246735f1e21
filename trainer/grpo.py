"""GRPO: one policy update per rollout batch of episode records (DESIGN.md §5, seed 000).

Read top to bottom, one update is:

1. grade   every episode record: reward = 1 if the final answer is correct else 0 (the rule grader,
           or any `Grader`), and one contribution score per worker report;
2. credit  per question group: balanced hierarchical credit (`trainer.advantages`) gives every
           worker trajectory an advantage and a loss weight (1 / workers of its episode);
3. targets with no gradient, before any weight moves: logp_old from the policy, logp_ref from the
           frozen reference; logp_rollout comes with the records (what the engine sampled with);
4. loss    micro-batches packed under a token budget; each one's `grpo_loss` (PPO clip 0.2/0.28,
           TIS cap 2, k3 KL 0.001, per-sample token mean, Σ w·l / Σ w) is scaled by its share of
           the update's Σ w and back-propagated, so the summed gradient is the full batch's;
5. step    clip the gradient norm, one AdamW step (or one per mini-batch of whole groups, `steps`),
           log, checkpoint.

    rewards, contributions, episodes = grade_records(path)              # 1
    samples, _ = load_samples(path, rewards=rewards, contributions=contributions)
    credit = sample_credit(samples, episodes)                           # 2
    stats = grpo_step(policy, ref, optimizer, samples, credit)          # 3-5

`train` runs that for `steps` updates and is what `bcstack train grpo` calls. The records are
split into rollout batches of `groups_per_step` question groups (seed 000: 8 prompts x 8 episodes
per update), taken in order; when the run asks for more steps than the records have batches it
goes round again (the TIS weight, now exp(logp_old − logp_rollout) of an older policy, corrects
for the staleness and is capped at 2). After each step it appends a line to OUT/metrics.jsonl and
writes a crash-safe checkpoint to OUT/checkpoints (`trainer.checkpoint`); at the end it exports
the policy to OUT/serving in the serving format (`trainer.export`).

Hyperparameters. Seed 000 gives the RL recipe: LR 1e-6, ε 0.2/0.28, TIS cap 2.0, KL 0.001 (k3),
8 prompts x 8 episodes per update; it says nothing about the optimizer itself, so AdamW takes
seed 001's settings of the same Miles setup ("weight decay 0.1, beta=(0.9,0.95)"), at a constant
LR (seed 000 names no schedule). Weight decay skips 1-D parameters (norm weights, biases), as
Megatron does. The gradient-norm clip of 1.0 is not in the seeds: it is Megatron's `--clip-grad`
default, which Miles inherits.

Simplified, and why:
- One optimizer step per rollout batch by default, so logp_old equals logp at the moment of the
  update: the PPO ratio is 1 and the clip cannot bind (slime with one optimizer step per rollout is
  the same). `steps` > 1 takes one step per mini-batch of whole groups, logp_old fixed before the
  first: the later steps are off-policy by the earlier ones, and the ratio and clip handle that.
- float32 throughout. One step for every layout: under torchrun the same `grpo_step` runs on each
  rank of a [dp, tp] mesh (`trainer.distributed`: TP by plan, FSDP2 on dp, each dp rank on its
  share of the micro-batches); the rollout loop that produces the records lives in `bcstack.rl`.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from core.budget import BudgetLimits
from core.grading import RULE_VERSION, response_text, rule_answer, rule_contribution
from core.records import EpisodeRecord, RecordError, load_lenient
from trainer.advantages import EpisodeCredit, HierarchicalCredit, hierarchical_credit
from trainer.attention import VARLEN
from trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from trainer.data import Sample, group_samples, load_samples, read_records
from trainer.distributed import Layout, full_state_dict, grad_norm_clip, parallelize, silent
from trainer.loss import grpo_loss
from trainer.packing import PackedBatch, first_fit_pack, pack, per_token_logprobs

LR = 1e-6  # seed 000
BETAS = (0.9, 0.95)  # seed 001 (the SFT stage of the same Miles setup)
WEIGHT_DECAY = 0.1  # seed 001
MAX_GRAD_NORM = 1.0  # Megatron's --clip-grad default; not in the seeds
GROUPS_PER_STEP = 8  # seed 000: 8 prompts x 8 episodes per update
# A micro-batch must hold the longest trajectory, and an episode's budget counts every token of it.
MICRO_BATCH_TOKENS = BudgetLimits().max_tokens
# Causal attention inside each packed sample, no T x T mask (trainer.attention); "sdpa" and "eager"
# also work, with packing's dense 4D mask (bench/trainer.py measures both).
ATTENTION = VARLEN
METRICS_FILE = "metrics.jsonl"
# Step statistics averaged over loss tokens (the others are weighted like the loss).
TOKEN_MEANS = ("tis_clip_fraction", "ppo_clip_fraction", "ratio_mean")
CHECKPOINTS_DIR = "checkpoints"
SERVING_DIR = "serving"


class GRPOError(ValueError):
    """The run cannot start or go on (no records, records without a gold answer, no model, ...)."""


# --- 1. grade ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EpisodeGrades:
    """One episode's grades: its 0/1 reward and a contribution score per worker episode id.

    A worker missing from `contributions` (or mapped to None: the judge could not grade it) trains
    on the episode term of its advantage only (`trainer.advantages`).
    """

    reward: float
    contributions: Mapping[str, float | None] = field(default_factory=dict)


# The hook for other graders: anything that grades one episode record. The judge proxy will plug
# in here (POST /v1/grade and /v1/grade/contribution, or their /batch forms), returning the same
# EpisodeGrades; `rule_grades` is the embedded default judge, run in-process.
Grader = Callable[[EpisodeRecord], EpisodeGrades]


def final_response(record: EpisodeRecord) -> str:
    """The episode's final answer in the BrowseComp answer format the graders read."""
    return response_text(record.answer, record.explanation, record.confidence)


def rule_grades(record: EpisodeRecord) -> EpisodeGrades:
    """The rule grader (the embedded judge's backend): normalized exact or numeric answer match for
    the reward; for each worker, its report as the coordinator read it (`WorkerRecord.report_text`)
    graded by `core.grading.rule_contribution` on the report's answer field."""
    gold = str(record.gold_answer)
    verdict = rule_answer(final_response(record), gold, RULE_VERSION)
    contributions = {
        # keyed like trainer.data keys a worker trajectory
        worker.episode_id or f"#{i}": rule_contribution(
            worker.report_text(), record.answer, gold, RULE_VERSION
        ).score
        for i, worker in enumerate(record.workers)
        if worker.trajectory is not None
    }
    return EpisodeGrades(reward=1.0 if verdict.correct else 0.0, contributions=contributions)


@dataclass(frozen=True)
class GradedEpisode:
    """An episode's place in its group, kept even when no trajectory of it can be trained on."""

    episode_id: str
    group_id: str
    reward: float


def grade_records(
    path: Path, grader: Grader = rule_grades
) -> tuple[dict[str, float], dict[str, float], list[GradedEpisode]]:
    """Grade every record of `path`: rewards by episode id, contributions by worker episode id, and
    every episode in file order (for the group baselines).

    Raises GRPOError naming the records that have no gold answer: a reward needs one, and training
    on records that silently count as wrong would push the policy away from whatever they did.
    """
    rewards: dict[str, float] = {}
    contributions: dict[str, float] = {}
    episodes: list[GradedEpisode] = []
    no_gold: list[str] = []
    for origin, data in read_records(Path(path)):
        try:
            # Broken trajectories are set aside here and reported by load_samples; the grade needs
            # only the answer, the reports and the gold answer.
            record, _ = load_lenient(data)
        except RecordError as exc:
            raise GRPOError(f"{origin}: {exc}") from None
        if not (record.gold_answer or "").strip():
            no_gold.append(record.episode_id or origin)
            continue
        grades = grader(record)
        episode_id = record.episode_id
        if episode_id in rewards:
            raise GRPOError(f"{path}: episode {episode_id} appears twice")
        rewards[episode_id] = float(grades.reward)
        contributions.update({k: float(v) for k, v in grades.contributions.items() if v is not None})
        # The group, as trainer.data assigns it: group_id, else question_id.
        group_id = record.group_id or record.question_id or ""
        episodes.append(GradedEpisode(episode_id, group_id, float(grades.reward)))
    if no_gold:
        shown = ", ".join(no_gold[:5]) + (f" and {len(no_gold) - 5} more" if len(no_gold) > 5 else "")
        raise GRPOError(
            f"{path}: {len(no_gold)} of {len(no_gold) + len(episodes)} records have no gold_answer "
            f"(episodes {shown}); the grader needs one to compute a reward"
        )
    if not episodes:
        raise GRPOError(f"{path}: no episode records")
    return rewards, contributions, episodes


# --- 2. credit --------------------------------------------------------------------------------------


def sample_credit(
    samples: Sequence[Sample], episodes: Sequence[GradedEpisode] = ()
) -> list[HierarchicalCredit]:
    """Each sample's advantage and loss weight, aligned with `samples`.

    Per group: the episodes (those in `episodes`, which may have no trainable trajectory and still
    count in the group's reward baseline, plus those of the samples) become `EpisodeCredit`s with
    one contribution per sample, and `hierarchical_credit` does the rest. A sample's reward and
    contribution are its `episode_reward` and `contribution` (None reward: 0).
    """
    credit: dict[int, HierarchicalCredit] = {}
    index = {id(s): i for i, s in enumerate(samples)}
    for group_id, members in group_samples(samples).items():
        by_episode: dict[str, list[Sample]] = {}
        rewards: dict[str, float] = {}
        for episode in episodes:
            if episode.group_id == group_id:
                by_episode.setdefault(episode.episode_id, [])
                rewards[episode.episode_id] = episode.reward
        for sample in members:
            by_episode.setdefault(sample.episode_id, []).append(sample)
            rewards.setdefault(sample.episode_id, sample.episode_reward or 0.0)
        order = list(by_episode)
        group_credit = hierarchical_credit(
            [EpisodeCredit(rewards[e], [s.contribution for s in by_episode[e]]) for e in order]
        )
        for e, episode_credit in zip(order, group_credit, strict=True):
            for sample, c in zip(by_episode[e], episode_credit, strict=True):
                credit[index[id(sample)]] = c
    return [credit[i] for i in range(len(samples))]


# --- 3-5. the update ---------------------------------------------------------------------------------


def load_policy(model_dir: Path, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The trainable policy: float32, training mode."""
    return _load_model(model_dir, "--model", device).train()


def load_reference(ref_dir: Path, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The frozen KL reference (the SFT model): float32, eval mode, no gradient."""
    return _load_model(ref_dir, "--ref", device).eval().requires_grad_(False)


def _load_model(model_dir: Path, what: str, device: torch.device | str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise GRPOError(f"{what} {model_dir}: not a model folder (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=ATTENTION
    )
    return model.to(device)


def make_optimizer(
    policy: torch.nn.Module, lr: float = LR, *, vector_lr_scale: float = 1.0
) -> torch.optim.AdamW:
    """AdamW with seed 001's betas and weight decay; no decay on 1-D parameters (norms, biases).

    `vector_lr_scale` multiplies the 1-D parameters' LR. Adam moves every parameter by about the LR
    per step whatever its size, so at one LR a norm gain near 1 moves tens of times less, relative to
    itself, than a matrix entry near 0.03 (the tiny model's). Scaling the vectors' LR by about that
    ratio gives both kinds the same relative step, the idea behind layer-wise rates (LARS, You et al.
    2017; LAMB, You et al. 2020) and muP's separate Adam rates for matrix-like and vector-like
    parameters (Yang et al. 2022, "Tensor Programs V", Table 3). Each group keeps its multiplier as
    `lr_scale`, so `set_lr` gives every group its share of a new LR.
    """
    if not (math.isfinite(vector_lr_scale) and vector_lr_scale > 0):
        raise GRPOError(f"the vector LR scale must be a finite number > 0, got {vector_lr_scale}")
    params = [p for p in policy.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY, "lr_scale": 1.0},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr_scale": vector_lr_scale},
    ]
    for group in groups:
        group["lr"] = lr * group["lr_scale"]
    return torch.optim.AdamW(groups, lr=lr, betas=BETAS)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every parameter group's LR: `lr` times the group's `lr_scale` (1 where it has none)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def _rows(values: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """A packed [1, T] row as [samples, longest]: one sample per row, zero padded (off the loss mask)."""
    return pad_sequence([values[0, s] for s in batch.slices], batch_first=True)


def mini_batches(samples: Sequence[Sample], count: int) -> list[list[int]]:
    """The update's samples split into `count` mini-batches of whole question groups, one optimizer
    step each (slime's ``--num-steps-per-rollout``, verl's ``ppo_mini_batch_size``).

    Whole groups, because a group's advantages are centred on its own mean: a mini-batch that held
    only a group's better samples would be a step with no baseline. Groups are dealt largest first
    (by tokens) to the mini-batch with the fewest tokens so far, so the steps see similar amounts of
    data; each mini-batch lists its sample indices ascending, and the mini-batches keep the order of
    their first group. Fewer groups than `count` gives one mini-batch per group. Deterministic.
    """
    if count < 1:
        raise GRPOError(f"mini-batches per update must be at least 1, got {count}")
    groups: dict[str, list[int]] = {}
    for i, sample in enumerate(samples):
        groups.setdefault(sample.group_id, []).append(i)
    members = list(groups.values())
    sizes = [sum(len(samples[i]) for i in g) for g in members]
    count = min(count, len(members))
    bins: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    for g in sorted(range(len(members)), key=lambda g: (-sizes[g], g)):
        target = min(range(count), key=lambda b: (loads[b], b))
        bins[target].append(g)
        loads[target] += sizes[g]
    ordered = sorted((sorted(b) for b in bins if b), key=lambda b: b[0])
    return [sorted(i for g in b for i in members[g]) for b in ordered]


def grpo_step(
    policy: torch.nn.Module,
    ref: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: Sequence[Sample],
    credit: Sequence[HierarchicalCredit],
    *,
    micro_batch_tokens: int = MICRO_BATCH_TOKENS,
    max_grad_norm: float = MAX_GRAD_NORM,
    layout: Layout | None = None,
    steps: int = 1,
    aggregation: str = "sample-mean",
    token_norm: float = 1.0,
) -> dict[str, float]:
    """One GRPO update of `policy` on `samples` (with `credit` aligned to them); returns its stats.

    `aggregation` and `token_norm`: how a sample's token losses are combined (`trainer.loss`:
    "sample-mean", or "token-sum" over the constant `token_norm`).

    `steps` > 1 splits the update into that many mini-batches of whole groups (`mini_batches`) and
    takes one optimizer step on each, in turn; logp_old and logp_ref are computed for every sample
    before the first step, so from the second step on the PPO ratio is no longer 1 and the clip
    keeps each step near the policy that generated the rollouts (PPO's several minibatch steps per
    batch, Schulman et al. 2017, §5). `steps` = 1 is one step on the whole batch.

    Stats: loss, pg_loss, kl (weighted like the loss, over the whole update); tis_clip_fraction,
    ppo_clip_fraction, ratio_mean and logp_rollout_abs_diff (mean |logp_old − logp_rollout|, the
    train/inference mismatch), all over loss tokens; advantage_mean/std/min/max over samples;
    grad_norm (before clipping; the mean over the steps); optimizer_steps; tokens, loss_tokens,
    tokens_per_second, micro_batches, samples, seconds. A non-finite loss or gradient raises
    GRPOError before that step is taken.
    """
    started = time.perf_counter()
    layout = layout or Layout.single()
    update_weight = sum(c.weight for s, c in zip(samples, credit, strict=True) if any(s.loss_mask))
    if update_weight <= 0:
        raise GRPOError("no generated tokens to train on (every loss mask is 0)")
    advantages = torch.tensor([c.advantage for c in credit], dtype=torch.float32)
    weights = torch.tensor([c.weight for c in credit], dtype=torch.float32)
    # Each mini-batch's micro-batches (indices into `samples`), and this dp rank's share of them;
    # every rank runs as many (padding slots train with scale 0).
    plans = []
    for members in mini_batches(samples, steps):
        lengths = [len(samples[i]) for i in members]
        bins = first_fit_pack(lengths, micro_batch_tokens)
        batches = [pack(samples, [members[j] for j in b]) for b in bins]
        plans.append((members, batches, layout.schedule(batches, [b.num_tokens for b in batches])))

    sums = dict.fromkeys(("loss", "pg_loss", "kl", *TOKEN_MEANS, "mismatch", "loss_tokens", "tokens"), 0.0)
    norms: list[float] = []
    optimizer.zero_grad(set_to_none=True)
    with layout.train_context():
        # Targets, fixed before any weight moves: the policy's own log-probs (logp_old) and the reference's.
        with torch.no_grad():
            logp_old = [[per_token_logprobs(policy, b) for b, _ in plan] for _, _, plan in plans]
            logp_ref = [[per_token_logprobs(ref, b) for b, _ in plan] for _, _, plan in plans]
        for (members, _, plan), olds, refs in zip(plans, logp_old, logp_ref, strict=True):
            # A step's loss is Σ_i w_i·l_i / Σ_i w_i over ALL its samples (samples without loss tokens
            # do not count). Each micro-batch's grpo_loss is normalized by its own Σ w, so scaling it by
            # (its Σ w) / (the step's Σ w) makes the summed losses and gradients the step's, summed
            # over micro-batches and over dp ranks alike.
            step_weight = sum(credit[i].weight for i in members if any(samples[i].loss_mask))
            if step_weight <= 0:
                continue  # a mini-batch with nothing generated: no step
            step_loss = 0.0
            for (batch, real), old, reference in zip(plan, olds, refs, strict=True):
                logp = per_token_logprobs(policy, batch)
                device = logp.device  # the batch and the credit live on the CPU until here
                mask = _rows(batch.loss_mask, batch).to(device)
                which = list(batch.indices)
                loss, stats = grpo_loss(
                    _rows(logp, batch),
                    _rows(old, batch),
                    _rows(batch.rollout_logprobs, batch).to(device),
                    _rows(reference, batch),
                    advantages[which].to(device),
                    mask,
                    sample_weights=weights[which].to(device),
                    aggregation=aggregation,
                    token_norm=token_norm,
                )
                share = stats["sample_weight_sum"] / step_weight if real else 0.0
                (loss * share).backward()
                if not real:
                    continue
                step_loss += stats["loss"] * share
                n = int(mask.sum())
                # The update's statistics weigh each sample as the one-step loss would.
                for key in ("loss", "pg_loss", "kl"):
                    sums[key] += stats[key] * stats["sample_weight_sum"] / update_weight
                for key in TOKEN_MEANS:
                    sums[key] += stats[key] * n
                # How far the trainer's log-probs are from the engine's (train/inference mismatch).
                mismatch = (old - batch.rollout_logprobs.to(device)).abs() * batch.loss_mask.to(device)
                sums["mismatch"] += float(mismatch.sum())
                sums["loss_tokens"] += n
                sums["tokens"] += batch.num_tokens
            (step_loss,) = layout.sum_over_dp([step_loss])
            grad_norm = grad_norm_clip(policy.parameters(), max_grad_norm)
            if not (math.isfinite(step_loss) and math.isfinite(grad_norm)):
                optimizer.zero_grad(set_to_none=True)
                raise GRPOError(
                    f"non-finite loss or gradient (loss {step_loss}, grad norm {grad_norm}) at step "
                    f"{len(norms) + 1} of the update; that step was not made"
                )
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            norms.append(grad_norm)
    sums = dict(zip(sums, layout.sum_over_dp(list(sums.values())), strict=True))
    totals = {key: sums[key] for key in ("loss", "pg_loss", "kl")}
    loss_tokens = int(sums["loss_tokens"])

    seconds = layout.max_over_world(time.perf_counter() - started)
    tokens = int(sums["tokens"])
    adv = [c.advantage for c in credit]
    return {
        **totals,
        **{k: sums[k] / max(loss_tokens, 1) for k in TOKEN_MEANS},
        "logp_rollout_abs_diff": sums["mismatch"] / max(loss_tokens, 1),
        "advantage_mean": statistics.fmean(adv),
        "advantage_std": statistics.pstdev(adv),
        "advantage_min": min(adv),
        "advantage_max": max(adv),
        "grad_norm": statistics.fmean(norms) if norms else 0.0,
        "optimizer_steps": len(norms),
        "tokens": tokens,
        "loss_tokens": loss_tokens,
        "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
        "micro_batches": sum(len(batches) for _, batches, _ in plans),
        "samples": len(samples),
        "seconds": seconds,
    }


# --- the run -----------------------------------------------------------------------------------------


def rollout_batches(samples: Sequence[Sample], groups_per_step: int) -> list[list[Sample]]:
    """The samples split into updates of `groups_per_step` question groups, in order of appearance."""
    if groups_per_step < 1:
        raise GRPOError(f"groups per step must be at least 1, got {groups_per_step}")
    groups = list(group_samples(samples).values())
    return [
        [s for group in groups[i : i + groups_per_step] for s in group]
        for i in range(0, len(groups), groups_per_step)
    ]


def _describe(step: int, steps: int, m: Mapping[str, Any]) -> str:
    return (
        f"step {step}/{steps}  loss {m['loss']:+.5f}  pg {m['pg_loss']:+.5f}  kl {m['kl']:.2e}  "
        f"tis_clip {m['tis_clip_fraction']:.3f}  ppo_clip {m['ppo_clip_fraction']:.3f}  "
        f"adv {m['advantage_mean']:+.3f}±{m['advantage_std']:.3f} "
        f"[{m['advantage_min']:+.3f}, {m['advantage_max']:+.3f}]  "
        f"reward {m['reward_mean']:.3f}  grad_norm {m['grad_norm']:.3e}  "
        f"tokens {m['tokens']:,}  {m['tokens_per_second']:,.0f} tok/s"
    )


def _keep_metrics_until(path: Path, step: int) -> None:
    """Drop metrics lines of steps after `step` (written before a crash took their checkpoint)."""
    if not path.is_file():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    path.write_text("".join(line + "\n" for line in lines if json.loads(line).get("step", 0) <= step))


def train(
    records: Path,
    model_dir: Path,
    ref_dir: Path,
    out_dir: Path,
    *,
    lr: float = LR,
    micro_batch_tokens: int = MICRO_BATCH_TOKENS,
    grader: Grader = rule_grades,
    steps: int = 1,
    resume: bool = False,
    groups_per_step: int = GROUPS_PER_STEP,
    mixed_versions: str = "keep",
    layout: Layout | None = None,
    say: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Train until the policy has taken `steps` updates; returns this run's metrics, one dict per step.

    `grader` grades each record (default: the rule grader; the hook for the judge proxy). With
    `resume` the run continues from the newest checkpoint under OUT/checkpoints (from step 1 when
    there is none); without it, OUT must not hold checkpoints already. Each step's metrics
    (`grpo_step`'s stats plus step, reward_mean and episodes over the batch's groups, groups, lr,
    batch) go to `say` as one line and to OUT/metrics.jsonl; the final policy is exported to
    OUT/serving. Under torchrun (`layout`: the [dp, tp] mesh) every rank trains its share and rank 0
    alone prints, writes metrics and exports; checkpoints are sharded (`trainer.checkpoint`).
    """
    layout = layout or Layout.single()
    if not layout.is_main:
        say = silent
    records, model_dir, ref_dir, out_dir = Path(records), Path(model_dir), Path(ref_dir), Path(out_dir)
    if steps < 1:
        raise GRPOError(f"--steps must be at least 1, got {steps}")
    rewards, contributions, episodes = grade_records(records, grader)
    # A trajectory whose turns span a hot reload (several weight versions): keep, drop or error.
    samples, counts = load_samples(
        records, rewards=rewards, contributions=contributions, mixed_versions=mixed_versions
    )
    if not samples:
        raise GRPOError(f"{records}: no worker trajectories to train on ({counts['records']} records)")
    batches = rollout_batches(samples, groups_per_step)
    say(
        f"{counts['records']} episodes, {len(samples)} worker trajectories "
        f"({counts['skipped_failed']} failed branches without one, {counts['dropped_mixed']} dropped as "
        f"mixed-version), {len(batches)} rollout batch(es) of "
        f"up to {groups_per_step} groups; mean reward {statistics.fmean(rewards.values()):.3f}"
    )

    checkpoints = out_dir / CHECKPOINTS_DIR
    metrics_path = out_dir / METRICS_FILE
    latest = latest_checkpoint(checkpoints)
    if latest is not None and not resume:
        raise GRPOError(
            f"{out_dir} already holds checkpoints (latest {latest.name}); pass --resume or a new --out"
        )
    policy = parallelize(load_policy(model_dir, layout.device), layout)
    ref = parallelize(load_reference(ref_dir, layout.device), layout)
    say(f"layout: {layout.describe()}")
    optimizer = make_optimizer(policy, lr)
    step, next_batch = 0, 0
    if latest is not None:
        state = load_checkpoint(latest, model=policy, optimizer=optimizer, layout=layout)
        step = state["step"]
        if state["data_cursor"].get("records") == str(records.resolve()):
            next_batch = state["data_cursor"].get("next_batch", 0)
        set_lr(optimizer, lr)  # the command line's LR wins over the checkpoint's
        if layout.is_main:
            _keep_metrics_until(metrics_path, step)
        say(f"resumed from {latest} (step {step})")
    else:
        if resume:
            say(f"no checkpoint under {checkpoints}; starting at step 1")
        if layout.is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
            metrics_path.write_text("")
        layout.barrier()
    if step >= steps:
        say(f"already at step {step}, nothing to do for --steps {steps}")
        return []

    run_metrics: list[dict[str, Any]] = []
    while step < steps:
        step += 1
        batch_index = next_batch % len(batches)
        batch = batches[batch_index]
        stats = grpo_step(
            policy,
            ref,
            optimizer,
            batch,
            sample_credit(batch, episodes),
            micro_batch_tokens=micro_batch_tokens,
            layout=layout,
        )
        batch_groups = {s.group_id for s in batch}
        batch_rewards = [e.reward for e in episodes if e.group_id in batch_groups]
        metrics = {
            "step": step,
            **stats,
            "reward_mean": statistics.fmean(batch_rewards),
            "episodes": len(batch_rewards),
            "groups": len(batch_groups),
            "lr": optimizer.param_groups[0]["lr"],
            "batch": batch_index,
        }
        say(_describe(step, steps, metrics))
        if layout.is_main:
            with metrics_path.open("a") as handle:
                handle.write(json.dumps(metrics) + "\n")
        next_batch = batch_index + 1
        save_checkpoint(
            checkpoints,
            step,
            model=policy,
            optimizer=optimizer,
            data_cursor={"records": str(records.resolve()), "next_batch": next_batch},
            extra={"model": str(model_dir), "ref": str(ref_dir), "lr": lr},
            layout=layout,
        )
        run_metrics.append(metrics)

    export_serving(policy, model_dir, out_dir / SERVING_DIR, layout=layout)
    say(f"step {step} checkpoint in {checkpoints}, serving export in {out_dir / SERVING_DIR}")
    return run_metrics


def export_serving(
    policy: torch.nn.Module, tokenizer_dir: Path, serving_dir: Path, *, layout: Layout | None = None
) -> dict[str, Any]:
    """Export `policy` to the serving format (BF16, trimmed vocabulary, SHA256SUMS), verified,
    with the tokenizer files of `tokenizer_dir`; replaces an earlier export atomically.

    A sharded policy is gathered to full tensors first (every rank takes part); rank 0 writes and
    returns the summary, the other ranks return {} once it is in place.
    """
    from trainer.export import export_checkpoint

    layout = layout or Layout.single()
    state = full_state_dict(policy)
    summary: dict[str, Any] = {}
    if layout.is_main:
        serving_dir.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".hf-", dir=serving_dir.parent) as hf:
            policy.save_pretrained(hf, state_dict=state)
            summary = export_checkpoint(Path(hf), serving_dir, tokenizer_dir=tokenizer_dir, force=True)
    layout.barrier()
    return summary
