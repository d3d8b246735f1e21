"""Single-turn domain RL with a LoRA adapter: seed 004's specialist recipe, read top to bottom.

One update (`bcstack train grpo --env math --engine URL ...`):

1. sample  `prompts_per_step` training prompts (a seeded shuffle, epoch after epoch) and `responses`
           responses to each from the engine serving the current policy (SGLang `/generate`, thinking
           disabled, T 1.0, top-p 1.0, top-k off, a response cap), with the engine's log-probs;
2. reward  each response by the verifier (1 correct, 0 not);
3. centre  advantages within each prompt's group: A = r − mean(r), no division by the std;
4. filter  responses stopped at the length limit, groups whose rewards are all equal and responses
           whose advantage is 0 get no gradient; all three are counted (sampled responses vs gradient
           examples, as the seed reports them);
5. loss    PPO clip [1 − 0.2, 1 + 0.2] on each kept response's tokens, token mean per response, equal
           weight per response; no critic, no KL (`trainer.loss.grpo_loss` with kl_coef 0);
6. step    Adam (1e-5, linear warm-up over 10 updates) on the LoRA matrices only;
7. serve   merge the adapter into the base in FP32 and hot-reload the engine with it
           (`/update_weights_from_disk`, weight version `lora-N`), so the next update samples from it.

Every update appends a line to OUT/metrics.jsonl; every `eval_every` updates the development prompts
are scored greedily (`dev_pass`); checkpoints (adapter, optimizer, sampler, counters) are crash-safe
(`trainer.checkpoint`) and `--resume` continues from the newest, reloading the engine to it first.
At the end OUT/adapter holds the peft adapter and OUT/serving the merged BF16 export
(`trainer.lora.merge_lora`, with its provenance and logits check).

Simplified, and why:
- One optimizer step per rollout batch, so the policy that sampled is the policy being trained: the
  PPO ratio starts at 1 (the clip binds only with `--mini-batches` > 1). Engine and trainer log-probs
  differ by kernels only (both float32 here); TIS is off by default because the seed names none
  (`--tis-cap` turns it on).
- Rollouts wait for the update (synchronous); the episode RL loop (`bcstack train rl`) is where
  asynchrony lives.
- The engine serves the merged model: SGLang can also serve a LoRA adapter directly
  (`--enable-lora`, `/load_lora_adapter`), which would skip the merge per update on a GPU cluster;
  the CPU engine serves only full weights.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from core.engine_client import EngineClient, EngineError
from core.single_turn import PromptRow, Response, SamplingSettings, TextCodec, load_prompts, sample_responses
from core.verifiers import Verifier, verifier_for
from trainer.attention import VARLEN
from trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from trainer.lora import LoraSettings, attach_lora, merge_lora, save_merged
from trainer.loss import grpo_loss
from trainer.packing import first_fit_pack, pack, per_token_logprobs

LR = 1e-5  # seed 004: "Adam learning rate 1e-5, 10-update warmup, clipping ratios [0.8, 1.2]"
WARMUP_UPDATES = 10
CLIP_EPS = 0.2
PROMPTS_PER_STEP = 32  # seed 004: "Up to 32 prompts x 8 responses per batch"
RESPONSES = 8
MAX_RESPONSE_TOKENS = 16_384
MAX_GRAD_NORM = 1.0  # not in the seed: Megatron's --clip-grad default, as the episode trainer uses
ENVS = {"math": "math", "code": "code", "if": "if"}  # --env -> verifier


class SpecialistError(ValueError):
    """A setting or input that stops the run (one line)."""


@dataclass
class SpecialistConfig:
    base: Path  # the model the adapter is trained on (HF folder with tokenizer)
    prompts: Path  # training rows (prompt + label)
    out: Path
    engine_url: str
    env: str = "math"
    dev_prompts: Path | None = None
    lora: LoraSettings = field(default_factory=LoraSettings)
    lr: float = LR
    warmup_updates: int = WARMUP_UPDATES
    clip_eps: float = CLIP_EPS
    tis_cap: float | None = None
    prompts_per_step: int = PROMPTS_PER_STEP
    responses: int = RESPONSES
    max_response_tokens: int = MAX_RESPONSE_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    steps: int = 10
    mini_batches: int = 1
    micro_batch_tokens: int = 8192
    eval_every: int = 5
    seed: int = 0
    resume: bool = False
    admin_token: str | None = None
    keep_rollout_weights: int = 2

    def validate(self) -> None:
        if self.env not in ENVS:
            raise SpecialistError(f"--env {self.env!r}: choose one of {', '.join(ENVS)}")
        if self.responses < 2:
            raise SpecialistError("--responses must be at least 2: advantages are centred within a group")
        if self.mini_batches < 1 or self.mini_batches > self.prompts_per_step:
            raise SpecialistError("--mini-batches must be between 1 and --prompts-per-step")
        if not (self.lr >= 0 and math.isfinite(self.lr)):
            raise SpecialistError(f"--lr must be a finite number >= 0, got {self.lr}")
        if not (0 < self.clip_eps < 1):
            raise SpecialistError(f"--clip-eps must be in (0, 1), got {self.clip_eps}")
        if not (self.base / "config.json").is_file():
            raise SpecialistError(f"--model {self.base}: not a model folder (no config.json)")


@dataclass
class GroupStats:
    sampled: int = 0
    truncated: int = 0
    constant_groups: int = 0
    zero_advantage: int = 0
    gradient_examples: int = 0


def centred_advantages(rewards: Sequence[float]) -> list[float]:
    """Seed 004: subtract the group's mean reward, no standard-deviation normalisation."""
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def select_examples(
    groups: Sequence[Sequence[Response]], rewards: Sequence[Sequence[float]]
) -> tuple[list[tuple[Response, float]], GroupStats]:
    """The (response, advantage) pairs that get a gradient, and the counts of what was left out.

    Order of exclusion (each response counted once, so gradient examples + responses of constant
    groups + length-stopped + zero-advantage = sampled): a group whose rewards are all equal (its
    advantages are all 0: nothing to learn, seed: "constant-reward groups"), then responses stopped
    at the length limit, then responses whose centred advantage is exactly 0.
    """
    stats = GroupStats()
    kept: list[tuple[Response, float]] = []
    for group, group_rewards in zip(groups, rewards, strict=True):
        stats.sampled += len(group)
        if len(set(group_rewards)) <= 1:
            stats.constant_groups += 1
            continue
        for response, advantage in zip(group, centred_advantages(group_rewards), strict=True):
            if response.truncated:
                stats.truncated += 1
            elif advantage == 0:
                stats.zero_advantage += 1
            else:
                kept.append((response, advantage))
    stats.gradient_examples = len(kept)
    return kept, stats


@dataclass(frozen=True)
class _Sample:
    """A response as the packer wants it: prompt + response ids, loss on the response tokens."""

    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    rollout_logprobs: tuple[float, ...]


def to_sample(response: Response) -> _Sample:
    n_prompt, n_out = len(response.prompt_ids), len(response.output_ids)
    logprobs = list(response.logprobs) if len(response.logprobs) == n_out else [0.0] * n_out
    return _Sample(
        tuple(response.prompt_ids) + tuple(response.output_ids),
        (0,) * n_prompt + (1,) * n_out,
        (0.0,) * n_prompt + tuple(logprobs),
    )


def policy_loss_step(
    model: torch.nn.Module,
    examples: Sequence[tuple[Response, float]],
    *,
    clip_eps: float,
    tis_cap: float | None,
    micro_batch_tokens: int,
    logp_old: dict[int, torch.Tensor] | None = None,
) -> dict[str, float]:
    """Backward of the PPO-clip loss over `examples` (equal weight per response); returns stats.

    `logp_old` (per example index, [1, T] tensors) fixes the old policy's log-probs across
    mini-batches; None means this is the first pass (ratio 1).
    """
    samples = [to_sample(r) for r, _ in examples]
    bins = first_fit_pack([len(s.token_ids) for s in samples], micro_batch_tokens)
    total = len(samples)
    sums = {"loss": 0.0, "ppo_clip_fraction": 0.0, "tis_clip_fraction": 0.0}
    for indices in bins:
        batch = pack(samples, indices)
        logp = per_token_logprobs(model, batch)
        old = torch.cat([logp_old[i] for i in indices], dim=1) if logp_old is not None else logp.detach()
        advantages = torch.zeros_like(logp)
        for k, i in enumerate(indices):
            advantages[0, batch.slices[k]] = examples[i][1]
        rollout = batch.rollout_logprobs if tis_cap is not None else old
        # Each response is one sample of a [k, T_i] batch would be clearer; one packed row with
        # per-sample token means is the same loss (trainer.packing.sample_token_means).
        per_sample = []
        for sl in batch.slices:
            loss_k, stats_k = grpo_loss(
                logp[:, sl],
                old[:, sl],
                rollout[:, sl],
                logp[:, sl].detach(),
                advantages[:, sl],
                batch.loss_mask[:, sl],
                eps_low=clip_eps,
                eps_high=clip_eps,
                tis_cap=tis_cap if tis_cap is not None else 2.0,
                kl_coef=0.0,
            )
            per_sample.append(loss_k)
            for key in sums:
                sums[key] += stats_k[key] / total
        (torch.stack(per_sample).sum() / total).backward()
    return sums


def policy_update(
    peft_model: Any,
    optimizer: torch.optim.Optimizer,
    kept: Sequence[tuple[Response, float]],
    *,
    mini_batches: int,
    clip_eps: float,
    tis_cap: float | None,
    micro_batch_tokens: int,
) -> tuple[dict[str, float], float]:
    """One update's optimizer steps on the LoRA matrices: `mini_batches` steps over interleaved
    shares of `kept`, each clipped to MAX_GRAD_NORM; returns the mean stats and the last grad norm."""
    stats = {"loss": 0.0, "ppo_clip_fraction": 0.0, "tis_clip_fraction": 0.0}
    grad_norm = 0.0
    if not kept:
        return stats, grad_norm
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    logp_old = None
    if mini_batches > 1:  # the old policy's log-probs, fixed before the first step
        with torch.no_grad():
            logp_old = _old_logprobs(peft_model, kept, micro_batch_tokens)
    for first in range(mini_batches):
        positions = range(first, len(kept), mini_batches)
        chunk = [kept[i] for i in positions]
        if not chunk:
            continue
        optimizer.zero_grad(set_to_none=True)
        old = None if logp_old is None else {k: logp_old[i] for k, i in enumerate(positions)}
        part = policy_loss_step(
            peft_model.get_base_model(),
            chunk,
            clip_eps=clip_eps,
            tis_cap=tis_cap,
            micro_batch_tokens=micro_batch_tokens,
            logp_old=old,
        )
        grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable, MAX_GRAD_NORM))
        optimizer.step()
        for key in stats:
            stats[key] += part[key] / mini_batches
    return stats, grad_norm


def warmup_lr(update: int, lr: float, warmup_updates: int) -> float:
    """Linear warm-up over `warmup_updates` updates (update counts from 1), then constant `lr`
    (seed 004's 10-update warm-up; RL and distillation alike)."""
    if warmup_updates <= 0:
        return lr
    return lr * min(1.0, update / warmup_updates)


class PromptSampler:
    """Training prompts in a seeded shuffle, epoch after epoch; its state is two integers."""

    def __init__(self, n: int, seed: int, epoch: int = 0, cursor: int = 0) -> None:
        self.n, self.seed, self.epoch, self.cursor = n, seed, epoch, cursor

    def _order(self) -> list[int]:
        order = list(range(self.n))
        random.Random(f"{self.seed}:{self.epoch}").shuffle(order)
        return order

    def take(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            order = self._order()
            room = min(k - len(out), self.n - self.cursor)
            out += order[self.cursor : self.cursor + room]
            self.cursor += room
            if self.cursor >= self.n:
                self.epoch, self.cursor = self.epoch + 1, 0
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}


async def _collect(
    client: EngineClient,
    codec: TextCodec,
    rows: Sequence[PromptRow],
    n: int,
    settings: SamplingSettings,
    seed: int,
    context_length: int | None = None,
) -> list[list[Response]]:
    return list(
        await asyncio.gather(
            *(
                sample_responses(client, codec, r, n, settings, seed=seed, context_length=context_length)
                for r in rows
            )
        )
    )


async def pass_rate(
    client: EngineClient, codec: TextCodec, rows: Sequence[PromptRow], verifier: Verifier, max_new: int
) -> float:
    """Greedy pass rate over `rows` (the development check during training)."""
    settings = SamplingSettings(temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=max_new)
    groups = await _collect(client, codec, rows, 1, settings, 0)
    return sum(verifier.score(g[0].text, r.label).correct for g, r in zip(groups, rows, strict=True)) / len(
        rows
    )


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def train_specialist(cfg: SpecialistConfig, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Run `cfg.steps` updates; returns the final summary (also in OUT/summary.json)."""
    return asyncio.run(_train(cfg, say))


async def reload_engine(client: EngineClient, path: Path, version: str) -> None:
    ok, message = await client.update_weights_from_disk(str(path.resolve()), weight_version=version)
    if not ok:
        raise SpecialistError(f"the engine refused the merged weights {path}: {message}")


async def _train(cfg: SpecialistConfig, say: Callable[[str], None]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    cfg.validate()
    verifier = verifier_for(ENVS[cfg.env])
    rows = load_prompts(cfg.prompts)
    dev_rows = load_prompts(cfg.dev_prompts) if cfg.dev_prompts else []
    codec = TextCodec(cfg.base)
    for row in rows[:1]:
        verifier.score("", row.label)  # a label the verifier cannot read fails now, not mid-run
    cfg.out.mkdir(parents=True, exist_ok=True)
    metrics_path = cfg.out / "metrics.jsonl"
    torch.manual_seed(cfg.seed)

    model = AutoModelForCausalLM.from_pretrained(cfg.base, dtype=torch.float32, attn_implementation=VARLEN)
    peft_model = attach_lora(model, cfg.lora)
    peft_model.train()
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=warmup_lr(1, cfg.lr, cfg.warmup_updates))
    sampler = PromptSampler(len(rows), cfg.seed)
    update = 0
    settings = SamplingSettings(cfg.temperature, cfg.top_p, cfg.top_k, cfg.max_response_tokens)
    ckpt_root = cfg.out / "checkpoints"
    rollout_root = cfg.out / "rollout"

    client = EngineClient(cfg.engine_url, admin_token=cfg.admin_token, timeout_s=3600)
    try:
        if cfg.resume:
            latest = latest_checkpoint(ckpt_root)
            if latest is None:
                raise SpecialistError(f"--resume: no complete checkpoint under {ckpt_root}")
            state = load_checkpoint(latest, model=peft_model, optimizer=optimizer)
            update = int(state["step"])
            sampler = PromptSampler(len(rows), cfg.seed, **state["data_cursor"])
            say(f"resumed at update {update} from {latest}")
            path = rollout_root / f"update-{update:06d}"
            save_merged(peft_model, path, tokenizer_dir=cfg.base)
            await reload_engine(client, path, f"lora-{update}")
        else:
            if not await client.health():
                raise SpecialistError(f"the engine at {cfg.engine_url} does not answer /health")
            # The engine may serve anything (an earlier run's policy): start it on the base, exactly as
            # the trainer holds it (fresh LoRA B matrices are 0, so this is the base in float32).
            path = rollout_root / f"update-{update:06d}"
            save_merged(peft_model, path, tokenizer_dir=cfg.base)
            await reload_engine(client, path, "lora-0")
        if not cfg.resume and metrics_path.exists():
            metrics_path.unlink()
        # SGLang's /model_info has no context length; the CPU engine reports one: cap by it then.
        max_context = (await client.model_info()).get("context_length")
        started = time.perf_counter()
        while update < cfg.steps:
            update += 1
            t0 = time.perf_counter()
            batch_rows = [rows[i] for i in sampler.take(cfg.prompts_per_step)]
            groups = await _collect(
                client, codec, batch_rows, cfg.responses, settings, cfg.seed * 1_000_003 + update, max_context
            )
            rewards = [
                [float(verifier.score(r.text, row.label).correct) for r in g]
                for g, row in zip(groups, batch_rows, strict=True)
            ]
            t_rollout = time.perf_counter() - t0
            kept, counts = select_examples(groups, rewards)
            for group in groups:
                version = {r.weight_version for r in group}
                if len(version) > 1:
                    raise SpecialistError(
                        "responses of one group came from several weight versions "
                        f"{sorted(map(str, version))}"
                    )
            for g in optimizer.param_groups:
                g["lr"] = warmup_lr(update, cfg.lr, cfg.warmup_updates)
            stats, grad_norm = policy_update(
                peft_model,
                optimizer,
                kept,
                mini_batches=cfg.mini_batches,
                clip_eps=cfg.clip_eps,
                tis_cap=cfg.tis_cap,
                micro_batch_tokens=cfg.micro_batch_tokens,
            )
            path = rollout_root / f"update-{update:06d}"
            save_merged(peft_model, path, tokenizer_dir=cfg.base)
            await reload_engine(client, path, f"lora-{update}")
            prune_rollout_weights(rollout_root, cfg.keep_rollout_weights)
            flat = [x for g in rewards for x in g]
            lengths = [len(r.output_ids) for g in groups for r in g]
            line: dict[str, Any] = {
                "update": update,
                "lr": warmup_lr(update, cfg.lr, cfg.warmup_updates),
                "reward_mean": statistics.fmean(flat),
                "pass_at_1_train": statistics.fmean(flat),
                "sampled_responses": counts.sampled,
                "gradient_examples": counts.gradient_examples,
                "constant_reward_groups": counts.constant_groups,
                "zero_advantage_responses": counts.zero_advantage,
                "length_stopped_responses": counts.truncated,
                "response_tokens_mean": statistics.fmean(lengths),
                "loss": stats["loss"],
                "grad_norm": grad_norm,
                "ppo_clip_fraction": stats["ppo_clip_fraction"],
                "rollout_seconds": round(t_rollout, 3),
                "update_seconds": round(time.perf_counter() - t0, 3),
                "weight_version": f"lora-{update}",
            }
            if dev_rows and (update % cfg.eval_every == 0 or update == cfg.steps):
                line["dev_pass"] = await pass_rate(client, codec, dev_rows, verifier, cfg.max_response_tokens)
            append_jsonl(metrics_path, line)
            save_checkpoint(
                ckpt_root,
                update,
                model=peft_model,
                optimizer=optimizer,
                data_cursor=sampler.state(),
                extra={"config": _config_json(cfg)},
            )
            dev = f" dev {line['dev_pass']:.3f}" if "dev_pass" in line else ""
            say(
                f"update {update}/{cfg.steps} reward {line['reward_mean']:.3f} "
                f"grad examples {counts.gradient_examples}/{counts.sampled} "
                f"(constant groups {counts.constant_groups}, length-stopped {counts.truncated}) "
                f"loss {stats['loss']:.4f}{dev} {line['update_seconds']:.1f}s"
            )
        say("merging the adapter into the base (FP32 merge, BF16 export, logits check)")
        return finish_run(peft_model, cfg.base, cfg.out, updates=update, started=started)
    except EngineError as e:
        raise SpecialistError(f"engine {cfg.engine_url}: {e}") from None
    finally:
        await client.close()


def finish_run(peft_model: Any, base: Path, out: Path, *, updates: int, started: float) -> dict[str, Any]:
    """Save OUT/adapter, merge it into OUT/serving (checked), write and return OUT/summary.json."""
    adapter_dir = out / "adapter"
    shutil.rmtree(adapter_dir, ignore_errors=True)
    # The head's base weight is the base's own (untied copy of the embedding): not saved again.
    peft_model.save_pretrained(str(adapter_dir), save_embedding_layers=False)
    provenance = merge_lora(base, adapter_dir, out / "serving", force=True)
    summary = {
        "updates": updates,
        "seconds": round(time.perf_counter() - started, 1),
        "adapter": str(adapter_dir),
        "serving": str(out / "serving"),
        "adapter_tensors": provenance["adapter_tensors"],
        "logits_check": provenance["logits_check"]["passed"],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _old_logprobs(model: Any, kept: Sequence[tuple[Response, float]], budget: int) -> list[torch.Tensor]:
    samples = [to_sample(r) for r, _ in kept]
    out: list[torch.Tensor | None] = [None] * len(samples)
    for indices in first_fit_pack([len(s.token_ids) for s in samples], budget):
        batch = pack(samples, indices)
        logp = per_token_logprobs(model.get_base_model(), batch)
        for k, i in enumerate(indices):
            out[i] = logp[:, batch.slices[k]].detach()
    return [t for t in out if t is not None]


def prune_rollout_weights(root: Path, keep: int) -> None:
    folders = sorted(p for p in root.glob("update-*") if p.is_dir())
    for old in folders[:-keep] if keep > 0 else folders:
        shutil.rmtree(old, ignore_errors=True)


def _config_json(cfg: SpecialistConfig) -> dict[str, Any]:
    data = asdict(cfg)
    data.pop("admin_token", None)  # a secret never goes to disk
    return json.loads(json.dumps(data, default=str))
