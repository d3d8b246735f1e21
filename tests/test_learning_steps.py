"""One step of each trainer moves the right way on a FIXED batch (no sampling, no engine): the step
function the trainer itself runs, on the untrained tiny kit, in-process.

- LoRA GRPO (`trainer.specialist.policy_update`): positive-advantage responses' log-prob up,
  negative ones' down;
- distillation (`trainer.distill.distill_update`): the student's log-probs move toward the
  teacher's on the batch's tokens, and the reverse KL to the teacher at those positions falls;
- SFT (`trainer.sft.sft_step`): the loss on the batch falls over a few steps;
- full-model GRPO (`trainer.grpo.grpo_step`) on a multi-turn trajectory: the rewarded trajectory's
  generated tokens up, the punished one's down, and the observation tokens (loss mask 0) out of the
  loss: whatever their rollout log-probs hold, the update is the same.

That the recipes learn over many steps is bench/specialists.py's and bench/trainer.py's job.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from core.single_turn import Response
from trainer.attention import VARLEN, varlen_kwargs
from trainer.lora import LoraSettings, attach_lora
from trainer.packing import pack, per_token_logprobs
from trainer.specialist import to_sample


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One OpenMP thread: on a shared 2-core machine two spinning threads cost more than they give."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def kit(tmp_path_factory: pytest.TempPathFactory, tiny_kit) -> Path:
    return tiny_kit(tmp_path_factory.mktemp("learning") / "kit")


def _model(kit: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(kit, dtype=torch.float32, attn_implementation=VARLEN)


def _lora(kit: Path):
    torch.manual_seed(0)
    return attach_lora(_model(kit), LoraSettings())  # seed 004: rank 16, alpha 32


def _response_logprobs(model: torch.nn.Module, response: Response) -> torch.Tensor:
    """log p of each response token under `model` (no gradient)."""
    with torch.no_grad():
        logp = per_token_logprobs(model, pack([to_sample(response)], [0]))[0]
    return logp[len(response.prompt_ids) :]


PROMPT = [11, 12, 13, 14, 15]


def test_one_lora_grpo_update_raises_the_positive_advantage_responses_and_lowers_the_negative(kit):
    from trainer.specialist import policy_update

    peft_model = _lora(kit)
    good = [
        Response(PROMPT, [40, 41, 42, 43], [0.0] * 4, "", "stop"),
        Response(PROMPT, [50, 51, 52], [0.0] * 3, "", "stop"),
    ]
    bad = [
        Response(PROMPT, [60, 61, 62, 63], [0.0] * 4, "", "stop"),
        Response(PROMPT, [70, 71], [0.0] * 2, "", "stop"),
    ]
    kept = [(r, 0.5) for r in good] + [(r, -0.5) for r in bad]  # a group of 4, rewards 1, 1, 0, 0
    base = peft_model.get_base_model()
    before = [float(_response_logprobs(base, r).mean()) for r in good + bad]
    optimizer = torch.optim.Adam([p for p in peft_model.parameters() if p.requires_grad], lr=1e-3)
    stats, grad_norm = policy_update(
        peft_model, optimizer, kept, mini_batches=1, clip_eps=0.2, tis_cap=None, micro_batch_tokens=256
    )
    after = [float(_response_logprobs(base, r).mean()) for r in good + bad]
    assert grad_norm > 0 and stats["ppo_clip_fraction"] == 0.0  # one step: ratio 1, nothing clipped
    deltas = [a - b for a, b in zip(after, before, strict=True)]
    assert all(d > 0 for d in deltas[:2]), ("positive-advantage responses' mean log-prob", deltas)
    assert all(d < 0 for d in deltas[2:]), ("negative-advantage responses' mean log-prob", deltas)


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """[T, V] next-token logits of one sequence (the trainer's packed attention, one sample)."""
    positions = torch.arange(len(ids))[None]
    out = model(
        input_ids=torch.tensor([ids]), position_ids=positions, attention_mask=None, **varlen_kwargs(positions)
    )
    return out.logits[0]


def _reverse_kl(student: torch.nn.Module, teacher: torch.nn.Module, responses: list[Response]) -> float:
    """KL(π_student ‖ π_teacher) over the whole vocabulary, at every response position (mean)."""
    kls = []
    with torch.no_grad():
        for r in responses:
            ids = list(r.prompt_ids) + list(r.output_ids)
            s = torch.log_softmax(_logits(student, ids)[len(r.prompt_ids) - 1 : -1], dim=-1)
            t = torch.log_softmax(_logits(teacher, ids)[len(r.prompt_ids) - 1 : -1], dim=-1)
            kls.append((s.exp() * (s - t)).sum(-1))
    return float(torch.cat(kls).mean())


def test_one_distillation_update_moves_the_student_toward_the_teacher(kit):
    from trainer.distill import distill_update, token_advantages

    peft_model = _lora(kit)
    student = peft_model.get_base_model()
    teacher = _model(kit)
    with torch.no_grad():  # another model with the same tokenizer: the kit with its weights moved
        generator = torch.Generator().manual_seed(1)
        for p in teacher.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * p.std().clamp_min(0.02))
    # The fixed batch: responses the student samples with a fixed seed (on-policy, as the trainer's).
    generator = torch.Generator().manual_seed(2)
    responses = []
    for k in range(6):
        ids = list(PROMPT) + [20 + k]
        with torch.no_grad():
            for _ in range(8):
                probs = torch.softmax(_logits(student, ids)[-1], dim=-1)
                ids.append(int(torch.multinomial(probs, 1, generator=generator)))
        responses.append(Response(ids[:6], ids[6:], [0.0] * 8, "", "length"))
    responses = [
        dataclasses.replace(r, logprobs=_response_logprobs(student, r).tolist()) for r in responses
    ]  # what the engine reports with each sampled token
    teacher_lps = [_response_logprobs(teacher, r).tolist() for r in responses]

    def gap() -> float:  # mean squared log-prob gap on the batch's tokens
        return sum(
            float(((_response_logprobs(student, r) - torch.tensor(t)) ** 2).mean())
            for r, t in zip(responses, teacher_lps, strict=True)
        ) / len(responses)

    before_gap, before_kl = gap(), _reverse_kl(student, teacher, responses)
    examples = [
        (r, token_advantages(r.logprobs, t, 1.0)) for r, t in zip(responses, teacher_lps, strict=True)
    ]
    optimizer = torch.optim.Adam([p for p in peft_model.parameters() if p.requires_grad], lr=1e-3)
    _, grad_norm = distill_update(peft_model, optimizer, examples, micro_batch_tokens=256)
    after_gap, after_kl = gap(), _reverse_kl(student, teacher, responses)
    assert grad_norm > 0
    assert after_gap < before_gap, ("student-teacher log-prob gap on the batch", before_gap, after_gap)
    assert after_kl < before_kl, ("reverse KL to the teacher", before_kl, after_kl)


def test_a_few_sft_steps_lower_the_loss_on_a_fixed_batch(kit, tmp_path):
    from transformers import AutoTokenizer

    from trainer.sft import SFTConfig, make_optimizer, sft_step
    from trainer.sft_data import load_chat_jsonl

    chats = [
        {
            "messages": [
                {"role": "user", "content": f"Pick one or two, item {i}."},
                {"role": "assistant", "content": f"<think>\n\n</think>\n\nAnswer: {1 + i % 2}"},
            ],
            "enable_thinking": False,
        }
        for i in range(4)
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in chats))
    rows, refused = load_chat_jsonl(path, AutoTokenizer.from_pretrained(kit))
    assert len(rows) == 4 and not refused
    model = _model(kit)
    optimizer = make_optimizer(model, SFTConfig(lr=1e-2))
    losses = [
        sft_step(model, optimizer, rows, lr=1e-2, micro_batch_tokens=4096, grad_clip=1.0)["loss"]
        for _ in range(4)
    ]
    assert losses[-1] < 0.9 * losses[0], losses  # the loss reported before each step: 4 steps
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses


def test_one_grpo_update_raises_the_rewarded_turns_lowers_the_punished_and_ignores_observations(kit):
    from trainer.data import Sample
    from trainer.grpo import (
        GradedEpisode,
        grpo_step,
        load_policy,
        load_reference,
        make_optimizer,
        sample_credit,
    )

    # prompt (mask 0), the worker's turn (1), a tool observation (0), the worker's next turn (1)
    segments = [([11, 12, 13, 14], 0), ([40, 41, 42], 1), ([80, 81, 82, 83, 84], 0), ([43, 44], 1)]

    def trajectory(episode: str, shift: int, reward: float) -> Sample:
        ids = [t + (shift if m else 0) for seg, m in segments for t in seg]
        mask = [m for seg, m in segments for _ in seg]
        return Sample(ids, mask, [0.0] * len(ids), "q", episode, f"{episode}.w0", "q", reward, None, ())

    policy, ref = load_policy(kit), load_reference(kit)

    def with_own_logprobs(sample: Sample) -> Sample:
        """The rollout log-probs the engine reports: the policy's own, on the worker's tokens."""
        with torch.no_grad():
            logp = per_token_logprobs(policy, pack([sample], [0]))[0] * torch.tensor(sample.loss_mask)
        return dataclasses.replace(sample, rollout_logprobs=logp.tolist())

    samples = [
        with_own_logprobs(trajectory(e, s, r))
        for e, s, r in (("e1", 0, 1.0), ("e2", 100, 0.0), ("e3", 200, 0.0))
    ]
    credit = sample_credit(samples, [GradedEpisode(s.episode_id, "q", s.episode_reward) for s in samples])
    assert credit[0].advantage > 0 > credit[1].advantage

    def generated(model: torch.nn.Module, sample: Sample) -> float:
        with torch.no_grad():
            logp = per_token_logprobs(model, pack([sample], [0]))[0]
        return float((logp * torch.tensor(sample.loss_mask)).sum())

    fresh = copy.deepcopy(policy)
    before = [generated(policy, s) for s in samples]
    stats = grpo_step(policy, ref, make_optimizer(policy, lr=1e-3), samples, credit)
    after = [generated(policy, s) for s in samples]
    assert stats["loss_tokens"] == 3 * 5  # the worker's tokens only: 3 + 2 per trajectory
    assert after[0] > before[0], ("rewarded trajectory's generated tokens", before[0], after[0])
    assert after[1] < before[1] and after[2] < before[2], ("punished trajectories", before[1:], after[1:])

    # Observation positions out of the loss: garbage rollout log-probs there give the same update.
    garbage = [
        dataclasses.replace(
            s,
            rollout_logprobs=[
                lp if m else -50.0 for lp, m in zip(s.rollout_logprobs, s.loss_mask, strict=True)
            ],
        )
        for s in samples
    ]
    other = grpo_step(fresh, ref, make_optimizer(fresh, lr=1e-3), garbage, credit)
    assert other["loss"] == pytest.approx(stats["loss"], abs=1e-7)
    assert other["tis_clip_fraction"] == stats["tis_clip_fraction"] == 0.0
    assert all(
        torch.equal(a, b)
        for a, b in zip(policy.state_dict().values(), fresh.state_dict().values(), strict=True)
    ), "observation tokens' rollout log-probs changed the update"
