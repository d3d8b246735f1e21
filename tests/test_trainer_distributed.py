"""One training step for every layout (issue 16): `bcstack train grpo|sft` at tp=2 and
at dp=2 (gloo, two CPU processes) against one process, and resuming at a layout other than the saver's.
`bcstack train rl` under torchrun is in tests/test_rl_loop.py (its asynchronous run is at tp=2).

Every run is the real command line. The tiny model's SFT at tp=2 and the refused layout run under
torchrun (`python -m torch.distributed.run`, each rank a fresh `python -m bcstack`); the other two-rank runs
start their ranks as torchrun would, one `bcstack` process per rank with the environment torchrun
gives it (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT: all the trainer
and `init_process_group`'s env:// read), forked from one that has imported bcstack
(tests/stack_util.py `bcstack_ranks`: the same command, ~8 s of CPU in imports fewer per rank, and
no launcher's 3 s). The one-process references are forked the same way.
The layouts add the same numbers in other orders (TP splits the matmuls' inner sums and
all-reduces the parts, dp=2 sums two ranks' gradients, the gradient norm sums 10^5 float32 squares
per group), so results agree to rounding. Measured on this machine (2-core EPYC): losses within
2.4e-7 relative, gradient norms within 5.3e-5 relative, weights after two AdamW steps within 1.6e-6
(tp=2) and 6e-8 (dp=2). The tolerances: losses 1e-5 relative, gradient norms 3e-4, weights 1e-5
absolute. AdamW's first steps move every weight by about lr = 1e-4 whatever its gradient's size, so
a step that went wrong (a rank's share missing or counted twice, a shard not synchronised) moves
weights by ~1e-4, ten times the weight tolerance.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from stack_util import bcstack_forked, bcstack_ranks, warm_forkserver

from core.checkpoint import verify_checkpoint
from trainer.checkpoint import load_model_state, step_dir_name

REPO_ROOT = Path(__file__).resolve().parents[1]
WEIGHT_ATOL = 1e-5
REL = {"loss": 1e-5, "grad_norm": 3e-4}
GRPO_ARGS = ["--steps", "2", "--groups-per-step", "2", "--micro-batch-tokens", "600", "--lr", "1e-4"]


def bcstack(
    args: list[str], *, ranks: int = 1, timeout: int = 300, torchrun: bool = False
) -> subprocess.CompletedProcess[str]:
    """`bcstack ARGS` as one process or as `ranks` ranks forked (see the module's docstring), or
    with `torchrun` under `torchrun --nproc_per_node RANKS`."""
    if ranks == 1:
        done = bcstack_forked(args, env={"OMP_NUM_THREADS": "1"}, timeout=timeout)
    elif not torchrun:
        done = bcstack_ranks(args, ranks, env={"OMP_NUM_THREADS": "1"}, timeout=timeout)
    else:
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        }
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += ["--nproc_per_node", str(ranks), "-m", "bcstack", *args]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def steps(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def step_of(metrics: dict) -> int:
    return metrics.get("step", metrics.get("update"))  # grpo's metrics say step, sft's (the sinks') update


def assert_same_run(a: Path, b: Path, step: int) -> None:
    """Same losses and gradient norms at every step, same weights after `step`."""
    left, right = steps(a), steps(b)
    assert [step_of(m) for m in left] == [step_of(m) for m in right] == list(range(1, step + 1))
    for m, n in zip(left, right, strict=True):
        for key, rel in REL.items():
            assert n[key] == pytest.approx(m[key], rel=rel, abs=1e-9), (key, step_of(m))
        assert n["tokens"] == m["tokens"] and n.get("loss_tokens") == m.get("loss_tokens")
    wa = load_model_state(a / "checkpoints" / step_dir_name(step))
    wb = load_model_state(b / "checkpoints" / step_dir_name(step))
    assert wa.keys() == wb.keys()
    worst = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    assert worst < WEIGHT_ATOL, f"weights differ by {worst:.2e}"


def _trajectory(rng: random.Random, vocab: int) -> dict:
    token_ids: list[int] = []
    loss_mask: list[int] = []
    logprobs: list[float] = []
    turns = []
    for _ in range(rng.randint(1, 3)):
        prompt, generated = rng.randint(8, 60), rng.randint(4, 40)
        start = len(token_ids)
        token_ids += [rng.randrange(vocab) for _ in range(prompt + generated)]
        loss_mask += [0] * prompt + [1] * generated
        logprobs += [-rng.uniform(0.5, 6.0) for _ in range(generated)]  # per generated token
        turns.append(
            {
                "prompt_start": start,
                "gen_start": start + prompt,
                "gen_end": start + prompt + generated,
                "generated_tokens": generated,
                "weight_version": "v0",
                "finish_reason": "stop",
            }
        )
    return {
        "token_ids": token_ids,
        "loss_mask": loss_mask,
        "rollout_logprobs": logprobs,
        "turns": turns,
        "tool_calls": [],
        "stop_reason": "finish",
        "tokens_used": len(token_ids),
        "turns_used": len(turns),
        "error": "",
    }


def write_records(path: Path, vocab: int, groups: int = 4, episodes: int = 4) -> None:
    """Episode records of `groups` questions x `episodes`, rewards mixed within each group, 1-2 workers."""
    rng = random.Random(16)
    lines = []
    for g in range(groups):
        for e in range(episodes):
            right = (e + g) % 2 == 0
            workers = [
                {
                    "branch": b,
                    "episode_id": f"g{g}-e{e}-w{b}",
                    "status": "finished",
                    "trajectory": _trajectory(rng, vocab),
                    "report": {"answer": "Tartu" if right else "Riga", "explanation": "", "raw_text": ""},
                }
                for b in range(rng.randint(1, 2))
            ]
            lines.append(
                {
                    "episode_id": f"g{g}-e{e}",
                    "question_id": f"q{g}",
                    "group_id": f"group-{g}",
                    "question": "Where?",
                    "gold_answer": "Tartu",
                    "answer": "Tartu" if right else "Riga",
                    "status": "finished",
                    "workers": workers,
                }
            )
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


@pytest.fixture(scope="module")
def kits(tmp_path_factory: pytest.TempPathFactory, tiny_kit) -> dict[str, Path]:
    """The tiny kit, and a wider model (hidden 128, 8 heads, 4 KV heads) with the same tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    warm_forkserver()  # its imports run while the kits are made
    root = tmp_path_factory.mktemp("dist")
    tiny = root / "tiny"
    tiny_kit(tiny)
    wide = root / "wide"
    shutil.copytree(tiny, wide)
    config = AutoConfig.from_pretrained(tiny)
    config.update(
        {"hidden_size": 128, "num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 384}
    )
    torch.manual_seed(3)
    for weights in wide.glob("*.safetensors"):
        weights.unlink()
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(wide)
    return {"tiny": tiny, "wide": wide, "root": root}


@pytest.fixture(scope="module")
def records(kits: dict[str, Path]) -> Path:
    from transformers import AutoConfig

    path = kits["root"] / "records.jsonl"
    write_records(path, AutoConfig.from_pretrained(kits["tiny"]).vocab_size)
    return path


def grpo_layouts(kits: dict[str, Path], records: Path, kit: str) -> dict[str, Path]:
    """Two GRPO updates of `kit` at one process, tp=2 and dp=2: the three run folders."""
    runs = {}
    for name, ranks, tp in (("one", 1, 1), ("tp2", 2, 2), ("dp2", 2, 1)):
        out = kits["root"] / f"grpo-{kit}-{name}"
        args = ["train", "grpo", "--records", str(records), "--model", str(kits[kit])]
        args += ["--ref", str(kits[kit]), "--out", str(out), "--tp", str(tp), *GRPO_ARGS]
        bcstack(args, ranks=ranks)
        runs[name] = out
    return runs


@pytest.fixture(scope="module")
def grpo_runs(kits: dict[str, Path], records: Path) -> dict[str, Path]:
    return grpo_layouts(kits, records, "tiny")


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_grpo_at_two_ranks_matches_one_process(grpo_runs: dict[str, Path], layout: str) -> None:
    assert_same_run(grpo_runs["one"], grpo_runs[layout], step=2)
    # Rank 0 alone wrote the metrics: one line per step, not one per rank.
    assert [m["step"] for m in steps(grpo_runs[layout])] == [1, 2]
    # The export gathered the full tensors: the same serving checkpoint, verified as any other.
    summary = verify_checkpoint(grpo_runs[layout] / "serving")
    assert summary["tensors"] == verify_checkpoint(grpo_runs["one"] / "serving")["tensors"]


def test_grpo_checkpoint_saved_at_tp2_resumes_at_dp2_and_in_one_process(
    grpo_runs: dict[str, Path], records: Path, kits: dict[str, Path], tmp_path: Path
) -> None:
    saved = grpo_runs["tp2"]
    state = json.loads((saved / "checkpoints" / step_dir_name(1) / "trainer_state.json").read_text())
    assert state["layout"] == {"dp": 1, "tp": 2}
    one_step = [steps(saved)[0]]
    for name, ranks, tp in (("dp2", 2, 1), ("one", 1, 1)):
        out = tmp_path / name
        out.mkdir()
        shutil.copytree(saved / "checkpoints" / step_dir_name(1), out / "checkpoints" / step_dir_name(1))
        (out / "metrics.jsonl").write_text(json.dumps(one_step[0]) + "\n")
        args = ["train", "grpo", "--records", str(records), "--model", str(kits["tiny"])]
        args += ["--ref", str(kits["tiny"]), "--out", str(out), "--tp", str(tp), "--resume", *GRPO_ARGS]
        done = bcstack(args, ranks=ranks)
        assert "resumed from" in done.stdout
        # The next step is the one the unbroken one-process run took.
        assert_same_run(grpo_runs["one"], out, step=2)


def sft_args(model: Path, chat: Path, out: Path, tp: int) -> list[str]:
    return [
        "train", "sft", "--model", str(model), "--source", f"core={chat}", "--out", str(out),
        "--global-batch", "4", "--micro-batch-tokens", "80", "--lr", "1e-4", "--max-steps", "2",
        "--checkpoint-every", "1", "--tp", str(tp),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def chat(kits: dict[str, Path]) -> Path:
    path = kits["root"] / "chat.jsonl"
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"Which town is number {i}?"},
                {"role": "assistant", "content": f"Town {i * 7 % 13} by the river {'ab' * (i % 5)}."},
            ]
        }
        for i in range(12)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_grpo_of_the_wider_model_at_two_ranks_matches_one_process(
    kits: dict[str, Path], records: Path
) -> None:
    runs = grpo_layouts(kits, records, "wide")
    for layout in ("tp2", "dp2"):
        assert_same_run(runs["one"], runs[layout], step=2)


@pytest.mark.parametrize("kit", ["tiny", "wide"])
def test_sft_at_two_ranks_matches_one_process(kits: dict[str, Path], chat: Path, kit: str) -> None:
    outs = {}
    for name, ranks, tp in (("one", 1, 1), ("tp2", 2, 2), ("dp2", 2, 1)):
        outs[name] = kits["root"] / f"sft-{kit}-{name}"
        torchrun = kit == "tiny" and name == "tp2"  # once for real; ~8 s of imports per rank each time
        bcstack(sft_args(kits[kit], chat, outs[name], tp), ranks=ranks, torchrun=torchrun)
    for layout in ("tp2", "dp2"):
        assert_same_run(outs["one"], outs[layout], step=2)


def test_a_layout_the_model_does_not_divide_is_one_error_line(kits: dict[str, Path], chat: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += ["-m", "bcstack", *sft_args(kits["tiny"], chat, kits["root"] / "bad", 4)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert done.returncode != 0
    # Each rank that got as far as printing said it in one line; the first rank to exit can make
    # torchrun stop the other before it prints, so one line or two.
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    expected = "error: --tp 4 does not divide the job's 2 processes (torchrun --nproc_per_node x --nnodes)"
    assert 1 <= len(errors) <= 2 and set(errors) == {expected}, done.stderr[-3000:]
    # No traceback of ours: the one traceback is torchrun's own, raising the ranks' failure.
    assert done.stderr.count("Traceback") == 1 and "ChildFailedError" in done.stderr
    # (a .venv inside the checkout holds torchrun's own files: those frames are not ours)
    ours = [
        line for line in done.stderr.splitlines() if f'File "{REPO_ROOT}/' in line and "/.venv/" not in line
    ]
    assert ours == []


def test_layout_checks_and_the_micro_batch_schedule() -> None:
    from types import SimpleNamespace

    from trainer.distributed import dp_schedule
    from trainer.layout import LayoutError, check_layout

    qwen3_4b = SimpleNamespace(
        num_attention_heads=32, num_key_value_heads=8, intermediate_size=9728, vocab_size=151936
    )
    assert check_layout(8, 4, qwen3_4b) == 2
    with pytest.raises(LayoutError, match="KV heads 8"):
        check_layout(16, 16, qwen3_4b)
    with pytest.raises(LayoutError, match="does not divide the job's 6 processes"):
        check_layout(6, 4)

    sizes = [900, 100, 500, 500, 300]
    plans = dp_schedule(sizes, 2)
    # Every micro-batch is trained exactly once, each rank has ceil(5 / 2) = 3 slots, the loads balance.
    real = sorted(i for plan in plans for i, is_real in plan if is_real)
    assert real == [0, 1, 2, 3, 4] and [len(plan) for plan in plans] == [3, 3]
    assert sorted(sum(sizes[i] for i, is_real in plan if is_real) for plan in plans) == [1100, 1200]
    # One micro-batch for two ranks: the second runs it again as padding (scale 0), never skips the step.
    assert dp_schedule([64], 2) == [[(0, True)], [(0, False)]]
    assert dp_schedule([5, 5, 5], 1) == [[(0, True), (1, True), (2, True)]]
