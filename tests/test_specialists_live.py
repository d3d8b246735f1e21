"""The seed-004 specialists live on the CPU: LoRA GRPO against a hot-reloaded engine raises held-out
pass@1, multi-teacher on-policy distillation raises a student on two domains, and a teacher with
another tokenizer is refused. Every step is the real command (`bcstack ...` processes).

The base is the tiny model SFT'd on both toy domains' worked replies, half of them ending
"The answer is N." where the prompt asks for an "Answer: N" line (the only one the verifier reads):
a base that half-follows the requested format, which RL and distillation can fix in the minutes a
test has. bench/specialists.py is the long version (more prompts, more updates, the full table).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from devkit.toyworld.domains import write_mixed_format_sft
from tests.conftest import find_free_port
from tests.stack_util import bcstack_process

# The first test's fixtures (the base SFT of 375 steps, then 20 LoRA GRPO updates) take 250 s on
# one 2-core machine and 660 s on another (0.65 s per SFT step, ~18 s per RL update): past pytest's
# 600 s limit, which counts fixture time against the test that needs them.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

ADMIN = "specialists-test-token"
DOMAINS = ("arithmetic", "sequence")
TEST_PROMPTS = 200  # the arithmetic evaluations read the first 100


def bcstack(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "bcstack", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "BCSTACK_ADMIN_TOKEN": ADMIN},
        timeout=900,
    )
    if check:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _engine(model: Path):
    port = find_free_port()
    return bcstack_process(
        ["serve", "engine", "--model", str(model), "--port", str(port)],
        f"http://127.0.0.1:{port}/health_generate",
        env={"BCSTACK_ADMIN_TOKEN": ADMIN},
    ), f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("specialists")
    for d in DOMAINS:
        bcstack(
            "toyworld",
            "math",
            "--domain",
            d,
            "--out",
            str(root / d),
            "--train",
            "2000",
            "--test",
            str(TEST_PROMPTS),
        )
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join((root / d / "corpus.jsonl").read_text() for d in DOMAINS))
    bcstack(
        "model",
        "tiny",
        "--out",
        str(root / "kit"),
        "--corpus",
        str(corpus),
        "--hidden-size",
        "128",
        "--layers",
        "4",
        "--vocab-size",
        "1024",
    )
    write_mixed_format_sft([root / d / "sft.jsonl" for d in DOMAINS], root / "base-sft.jsonl", share=0.5)
    bcstack(
        "train",
        "sft",
        "--model",
        str(root / "kit"),
        "--source",
        f"both={root / 'base-sft.jsonl'}",
        "--out",
        str(root / "base"),
        "--lr",
        "3e-3",
        "--min-lr",
        "3e-4",
        "--epochs",
        "3",
    )
    return {"root": root, "base": root / "base" / "serving"}


def _passk(
    out: Path, models: dict[str, Path], benches: list[str], root: Path, samples: int = 4, limit: int = 100
) -> dict:
    bcstack(
        "eval",
        "passk",
        *(x for n, p in models.items() for x in ("--model", f"{n}={p}")),
        *(x for d in benches for x in ("--prompts", f"{d}={root / d / 'test.jsonl'}")),
        "--samples",
        str(samples),
        "--limit",
        str(limit),
        "--max-new-tokens",
        "48",
        "--baseline",
        "base",
        "--out",
        str(out),
    )
    return json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def specialist(world) -> Path:
    """LoRA GRPO on arithmetic from the base, the engine hot-reloaded after every update."""
    root, base = world["root"], world["base"]
    process, url = _engine(base)
    args = [
        "train",
        "grpo",
        "--env",
        "math",
        "--model",
        str(base),
        "--engine",
        url,
        "--prompts",
        str(root / "arithmetic" / "train.jsonl"),
        "--out",
        str(root / "rl"),
        "--prompts-per-step",
        "32",
        "--responses",
        "8",
        "--max-response-tokens",
        "48",
        "--lr",
        "1e-3",
        "--warmup-updates",
        "2",
    ]
    with process:
        bcstack(*args, "--steps", "19")
        # A second run resumes from the newest checkpoint: the engine is reloaded to it first.
        done = bcstack(*args, "--steps", "20", "--resume")
        assert "resumed at update 19" in done.stdout
        # the engine serves the last update's merged policy
        assert httpx.get(f"{url}/get_weight_version").json()["weight_version"] == "lora-20"
    return root / "rl"


def test_lora_grpo_raises_held_out_pass_at_1(world, specialist):
    root = world["root"]
    lines = [json.loads(x) for x in (specialist / "metrics.jsonl").read_text().splitlines()]
    assert [x["update"] for x in lines] == list(range(1, 21))
    for x in lines:  # the seed's accounting: sampled responses vs gradient examples
        assert x["sampled_responses"] == 256
        excluded = (
            8 * x["constant_reward_groups"] + x["zero_advantage_responses"] + x["length_stopped_responses"]
        )
        assert x["gradient_examples"] + excluded == 256 and x["gradient_examples"] > 0
    provenance = json.loads((specialist / "serving" / "model_provenance.json").read_text())
    # 4 layers x 7 modules + lm_head, an A and a B each; every one applied, logits exact after BF16
    assert provenance["adapter_tensors"] == 58 and provenance["logits_check"]["passed"]
    assert bcstack("checkpoint", "verify", str(specialist / "serving")).returncode == 0
    adapter = json.loads((specialist / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 16 and adapter["lora_alpha"] == 32 and adapter["lora_dropout"] == 0

    results = _passk(
        root / "passk-rl", {"base": world["base"], "rl": specialist / "serving"}, ["arithmetic"], root
    )
    cell = results["cells"]["rl"]["arithmetic"]
    base = results["cells"]["base"]["arithmetic"]
    print(
        f"held-out pass@1: base {base['pass_at_1']:.2f}, LoRA GRPO {cell['pass_at_1']:.2f}, "
        f"{cell['vs_baseline']}"
    )
    assert cell["prompts"] == 100 and cell["samples"] == 4
    assert cell["vs_baseline"]["ci_pp"][0] > 0, cell["vs_baseline"]  # paired interval above zero


def test_distillation_from_two_teachers_raises_the_student_on_both_domains(world):
    """Teachers: the base SFT'd on each domain's requested-format replies (one epoch each). They do
    not depend on the RL test's run, whose specialist's strength varies from run to run."""
    root, base = world["root"], world["base"]
    for d in DOMAINS:
        bcstack(
            "train",
            "sft",
            "--model",
            str(base),
            "--source",
            f"{d}={root / d / 'sft.jsonl'}",
            "--out",
            str(root / f"teacher-{d}"),
            "--lr",
            "1e-3",
            "--min-lr",
            "1e-4",
            "--epochs",
            "1",
        )
    teachers = root / "teachers.json"
    teachers.write_text(
        json.dumps(
            {
                "enable_thinking": False,
                "teachers": {
                    "arithmetic": {"model": str(root / "teacher-arithmetic" / "serving")},
                    "sequence": {"model": str(root / "teacher-sequence" / "serving")},
                },
            }
        )
    )
    mixed = root / "mixed.jsonl"
    mixed.write_text("".join((root / d / "train.jsonl").read_text() for d in DOMAINS))
    process, url = _engine(base)
    with process:
        done = bcstack(
            "train",
            "distill",
            "--teachers",
            str(teachers),
            "--model",
            str(base),
            "--engine",
            url,
            "--prompts",
            str(mixed),
            "--out",
            str(root / "student"),
            "--steps",
            "14",
            "--prompts-per-step",
            "16",
            "--responses",
            "2",
            "--max-response-tokens",
            "48",
            "--lr",
            "1e-3",
            "--warmup-updates",
            "2",
        )
    assert "reverse KL per token: arithmetic" in done.stdout
    lines = [json.loads(x) for x in (root / "student" / "metrics.jsonl").read_text().splitlines()]
    assert set(lines[0]["reverse_kl"]) == set(DOMAINS)  # every domain routed to its teacher
    models = {"base": base, "student": root / "student" / "serving"}
    # The tiny model is right on ~8% of sequence prompts in either format, so the student's gain
    # there is a few points: 200 prompts x 8 samples measure it; 100 x 4 do for arithmetic.
    results = {
        "arithmetic": _passk(root / "passk-student-a", models, ["arithmetic"], root),
        "sequence": _passk(root / "passk-student-s", models, ["sequence"], root, samples=8, limit=200),
    }
    for d in DOMAINS:
        cell = results[d]["cells"]["student"][d]
        print(f"{d}: base {results[d]['cells']['base'][d]['pass_at_1']:.2f}, student {cell['pass_at_1']:.2f}")
        assert cell["vs_baseline"]["ci_pp"][0] > 0, (d, cell["vs_baseline"])


def test_a_teacher_with_another_tokenizer_or_thinking_mode_is_refused(world, toy_kit, tmp_path):
    root, base = world["root"], world["base"]
    teachers = tmp_path / "teachers.json"

    def refused(body: dict) -> str:
        teachers.write_text(json.dumps(body))
        done = bcstack(
            "train",
            "distill",
            "--teachers",
            str(teachers),
            "--model",
            str(base),
            "--engine",
            "http://127.0.0.1:9",
            "--prompts",
            str(root / "arithmetic" / "train.jsonl"),
            "--out",
            str(tmp_path / "o"),
            check=False,
        )
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        return done.stderr

    other = toy_kit["dir"] / "tiny"  # the stack's tiny kit: same architecture, another tokenizer
    message = refused({"teachers": {"arithmetic": {"model": str(other)}}})
    assert "teacher 'arithmetic'" in message and "the tokenizer differs" in message
    message = refused({"enable_thinking": True, "teachers": {"arithmetic": {"model": str(base)}}})
    assert "the thinking mode differs" in message
    assert not (tmp_path / "o").exists()  # refused before anything ran
