"""Multi-teacher on-policy distillation (MOPD, seed 004): the student samples, each prompt's domain
teacher scores the student's tokens, and the per-token reverse KL is the training signal.

One update (`bcstack train distill --teachers teachers.json --engine URL --prompts FILE ...`):

1. sample  prompts from the mixed training rows (each row names its `domain`) and responses from
           the engine serving the student (on-policy; thinking disabled, as the teachers were trained);
2. score   each response under its domain's teacher through SGLang `/generate` with
           `max_new_tokens: 0`, `return_logprob: true` and `logprob_start_len` at the prompt's last
           token: SGLang scores no token at `logprob_start_len` (the list starts with None), so
           starting one early and dropping that None gives the teacher's log-prob of every token
           the student wrote, the first one included;
3. signal  per response token t: A_t = −(log π_student(y_t) − log π_teacher(y_t)), the negative
           sampled reverse KL (REFERENCE.md "On-policy distillation": A_t −= λ·(logp_student −
           logp_teacher), λ = `kl_weight`); with `reward_weight` > 0 the verifier's group-centred
           reward is added to every token of the response (seed 004's RL advantage);
4. loss    the same PPO-clip policy-gradient step as the specialists' RL (`trainer.specialist`), the
           per-token A in place of one advantage per response; LoRA on the student; merge and
           hot-reload the engine after each update.

teachers.json (the `mopd_teachers.json` idea of seed 004: a model per domain plus the settings that
must match the student's)::

    {"enable_thinking": false,
     "teachers": {"arithmetic": {"model": "runs/arith/serving", "engine": "http://...:30001"},
                  "sequence":   {"model": "runs/seq/serving"}}}

`model` is the teacher's folder (read for its tokenizer and chat template); `engine` is the URL of an
engine serving it; without one, a CPU engine is started for it. Before anything runs, every
teacher's tokenizer (ids of every token, added tokens included), chat template and thinking mode
must equal the student's; the first difference is named and the run refused, because a teacher's
log-probs of token ids it would tokenize differently are meaningless.

Simplified, and why: teacher log-probs are taken at temperature 1 (the raw distribution), as
on-policy distillation defines the reverse KL; the student's log-probs are the engine's from the
sampling pass at T 1.0, so A_t is the sampled estimate of KL(student ‖ teacher) per token.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from core.engine_client import EngineClient, EngineError
from core.local_engine import LocalEngine, LocalEngineError
from core.single_turn import PromptRow, Response, SamplingSettings, TextCodec, load_prompts, sample_responses
from core.verifiers import verifier_for
from trainer.attention import VARLEN
from trainer.lora import LoraSettings, attach_lora, save_merged
from trainer.loss import grpo_loss
from trainer.packing import first_fit_pack, pack, per_token_logprobs
from trainer.specialist import (
    CLIP_EPS,
    SpecialistError,
    append_jsonl,
    centred_advantages,
    finish_run,
    pass_rate,
    prune_rollout_weights,
    reload_engine,
    warmup_lr,
)

MAX_GRAD_NORM = 1.0


class DistillError(SpecialistError):
    """A teachers file, a teacher or a setting that stops the run (one line)."""


@dataclass(frozen=True)
class Teacher:
    domain: str
    model: Path
    engine: str | None = None


@dataclass
class TeachersFile:
    teachers: dict[str, Teacher]
    enable_thinking: bool = False


def load_teachers(path: Path) -> TeachersFile:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise DistillError(f"--teachers {path}: no such file") from None
    except json.JSONDecodeError as e:
        raise DistillError(f"--teachers {path}: not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict) or not isinstance(data.get("teachers"), dict) or not data["teachers"]:
        raise DistillError(f'--teachers {path}: expected {{"teachers": {{DOMAIN: {{"model": DIR}}, ...}}}}')
    thinking = data.get("enable_thinking", False)
    if not isinstance(thinking, bool):
        raise DistillError(f'--teachers {path}: "enable_thinking" must be true or false')
    teachers = {}
    for domain, entry in data["teachers"].items():
        if not isinstance(entry, dict) or not isinstance(entry.get("model"), str):
            raise DistillError(f'--teachers {path}: teacher {domain!r} needs "model" (its folder)')
        model = Path(entry["model"])
        if not model.is_absolute():
            model = (Path(path).parent / model).resolve()
        engine = entry.get("engine")
        if engine is not None and not (
            isinstance(engine, str) and engine.startswith(("http://", "https://"))
        ):
            raise DistillError(f'--teachers {path}: teacher {domain!r} "engine" must be an http(s) URL')
        teachers[str(domain)] = Teacher(str(domain), model, engine)
    return TeachersFile(teachers, thinking)


# --- compatibility -------------------------------------------------------------------------------------


def _vocab(folder: Path) -> dict[str, int]:
    from tokenizers import Tokenizer

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise DistillError(f"{folder}: no tokenizer.json")
    return Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)


def _chat_template(folder: Path) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config = folder / "tokenizer_config.json"
    if config.is_file():
        value = json.loads(config.read_text()).get("chat_template")
        return value if isinstance(value, str) else None
    return None


def first_difference(
    student: Path, teacher: Path, *, student_thinking: bool, teacher_thinking: bool
) -> str | None:
    """The first way `teacher` is incompatible with `student` (tokenizer, template, thinking), or None."""
    a, b = _vocab(student), _vocab(teacher)
    if a != b:
        if len(a) != len(b):
            return f"the tokenizer differs: {len(b):,} tokens, the student has {len(a):,}"
        for token in sorted(a.keys() | b.keys(), key=lambda t: (a.get(t, 1 << 40), t)):
            if a.get(token) != b.get(token):
                return (
                    f"the tokenizer differs: token {token!r} is id {b.get(token)} there, "
                    f"{a.get(token)} in the student's"
                )
    ta, tb = _chat_template(student), _chat_template(teacher)
    if ta != tb:
        if ta is None or tb is None:
            return "the chat template differs: one of the two has none"
        at = next(i for i, (x, y) in enumerate(zip(ta + "\0", tb + "\0", strict=False)) if x != y)
        return (
            f"the chat template differs from character {at} on ({tb[at : at + 40]!r} vs {ta[at : at + 40]!r})"
        )
    if student_thinking != teacher_thinking:
        return (
            f"the thinking mode differs: enable_thinking {teacher_thinking}, the student's {student_thinking}"
        )
    return None


def check_teachers(student: Path, teachers: TeachersFile, student_thinking: bool = False) -> None:
    for domain, teacher in teachers.teachers.items():
        if not (teacher.model / "config.json").is_file():
            raise DistillError(f"teacher {domain!r}: {teacher.model} is not a model folder")
        problem = first_difference(
            student,
            teacher.model,
            student_thinking=student_thinking,
            teacher_thinking=teachers.enable_thinking,
        )
        if problem:
            raise DistillError(
                f"teacher {domain!r} ({teacher.model}) is not compatible with the student: {problem}"
            )


# --- the loop ------------------------------------------------------------------------------------------


@dataclass
class DistillConfig:
    student: Path
    teachers: Path
    prompts: Path
    out: Path
    engine_url: str
    dev_prompts: Path | None = None
    lora: LoraSettings = field(default_factory=LoraSettings)
    lr: float = 1e-5
    warmup_updates: int = 10
    prompts_per_step: int = 32
    responses: int = 4
    max_response_tokens: int = 16_384
    kl_weight: float = 1.0
    reward_weight: float = 0.0
    verifier: str = "math"
    steps: int = 10
    eval_every: int = 5
    seed: int = 0
    micro_batch_tokens: int = 8192
    admin_token: str | None = None


def token_advantages(
    student_logprobs: Sequence[float], teacher_logprobs: Sequence[float | None], kl_weight: float
) -> list[float]:
    """A_t = −λ·(log π_student(y_t) − log π_teacher(y_t)) per response token."""
    if len(student_logprobs) != len(teacher_logprobs):
        raise DistillError(
            f"{len(teacher_logprobs)} teacher log-probs for {len(student_logprobs)} response tokens"
        )
    return [
        -kl_weight * (s - (t if t is not None else s))
        for s, t in zip(student_logprobs, teacher_logprobs, strict=True)
    ]


def distill_step(
    model: torch.nn.Module, examples: Sequence[tuple[Response, list[float]]], micro_batch_tokens: int
) -> dict[str, float]:
    """Backward of the per-token-advantage PPO-clip loss (ratio 1: one step per batch).

    Responses have equal weight, each one's token losses averaged (as the specialists' RL).
    """
    from trainer.specialist import to_sample

    samples = [to_sample(r) for r, _ in examples]
    total = len(samples)
    loss_sum = 0.0
    for indices in first_fit_pack([len(s.token_ids) for s in samples], micro_batch_tokens):
        batch = pack(samples, indices)
        logp = per_token_logprobs(model, batch)
        advantages = torch.zeros_like(logp)
        losses = []
        for k, i in enumerate(indices):
            sl = batch.slices[k]
            response, adv = examples[i]
            n_prompt = len(response.prompt_ids)
            advantages[0, sl.start + n_prompt : sl.stop] = torch.tensor(adv, dtype=logp.dtype)
            loss_k, _ = grpo_loss(
                logp[:, sl],
                logp[:, sl].detach(),
                logp[:, sl].detach(),
                logp[:, sl].detach(),
                advantages[:, sl],
                batch.loss_mask[:, sl],
                eps_low=CLIP_EPS,
                eps_high=CLIP_EPS,
                kl_coef=0.0,
            )
            losses.append(loss_k)
        part = torch.stack(losses).sum() / total
        part.backward()
        loss_sum += float(part.detach())
    return {"loss": loss_sum}


def distill_update(
    peft_model: Any,
    optimizer: torch.optim.Optimizer,
    examples: Sequence[tuple[Response, list[float]]],
    micro_batch_tokens: int,
) -> tuple[dict[str, float], float]:
    """One optimizer step of the LoRA matrices on `examples` (gradient clipped to MAX_GRAD_NORM);
    returns `distill_step`'s stats and the grad norm."""
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer.zero_grad(set_to_none=True)
    stats = distill_step(peft_model.get_base_model(), examples, micro_batch_tokens)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable, MAX_GRAD_NORM))
    optimizer.step()
    return stats, grad_norm


async def teacher_logprobs(client: EngineClient, response: Response) -> list[float | None]:
    """The teacher's log-prob of each response token: scored from the prompt's last position,
    whose entry (None: SGLang scores no token at `logprob_start_len`) is dropped."""
    ids = list(response.prompt_ids) + list(response.output_ids)
    scores = await client.score(ids, start=len(response.prompt_ids) - 1)
    return scores[1:]


def train_distill(cfg: DistillConfig, say: Callable[[str], None] = print) -> dict[str, Any]:
    teachers = load_teachers(cfg.teachers)
    check_teachers(cfg.student, teachers)
    with ExitStack() as stack:
        urls = {}
        for domain, teacher in teachers.teachers.items():
            if teacher.engine:
                urls[domain] = teacher.engine
            else:
                say(f"starting a CPU engine for teacher {domain!r} ({teacher.model})")
                try:
                    urls[domain] = stack.enter_context(LocalEngine(str(teacher.model))).url
                except LocalEngineError as e:
                    raise DistillError(f"teacher {domain!r}: {e}") from None
        return asyncio.run(_train(cfg, urls, say))


async def _train(
    cfg: DistillConfig, teacher_urls: dict[str, str], say: Callable[[str], None]
) -> dict[str, Any]:
    import random

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    rows = load_prompts(cfg.prompts)
    missing = sorted({str(r.domain) for r in rows if r.domain not in teacher_urls})
    if missing:
        raise DistillError(f"--prompts rows of domain(s) {', '.join(missing)} have no teacher in --teachers")
    dev_rows = load_prompts(cfg.dev_prompts) if cfg.dev_prompts else []
    verifier = verifier_for(cfg.verifier)
    codec = TextCodec(cfg.student)
    cfg.out.mkdir(parents=True, exist_ok=True)
    metrics = cfg.out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(cfg.student, dtype=torch.float32, attn_implementation=VARLEN)
    peft_model = attach_lora(model, cfg.lora)
    peft_model.train()
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=cfg.lr)
    settings = SamplingSettings(1.0, 1.0, -1, cfg.max_response_tokens)
    rng = random.Random(cfg.seed)
    rollout_root = cfg.out / "rollout"
    student = EngineClient(cfg.engine_url, admin_token=cfg.admin_token, timeout_s=3600)
    teachers = {d: EngineClient(u, timeout_s=3600) for d, u in teacher_urls.items()}
    started = time.perf_counter()
    try:
        path = rollout_root / "update-000000"
        save_merged(peft_model, path, tokenizer_dir=cfg.student)
        await reload_engine(student, path, "distill-0")
        for update in range(1, cfg.steps + 1):
            t0 = time.perf_counter()
            batch = rng.sample(rows, min(cfg.prompts_per_step, len(rows)))
            groups = await asyncio.gather(
                *(
                    sample_responses(
                        student, codec, r, cfg.responses, settings, seed=cfg.seed * 7919 + update
                    )
                    for r in batch
                )
            )
            flat = [(row, resp) for row, group in zip(batch, groups, strict=True) for resp in group]
            teacher_lps = await asyncio.gather(
                *(teacher_logprobs(teachers[str(row.domain)], resp) for row, resp in flat)
            )
            examples: list[tuple[Response, list[float]]] = []
            kls: dict[str, list[float]] = {}
            rewards_all = []
            k = 0
            for row, group in zip(batch, groups, strict=True):
                rewards = [float(verifier.score(r.text, row.label).correct) for r in group]
                rewards_all += rewards
                centred = centred_advantages(rewards)
                for resp, reward_adv in zip(group, centred, strict=True):
                    t_lp = teacher_lps[k]
                    k += 1
                    adv = token_advantages(resp.logprobs, t_lp, cfg.kl_weight)
                    kls.setdefault(str(row.domain), []).append(
                        statistics.fmean(
                            s - t for s, t in zip(resp.logprobs, t_lp, strict=True) if t is not None
                        )
                        if resp.logprobs
                        else 0.0
                    )
                    if cfg.reward_weight:
                        adv = [a + cfg.reward_weight * reward_adv for a in adv]
                    if resp.output_ids:
                        examples.append((resp, adv))
            for g in optimizer.param_groups:
                g["lr"] = warmup_lr(update, cfg.lr, cfg.warmup_updates)
            stats, grad_norm = distill_update(peft_model, optimizer, examples, cfg.micro_batch_tokens)
            path = rollout_root / f"update-{update:06d}"
            save_merged(peft_model, path, tokenizer_dir=cfg.student)
            await reload_engine(student, path, f"distill-{update}")
            prune_rollout_weights(rollout_root, 2)
            line: dict[str, Any] = {
                "update": update,
                "loss": stats["loss"],
                "grad_norm": grad_norm,
                "reverse_kl": {d: statistics.fmean(v) for d, v in sorted(kls.items())},
                "reward_mean": statistics.fmean(rewards_all),
                "responses": len(flat),
                "update_seconds": round(time.perf_counter() - t0, 3),
            }
            if dev_rows and (update % cfg.eval_every == 0 or update == cfg.steps):
                line["dev_pass"] = await pass_rate(
                    student, codec, dev_rows, verifier, cfg.max_response_tokens
                )
            append_jsonl(metrics, line)
            kl_text = ", ".join(f"{d} {v:.3f}" for d, v in line["reverse_kl"].items())
            dev = f" dev {line['dev_pass']:.3f}" if "dev_pass" in line else ""
            say(
                f"update {update}/{cfg.steps} reverse KL per token: {kl_text}; "
                f"reward {line['reward_mean']:.3f}{dev}"
            )
        return finish_run(peft_model, cfg.student, cfg.out, updates=cfg.steps, started=started)
    except EngineError as e:
        raise DistillError(f"engine: {e}") from None
    finally:
        await student.close()
        for client in teachers.values():
            await client.close()


__all__ = [
    "DistillConfig",
    "DistillError",
    "PromptRow",
    "check_teachers",
    "first_difference",
    "load_teachers",
    "train_distill",
]
