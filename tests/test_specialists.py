"""The seed-004 specialists' plumbing, every step the real command: LoRA GRPO against a hot-reloaded
`bcstack serve engine` (its accounting, export, provenance and resume), pass@k against the engines,
multi-teacher distillation (each prompt routed to its domain's teacher) and the refusal of an
incompatible teacher.

The base is the tiny kit SFT'd in-process (~2 s) to reply "Answer: 1" to half of its "Pick one or
two" prompts and "Answer: 2" to the others; the training prompts are labelled 1 or 2, so the math
verifier scores about half of each group right (mixed groups get gradients) and every response stops
within a few tokens. That the recipes learn is bench/specialists.py's job (held-out pass@1 with
paired intervals); that one step moves the right way on a fixed batch is tests/test_learning_steps.py's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
import torch

from tests.conftest import find_free_port
from tests.stack_util import bcstack_forked, bcstack_processes, warm_forkserver

ADMIN = "specialists-test-token"
# One OpenMP thread per process: on a 2-core machine shared with other processes two spinning
# threads made a 0.04 s SFT step take over a second.
ENV = {"BCSTACK_ADMIN_TOKEN": ADMIN, "OMP_NUM_THREADS": "1"}
PROMPTS, RESPONSES = 4, 4


def bcstack(*args: str, check: bool = True):
    done = bcstack_forked([str(a) for a in args], env=ENV, timeout=300)
    if check:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _rows(domain: str, n: int, start: int = 0) -> list[dict]:
    return [
        {
            "id": f"{domain}-{i}",
            "domain": domain,
            "prompt": f"Pick one or two, item {i}.",
            "label": str(1 + i % 2),
        }
        for i in range(start, start + n)
    ]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _sft_base(kit: Path, root: Path) -> Path:
    from transformers import AutoTokenizer

    from trainer.sft import SFTConfig, train_sft
    from trainer.sft_data import SourceSpec, build_mixture, load_chat_jsonl

    chats = [
        {
            "messages": [
                {"role": "user", "content": r["prompt"]},
                {"role": "assistant", "content": f"<think>\n\n</think>\n\nAnswer: {1 + (i // 2) % 2}"},
            ],
            "enable_thinking": False,
        }
        for i, r in enumerate(_rows("sft", 16, start=100))
    ]
    samples, refused = load_chat_jsonl(
        _write_jsonl(root / "sft.jsonl", chats), AutoTokenizer.from_pretrained(kit)
    )
    assert not refused, refused
    mixture = build_mixture({"s": samples}, [SourceSpec("s", Path("sft.jsonl"), repeat=12)])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config = SFTConfig(
            lr=2e-2, min_lr=2e-3, global_batch=4, micro_batch_tokens=4096, checkpoint_every=1000
        )
        train_sft(kit, mixture, root / "base", config=config, say=lambda _s: None)
    finally:
        torch.set_num_threads(threads)
    return root / "base" / "serving"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, tiny_kit) -> dict:
    """The kit, the SFT'd base, prompt files, and three engines: the student's (admin routes on),
    a teacher serving the base and one serving the untrained kit."""
    warm_forkserver()
    root = tmp_path_factory.mktemp("specialists")
    kit = tiny_kit(root / "kit")
    base = _sft_base(kit, root)
    arithmetic = _write_jsonl(root / "arithmetic.jsonl", _rows("arithmetic", PROMPTS))
    mixed = _write_jsonl(root / "mixed.jsonl", _rows("arithmetic", 2) + _rows("sequence", 2, start=2))
    ports = [find_free_port() for _ in range(3)]
    specs = [
        (["serve", "engine", "--model", str(model), "--port", str(port)],
         f"http://127.0.0.1:{port}/health_generate", ENV)
        for model, port in zip((base, base, kit), ports, strict=True)
    ]  # fmt: skip
    with bcstack_processes(specs, timeout=180, forked=True):
        student, teacher_base, teacher_kit = (f"http://127.0.0.1:{p}" for p in ports)
        yield {
            "root": root,
            "kit": kit,
            "base": base,
            "arithmetic": arithmetic,
            "mixed": mixed,
            "engine": student,
            "teacher_base": teacher_base,
            "teacher_kit": teacher_kit,
        }


def test_lora_grpo_counts_exports_and_resumes_against_a_hot_reloaded_engine(world):
    out = world["root"] / "rl"
    args = [
        "train", "grpo", "--env", "math", "--model", world["base"], "--engine", world["engine"],
        "--prompts", world["arithmetic"], "--out", out, "--prompts-per-step", str(PROMPTS),
        "--responses", str(RESPONSES), "--max-response-tokens", "8", "--lr", "1e-3",
        "--warmup-updates", "0",
    ]  # fmt: skip
    bcstack(*args, "--steps", "1")
    # A second run resumes from the newest checkpoint: the engine is reloaded to it first.
    done = bcstack(*args, "--steps", "2", "--resume")
    assert "resumed at update 1" in done.stdout, done.stdout
    # the engine serves the last update's merged policy
    assert httpx.get(f"{world['engine']}/model_info").json()["weight_version"] == "lora-2"
    # pass@k against the engines as they serve: the base (a teacher's engine) and the specialist
    bcstack(
        "eval", "passk", "--model", f"base={world['teacher_base']}", "--model", f"rl={world['engine']}",
        "--prompts", f"arithmetic={world['arithmetic']}", "--samples", "2", "--max-response-tokens", "8",
        "--baseline", "base", "--out", world["root"] / "passk",
    )  # fmt: skip
    results = json.loads((world["root"] / "passk" / "results.json").read_text())
    cell = results["cells"]["rl"]["arithmetic"]
    assert cell["prompts"] == PROMPTS and cell["samples"] == 2 and 0 <= cell["pass_at_1"] <= 100  # percent
    assert len(cell["vs_baseline"]["ci_pp"]) == 2  # the paired interval against the base

    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["update"] for x in lines] == [1, 2]
    for x in lines:  # the seed's accounting: sampled responses vs gradient examples
        assert x["sampled_responses"] == PROMPTS * RESPONSES
        excluded = (
            RESPONSES * x["constant_reward_groups"]
            + x["zero_advantage_responses"]
            + x["length_stopped_responses"]
        )
        assert x["gradient_examples"] + excluded == PROMPTS * RESPONSES and x["gradient_examples"] > 0, x

    layers = json.loads((world["base"] / "config.json").read_text())["num_hidden_layers"]
    provenance = json.loads((out / "serving" / "model_provenance.json").read_text())
    # layers x 7 modules + lm_head, an A and a B each; every one applied, logits exact after BF16
    assert provenance["adapter_tensors"] == 2 * (layers * 7 + 1) and provenance["logits_check"]["passed"]
    assert bcstack("checkpoint", "verify", out / "serving").returncode == 0
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 16 and adapter["lora_alpha"] == 32 and adapter["lora_dropout"] == 0


def test_distillation_routes_each_prompt_to_its_domains_teacher(world):
    """The arithmetic teacher is the base itself (the student starts as the base: reverse KL 0), the
    sequence teacher the untrained kit (far from the student): the KLs show who scored what."""
    teachers = world["root"] / "teachers.json"
    teachers.write_text(
        json.dumps(
            {
                "enable_thinking": False,
                "teachers": {
                    "arithmetic": {"model": str(world["base"]), "engine": world["teacher_base"]},
                    "sequence": {"model": str(world["kit"]), "engine": world["teacher_kit"]},
                },
            }
        )
    )
    out = world["root"] / "student"
    done = bcstack(
        "train", "distill", "--teachers", teachers, "--model", world["base"], "--engine", world["engine"],
        "--prompts", world["mixed"], "--out", out, "--steps", "1", "--prompts-per-step", "4",
        "--responses", "2", "--max-response-tokens", "8", "--lr", "1e-3", "--warmup-updates", "0",
    )  # fmt: skip
    assert "reverse KL per token: arithmetic" in done.stdout, done.stdout
    [line] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    kl = line["reverse_kl"]
    assert set(kl) == {"arithmetic", "sequence"} and line["responses"] == 8
    assert abs(kl["arithmetic"]) < 0.05 < kl["sequence"], kl
    assert (out / "serving" / "model_provenance.json").is_file()


def test_a_teacher_with_another_tokenizer_or_thinking_mode_is_refused(world, tmp_path):
    import shutil

    kit = world["kit"]
    other = shutil.copytree(kit, tmp_path / "other")  # same architecture, two tokens swapped
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    teachers = tmp_path / "teachers.json"

    def refused(body: dict) -> str:
        teachers.write_text(json.dumps(body))
        done = bcstack(
            "train", "distill", "--teachers", teachers, "--model", kit, "--engine", "http://127.0.0.1:9",
            "--prompts", world["arithmetic"], "--out", tmp_path / "o", check=False,
        )  # fmt: skip
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        return done.stderr

    message = refused({"teachers": {"arithmetic": {"model": str(other)}}})
    assert "teacher 'arithmetic'" in message and "the tokenizer differs" in message, message
    message = refused({"enable_thinking": True, "teachers": {"arithmetic": {"model": str(kit)}}})
    assert "the thinking mode differs" in message, message
    assert not (tmp_path / "o").exists()  # refused before anything ran
    assert set(os.listdir(tmp_path)) == {"other", "teachers.json"}
