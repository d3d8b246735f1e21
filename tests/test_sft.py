"""SFT (trainer/sft.py, trainer/sft_data.py, `bcstack train sft`): masks, mixture, schedule, training.

Chat rows come from real expert episodes played offline through the protocol module on the shared
toy world (tests/toy_env.py), rendered by the worker's chat template with the tiny kit's tokenizer.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from toy_env import ToyRetrieval, run_worker_episode
from transformers import AutoTokenizer
from typer.testing import CliRunner

from bcstack.cli import app
from core.chat_template import render_chat
from core.checkpoint import verify_checkpoint
from devkit.toyworld.policies import WORKER_TASK_TEMPLATE, expert_worker_policy
from trainer.checkpoint import load_model_state
from trainer.sft import SFTConfig, epoch_steps, lr_at, row_order, train_sft
from trainer.sft_data import (
    SFTDataError,
    SFTSample,
    SourceSpec,
    build_mixture,
    load_chat_jsonl,
    render_chat_row,
)

runner = CliRunner()


@pytest.fixture(scope="module")
def tokenizer(toy_kit):
    return AutoTokenizer.from_pretrained(toy_kit["dir"] / "tiny")


@pytest.fixture(scope="module")
def conversations(toy_kit) -> list[list[dict]]:
    world = toy_kit["world"]
    env = ToyRetrieval(world.corpus)
    out = []
    for q in world.test[:10]:
        ep = run_worker_episode(expert_worker_policy, WORKER_TASK_TEMPLATE.format(question=q["query"]), env)
        assert ep.finish is not None
        out.append(ep.messages)
    return out


def _write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_masks_cover_exactly_the_assistant_replies(tokenizer, conversations, tmp_path):
    samples, refused = load_chat_jsonl(
        _write_rows(tmp_path / "chat.jsonl", [{"messages": m} for m in conversations]), tokenizer
    )
    assert refused == [] and len(samples) == len(conversations)
    for sample, messages in zip(samples, conversations, strict=True):
        # The whole row is the rendered conversation, token for token.
        assert (
            list(sample.token_ids)
            == tokenizer.encode(render_chat(messages), add_special_tokens=False)[: len(sample.token_ids)]
        )
        # Supervised runs, decoded, are exactly each assistant message followed by <|im_end|>.
        runs, current = [], []
        for token, m in zip(sample.token_ids, sample.loss_mask, strict=True):
            if m:
                current.append(token)
            elif current:
                runs.append(current)
                current = []
        if current:
            runs.append(current)
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        assert [tokenizer.decode(r, skip_special_tokens=False) for r in runs] == [
            reply + "<|im_end|>" for reply in replies
        ]


def test_supervise_last_trains_only_the_final_reply(tokenizer, conversations):
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids, mask = render_chat_row(conversations[0], encode, eos, supervise="last")
    last = [m["content"] for m in conversations[0] if m["role"] == "assistant"][-1]
    assert tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m]) == last + "<|im_end|>"


def test_rows_that_cannot_be_trained_exactly_are_refused_with_a_reason(tokenizer, conversations, tmp_path):
    good = {"messages": conversations[0]}
    # A user message ending mid-word whose next turn starts with letters would merge across the boundary
    # only if the template glued them; the template puts <|im_end|> between turns, so craft the failures
    # the renderer can see: no assistant message, an unknown role, broken JSON, a bad supervise mode.
    rows = [
        good,
        {"messages": [{"role": "user", "content": "hi"}]},
        {"messages": [{"role": "robot", "content": "hi"}]},
        {"messages": conversations[0], "supervise": "some"},
    ]
    path = _write_rows(tmp_path / "mixed.jsonl", rows)
    with path.open("a") as f:
        f.write("{not json\n")
    samples, refused = load_chat_jsonl(path, tokenizer)
    assert len(samples) == 1
    assert len(refused) == 4
    assert all(line.startswith(f"{path}:") and "\n" not in line for line in refused)
    assert "no assistant message" in refused[0]
    assert "role" in refused[1] and "supervise" in refused[2] and "not JSON" in refused[3]


def test_a_reply_that_merges_with_the_prompt_is_refused():
    # The tiny kit's tokenizer keeps newline runs apart (devkit/modelkit/tokenizer.py), so take a
    # tokenizer that does not: one byte per token, except "\n" + "a", which it merges. The generation
    # prompt ends in "\n"; a reply starting with "a" then shares a token with it, which the worker
    # (it tokenizes the prompt, then appends generated ids) could never have produced.
    def encode(text: str) -> list[int]:
        out: list[int] = []
        for ch in text:
            if ch == "a" and out and out[-1] == ord("\n"):
                out[-1] = 1000
            else:
                out.append(ord(ch))
        return out

    eos = 999
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "answer"}]
    with pytest.raises(SFTDataError, match="merge"):
        render_chat_row(messages, encode, eos)


def _rows(source: str, sizes: list[int]) -> list[SFTSample]:
    return [SFTSample((1,) * (n + 1), (0,) + (1,) * n, source, f"{source}:{i}") for i, n in enumerate(sizes)]


def test_mixture_repeats_and_samples_to_the_supervised_token_balance():
    core = _rows("core", [200, 180, 220, 150])
    gate = _rows("gate", [3, 5, 2, 40, 7, 11, 4])
    specs = [SourceSpec.parse("core=c.jsonl:repeat=3"), SourceSpec.parse("gate=g.jsonl:match=core")]
    mixture = build_mixture({"core": core, "gate": gate}, specs, seed=42)
    by = {row["name"]: row for row in mixture.table}
    assert by["core"]["rows"] == 12 and by["core"]["supervised_tokens"] == 3 * 750
    # Sampled until the next row would pass the target: within one row of it, never above.
    assert 0 <= 2250 - by["gate"]["supervised_tokens"] < max(r.supervised_tokens for r in gate)
    assert by["gate"]["rows"] > len(gate)  # the pool ran out and was reshuffled
    assert len(mixture.rows) == by["core"]["rows"] + by["gate"]["rows"]
    # Deterministic in the seed, different with another seed.
    assert build_mixture({"core": core, "gate": gate}, specs, seed=42).digest() == mixture.digest()
    assert build_mixture({"core": core, "gate": gate}, specs, seed=7).digest() != mixture.digest()
    half = build_mixture(
        {"core": core, "gate": gate}, [specs[0], SourceSpec.parse("gate=g.jsonl:match=core:fraction=0.5")]
    )
    assert 0 <= 1125 - {r["name"]: r for r in half.table}["gate"]["supervised_tokens"] < 40


@pytest.mark.parametrize(
    "text, message",
    [
        ("core", "expected NAME=PATH"),
        ("core=a.jsonl:repeat=x", "not a number"),
        ("core=a.jsonl:colour=red", "unknown option"),
        ("core=a.jsonl:repeat=2:tokens=5", "one of repeat, match or tokens"),
    ],
)
def test_bad_source_specs_say_why(text, message):
    with pytest.raises(SFTDataError, match=message):
        SourceSpec.parse(text)


def test_schedule_warms_up_then_follows_the_cosine_to_the_floor():
    config = SFTConfig()
    steps = epoch_steps(43_760, config)
    assert steps == 1_367  # seed 001's rollout slots: floor(43,760 / 32)
    warmup = math.ceil(0.1 * steps)
    assert lr_at(1, steps, config) == pytest.approx(1e-5 / warmup)
    assert lr_at(warmup, steps, config) == pytest.approx(1e-5)
    middle = warmup + (steps - warmup) // 2
    assert lr_at(middle, steps, config) == pytest.approx(5.5e-6, rel=1e-2)
    assert lr_at(steps, steps, config) == pytest.approx(1e-6)
    assert all(lr_at(s + 1, steps, config) <= lr_at(s, steps, config) for s in range(warmup, steps))


def _small_config(**overrides) -> SFTConfig:
    return SFTConfig(
        **{"lr": 3e-3, "min_lr": 3e-4, "global_batch": 4, "micro_batch_tokens": 4096, "checkpoint_every": 2,
           **overrides}
    )  # fmt: skip


def test_a_few_steps_lower_the_loss_and_export_a_serving_checkpoint(
    toy_kit, tokenizer, conversations, tmp_path
):
    samples, _ = load_chat_jsonl(
        _write_rows(tmp_path / "chat.jsonl", [{"messages": m} for m in conversations[:8]]), tokenizer
    )
    mixture = build_mixture({"core": samples}, [SourceSpec("core", Path("chat.jsonl"), repeat=3)])
    logged: list[tuple[int, dict]] = []
    summary = train_sft(
        toy_kit["dir"] / "tiny",
        mixture,
        tmp_path / "run",
        config=_small_config(global_batch=2, lr=1e-2, min_lr=1e-3),
        on_metrics=lambda step, m: logged.append((step, m)),
        say=lambda _s: None,
    )
    assert summary["steps"] == summary["total_steps"] == 12
    losses = [m["loss"] for _, m in logged]
    assert losses[-1] < 0.6 * losses[0]
    verify_checkpoint(tmp_path / "run" / "serving")


def test_a_stopped_run_resumes_to_the_same_weights(toy_kit, tokenizer, conversations, tmp_path):
    samples, _ = load_chat_jsonl(
        _write_rows(tmp_path / "chat.jsonl", [{"messages": m} for m in conversations[:8]]), tokenizer
    )
    mixture = build_mixture({"core": samples}, [SourceSpec("core", Path("chat.jsonl"), repeat=2)])
    config = _small_config()
    quiet = lambda _s: None  # noqa: E731
    train_sft(toy_kit["dir"] / "tiny", mixture, tmp_path / "straight", config=config, say=quiet)
    first = train_sft(
        toy_kit["dir"] / "tiny", mixture, tmp_path / "stopped", config=config, max_steps=2, say=quiet
    )
    assert first["steps"] == 2 and "serving" not in first
    with pytest.raises(ValueError, match="--resume"):
        train_sft(toy_kit["dir"] / "tiny", mixture, tmp_path / "stopped", config=config, say=quiet)
    other = build_mixture({"core": samples}, [SourceSpec("core", Path("chat.jsonl"), repeat=3)])
    with pytest.raises(ValueError, match="another mixture"):
        train_sft(toy_kit["dir"] / "tiny", other, tmp_path / "stopped", config=config, resume=True, say=quiet)
    train_sft(toy_kit["dir"] / "tiny", mixture, tmp_path / "stopped", config=config, resume=True, say=quiet)
    a = load_model_state(tmp_path / "straight" / "checkpoints" / "step-00000004")
    b = load_model_state(tmp_path / "stopped" / "checkpoints" / "step-00000004")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_cli_prints_the_mixture_and_logs_every_step(toy_kit, tokenizer, conversations, tmp_path):
    chat = _write_rows(tmp_path / "chat.jsonl", [{"messages": m} for m in conversations[:6]])
    gate_rows = [
        {"messages": [*m[:3], {"role": "user", "content": "Stop?"}, {"role": "assistant", "content": "STOP"}],
         "supervise": "last", "source": "gate"}
        for m in conversations[:6]
    ]  # fmt: skip
    gate = _write_rows(tmp_path / "gate.jsonl", gate_rows)
    out = tmp_path / "run"
    result = runner.invoke(
        app,
        ["train", "sft", "--model", str(toy_kit["dir"] / "tiny"), "--out", str(out),
         "--source", f"core={chat}:repeat=2", "--source", f"gate={gate}:match=core:fraction=0.05",
         "--global-batch", "4", "--lr", "1e-3", "--eval-source", str(chat), "--eval-every", "1"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "SFT mixture" in result.output and "supervised tokens" in result.output
    mixture = json.loads((out / "mixture.json").read_text())
    assert [s["name"] for s in mixture["sources"]] == ["core", "gate"]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line["update"] for line in lines] == list(range(1, mixture["steps"] + 1))
    assert all("eval_loss" in line and line["supervised_tokens"] > 0 for line in lines)
    verify_checkpoint(out / "serving")


def test_cli_refuses_a_missing_source_in_one_line(toy_kit, tmp_path):
    result = runner.invoke(
        app,
        ["train", "sft", "--model", str(toy_kit["dir"] / "tiny"), "--out", str(tmp_path / "o"),
         "--source", f"core={tmp_path / 'nope.jsonl'}"],
    )  # fmt: skip
    assert result.exit_code == 2
    assert "no such file" in result.output and "Traceback" not in result.output


def test_several_passes_use_every_row_once_per_pass_in_a_new_order():
    order = row_order(10, 25, seed=42)
    assert order[:10] == list(range(10))  # the mixture's own shuffled order first
    assert sorted(order[10:20]) == list(range(10)) and order[10:20] != order[:10]
    assert len(order) == 25
    config = SFTConfig(global_batch=4, epochs=2.5)
    assert epoch_steps(10, config) == 6  # floor(10 x 2.5 / 4)
