"""The specialists' RL and distillation as pure functions: advantages, what gets a gradient, the
prompt order, the warm-up, the distillation signal and the teacher checks (seed 004)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from core.single_turn import Response
from trainer.distill import DistillError, first_difference, load_teachers, token_advantages
from trainer.specialist import (
    PromptSampler,
    SpecialistConfig,
    SpecialistError,
    centred_advantages,
    select_examples,
    warmup_lr,
)


def _r(finish: str = "stop") -> Response:
    return Response([1, 2], [3, 4], [-0.5, -0.1], "", finish)


def test_advantages_are_centred_without_std():
    assert centred_advantages([1, 0, 0, 0]) == [0.75, -0.25, -0.25, -0.25]
    assert centred_advantages([1, 1, 0, 0]) == [0.5, 0.5, -0.5, -0.5]  # std 0.5: not divided


def test_constant_groups_length_stops_and_zero_advantages_get_no_gradient_and_are_counted():
    groups = [
        [_r(), _r(), _r(), _r()],  # all wrong: constant
        [_r(), _r("length"), _r(), _r()],  # one right, one stopped at the length limit
        [_r(), _r(), _r(), _r()],  # rewards 1, 0, 0.5, 0.5 (a partial verifier): 0.5 is the mean
    ]
    rewards = [[0, 0, 0, 0], [1, 0, 0, 0], [1, 0, 0.5, 0.5]]
    kept, stats = select_examples(groups, rewards)
    assert stats.sampled == 12 and stats.constant_groups == 1
    assert stats.truncated == 1 and stats.zero_advantage == 2
    assert stats.gradient_examples == len(kept) == 12 - 4 - 1 - 2
    assert stats.gradient_examples + 4 * stats.constant_groups + stats.truncated + stats.zero_advantage == 12
    assert [a for _, a in kept[:3]] == [0.75, -0.25, -0.25]
    assert all(r.finish_reason != "length" for r, _ in kept)


def test_prompt_order_is_a_seeded_shuffle_epoch_after_epoch_and_resumable():
    a = PromptSampler(10, seed=3)
    first = a.take(4) + a.take(4) + a.take(4)
    assert sorted(first[:10]) == list(range(10))  # an epoch visits every prompt once
    b = PromptSampler(10, seed=3)
    b.take(6)
    resumed = PromptSampler(10, 3, **b.state())
    assert resumed.take(6) == first[6:12]
    assert PromptSampler(10, seed=4).take(10) != first[:10]


def test_warm_up_is_linear_over_ten_updates_then_constant(tmp_path):
    cfg = SpecialistConfig(base=tmp_path, prompts=tmp_path, out=tmp_path, engine_url="http://x")
    assert cfg.lr == 1e-5 and cfg.warmup_updates == 10 and cfg.clip_eps == 0.2  # seed 004
    assert [warmup_lr(u, cfg.lr, cfg.warmup_updates) for u in (1, 5, 10, 11)] == pytest.approx(
        [1e-6, 5e-6, 1e-5, 1e-5]
    )
    with pytest.raises(SpecialistError, match="not a model folder"):
        cfg.validate()
    with pytest.raises(SpecialistError, match="at least 2"):
        SpecialistConfig(
            base=tmp_path, prompts=tmp_path, out=tmp_path, engine_url="x", responses=1
        ).validate()


def test_distillation_signal_is_the_negative_reverse_kl_per_token():
    # the teacher finds the first token likelier than the student does: pushed up; the second: down
    assert token_advantages([-1.0, -2.0], [-0.5, -2.5], 1.0) == pytest.approx([0.5, -0.5])
    assert token_advantages([-1.0], [None], 2.0) == [0.0]  # a position the teacher cannot score
    with pytest.raises(DistillError, match="2 teacher log-probs for 1"):
        token_advantages([-1.0], [-1.0, -1.0], 1.0)


def test_teacher_files_and_compatibility(tmp_path, toy_kit):
    kit = toy_kit["dir"] / "tiny"
    other = tmp_path / "other"
    shutil.copytree(kit, other)
    assert first_difference(kit, other, student_thinking=False, teacher_thinking=False) is None
    assert "thinking mode differs" in first_difference(
        kit, other, student_thinking=False, teacher_thinking=True
    )
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace("<|im_start|>", "<|im_start|> ", 1)
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    assert first_difference(kit, other, student_thinking=False, teacher_thinking=False).startswith(
        "the chat template differs from character"
    )
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    problem = first_difference(kit, other, student_thinking=False, teacher_thinking=False)
    assert problem.startswith("the tokenizer differs: token") and repr(a) in problem

    path = tmp_path / "teachers.json"
    path.write_text(json.dumps({"teachers": {"math": {"model": "rel/dir", "engine": "http://e:1"}}}))
    loaded = load_teachers(path)
    assert loaded.teachers["math"].model == (tmp_path / "rel" / "dir").resolve()
    assert loaded.teachers["math"].engine == "http://e:1" and loaded.enable_thinking is False
    for body, message in [
        ("{", "not JSON"),
        (json.dumps({"teachers": {}}), "expected"),
        (json.dumps({"teachers": {"m": {}}}), 'needs "model"'),
        (json.dumps({"teachers": {"m": {"model": "x", "engine": "e:1"}}}), r"http\(s\) URL"),
        (json.dumps({"enable_thinking": "no", "teachers": {"m": {"model": "x"}}}), "true or false"),
    ]:
        path.write_text(body)
        with pytest.raises(DistillError, match=message):
            load_teachers(path)
    with pytest.raises(DistillError, match="no such file"):
        load_teachers(Path(tmp_path / "missing.json"))


def test_a_fixed_old_policy_gives_the_first_pass_gradient_and_clips_later_passes(toy_kit):
    """`--mini-batches` > 1 fixes logp_old before the first step: at that point the loss and
    gradient equal the ratio-1 pass; against a moved policy the clip binds on some tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.attention import VARLEN
    from trainer.lora import LoraSettings, attach_lora
    from trainer.specialist import _old_logprobs, policy_loss_step

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        toy_kit["dir"] / "tiny", dtype=torch.float32, attn_implementation=VARLEN
    )
    peft_model = attach_lora(model, LoraSettings(rank=4, alpha=8))
    examples = [(Response([5, 6, 7], [20, 21, 22, 23], [0.0] * 4, "", "stop"), 0.75),
                (Response([5, 6], [30, 31], [0.0] * 2, "", "stop"), -0.25)]  # fmt: skip
    params = [p for p in peft_model.parameters() if p.requires_grad]

    def grads(old):
        for p in params:
            p.grad = None
        stats = policy_loss_step(peft_model.get_base_model(), examples, clip_eps=0.2, tis_cap=None,
                                 micro_batch_tokens=64, logp_old=old)  # fmt: skip
        return stats, [p.grad.clone() for p in params]

    with torch.no_grad():
        fixed = dict(enumerate(_old_logprobs(peft_model, examples, 64)))
    first, g_first = grads(None)
    same, g_same = grads(fixed)
    assert same["loss"] == pytest.approx(first["loss"], abs=1e-7)
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(g_first, g_same, strict=True))
    assert any(float(g.abs().sum()) > 0 for g in g_first)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn_like(p) * 0.5)  # the policy moves: ratios leave [0.8, 1.2]
    moved, _ = grads(fixed)
    assert moved["ppo_clip_fraction"] > 0


def test_teacher_scoring_covers_every_response_token_including_the_first():
    """SGLang scores no token at `logprob_start_len` (its entry is None): the teacher is asked from
    the prompt's last position, and that None is dropped, so the first response token gets a real
    log-prob (scoring from the response's first position would leave it None)."""
    import asyncio
    import json

    import httpx

    from core.engine_client import EngineClient
    from core.single_turn import Response
    from trainer.distill import teacher_logprobs

    def sglang(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        ids, start = body["input_ids"], body["logprob_start_len"]
        # log p(ids[i] | ids[:i]) stands in as -i; the token at `start` itself is not scored.
        entries = [[None, ids[start], None]] + [[-float(i), ids[i], None] for i in range(start + 1, len(ids))]
        meta = {
            "id": "t",
            "finish_reason": {"type": "length", "length": 0},
            "prompt_tokens": len(ids),
            "completion_tokens": 0,
            "input_token_logprobs": entries,
            "output_token_logprobs": [],
        }
        return httpx.Response(200, json={"text": "", "output_ids": [], "meta_info": meta})

    response = Response(
        prompt_ids=[5, 6, 7], output_ids=[8, 9], logprobs=[-0.1, -0.2], text="", finish_reason="stop"
    )

    async def run() -> list[float | None]:
        async with EngineClient("http://teacher", transport=httpx.MockTransport(sglang)) as client:
            return await teacher_logprobs(client, response)

    assert asyncio.run(run()) == [-3.0, -4.0]  # positions 3 and 4: both response tokens
