"""Crash-safe checkpoints: a run killed with SIGKILL resumes to exactly the weights of an unbroken run.

The training here is a small MLP whose every step draws from all three global RNGs (the batch
order from torch, input noise from numpy, a loss weight from python `random`), with AdamW and a
warm-up LR schedule, so resuming is bit-exact only if the model, optimizer, scheduler and every
RNG state come back. Run as a script, this file is the training process the crash tests kill:

    python tests/test_trainer_checkpoint.py ROOT STEPS [--hang-after-save N | --hang-saving N]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from trainer.checkpoint import (  # noqa: E402
    COMPLETE,
    STATE_DIR,
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    step_dir_name,
)

SEED = 7
BATCH = 8
_data = torch.Generator().manual_seed(1234)
INPUTS = torch.randn(64, 8, generator=_data)
TARGETS = torch.randint(0, 4, (64,), generator=_data)
HANG_LINE = "hanging"


def new_run() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
    return model, optimizer, scheduler


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> None:
    index = torch.randint(0, len(INPUTS), (BATCH,))  # data order: torch RNG
    noise = torch.from_numpy(np.random.normal(0.0, 0.1, size=(BATCH, INPUTS.shape[1]))).float()
    weight = random.uniform(0.5, 1.5)
    loss = weight * F.cross_entropy(model(INPUTS[index] + noise), TARGETS[index])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()


def train(
    root: Path | None, steps: int, *, resume: bool = False, hang_after_save: int | None = None
) -> nn.Module:
    """Train up to `steps`, checkpointing every step into `root` (if given); resume from its latest."""
    model, optimizer, scheduler = new_run()
    seed_everything(SEED)
    start = 0
    if resume and (path := latest_checkpoint(root)) is not None:
        state = load_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler)
        start = state["step"]
        assert state["data_cursor"] == {"samples_seen": start * BATCH}
    for step in range(start + 1, steps + 1):
        train_step(model, optimizer, scheduler)
        if root is not None:
            cursor = {"samples_seen": step * BATCH}
            save_checkpoint(
                root,
                step,
                model=model,
                optimizer=optimizer,
                scheduler=scheduler,
                data_cursor=cursor,
                extra={"loss_note": f"step {step}"},
            )
        if step == hang_after_save:
            hang()
    return model


def hang() -> None:
    print(HANG_LINE, flush=True)
    time.sleep(600)


def hang_inside_save(step: int) -> None:
    """Make the save of `step` stop halfway: model and optimizer state written, rng.pt a few bytes."""
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        name = getattr(f, "name", str(f))
        if f".tmp-step-{step}-" in name and name.endswith("rng.pt"):
            f.write(b"PK\x03\x04 torn")
            f.flush()
            hang()
        return real_save(obj, f, *args, **kwargs)

    torch.save = save


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def assert_identical(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> None:
    assert left.keys() == right.keys()
    for name in left:
        assert torch.equal(left[name], right[name]), name


def dead_pid() -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(done.stdout)


@pytest.fixture(autouse=True)
def restore_global_rng() -> Iterator[None]:
    """These tests reseed the global RNGs; leave them as found for the rest of the session."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    yield
    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])


@pytest.fixture(scope="module")
def four_steps() -> dict[str, torch.Tensor]:
    return weights(train(None, 4))


def test_two_steps_resumed_twice_equal_four_straight(tmp_path: Path, four_steps: dict) -> None:
    train(tmp_path, 2)
    seed_everything(999)  # a different process state; the checkpoint must override it all
    resumed = train(tmp_path, 4, resume=True)
    assert_identical(weights(resumed), four_steps)
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_dir_name(s) for s in (2, 3, 4)]


def test_resume_without_the_rng_states_diverges(tmp_path: Path, four_steps: dict) -> None:
    """The control for the test above: the RNG restore is what makes it exact."""
    train(tmp_path, 2)
    model, optimizer, scheduler = new_run()
    load_checkpoint(tmp_path / step_dir_name(2), model=model, optimizer=optimizer, scheduler=scheduler)
    seed_everything(SEED)  # as if only model/optimizer/scheduler had been restored
    for _ in range(2):
        train_step(model, optimizer, scheduler)
    assert any(not torch.equal(model.state_dict()[n], w) for n, w in four_steps.items())


@pytest.mark.parametrize("kill_at", ["after-step-2-save", "inside-step-3-save"])
def test_sigkilled_run_resumes_to_identical_weights(
    tmp_path: Path, four_steps: dict, kill_at: str, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ckpt"
    hang = ["--hang-after-save", "2"] if kill_at == "after-step-2-save" else ["--hang-saving", "3"]
    command = [sys.executable, __file__, str(root), "4", *hang]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env) as process:
        try:
            assert process.stdout is not None
            assert process.stdout.readline().strip() == HANG_LINE, "the training process ended early"
        finally:
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL
    leftovers = sorted(p.name for p in root.iterdir())
    if kill_at == "inside-step-3-save":
        assert leftovers == [f".tmp-step-3-{process.pid}", step_dir_name(1), step_dir_name(2)]
        torn = root / leftovers[0]
        shards = [f for f in (torn / STATE_DIR).iterdir() if f.suffix == ".distcp"]
        assert shards and shards[0].stat().st_size > 1000 and not (torn / COMPLETE).exists()
    else:
        assert leftovers == [step_dir_name(1), step_dir_name(2)]

    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
        assert latest_checkpoint(root) == root / step_dir_name(2)
    assert sorted(p.name for p in root.iterdir()) == [step_dir_name(1), step_dir_name(2)]
    assert ("interrupted checkpoint save" in caplog.text) == (kill_at == "inside-step-3-save")

    resumed = train(root, 4, resume=True)
    assert_identical(weights(resumed), four_steps)


def test_torn_checkpoints_are_ignored_and_cleaned(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    train(tmp_path, 2)
    no_marker = tmp_path / step_dir_name(3)  # e.g. copied by hand, or a marker lost
    no_marker.mkdir()
    (no_marker / "model.pt").write_bytes(b"half")
    crashed = tmp_path / f".tmp-step-4-{dead_pid()}"
    crashed.mkdir()
    (crashed / "model.pt").write_bytes(b"half")
    in_flight = tmp_path / f".tmp-step-4-{os.getpid()}"  # a save still running: not ours to delete
    in_flight.mkdir()
    mismatched = tmp_path / step_dir_name(5)
    mismatched.mkdir()
    (mismatched / "model.pt").write_bytes(b"short")
    (mismatched / COMPLETE).write_text(json.dumps({"step": 5, "files": {"model.pt": 1000}}))

    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
        assert latest_checkpoint(tmp_path) == tmp_path / step_dir_name(2)
    assert not no_marker.exists() and not crashed.exists()
    assert in_flight.exists() and mismatched.exists()  # kept: live, or evidence of corruption
    assert str(no_marker) in caplog.text and str(crashed) in caplog.text and str(mismatched) in caplog.text
    model, optimizer, _ = new_run()
    with pytest.raises(CheckpointError):
        load_checkpoint(mismatched, model=model, optimizer=optimizer)


def test_keeps_the_last_k_and_returns_cursor_and_extra(tmp_path: Path) -> None:
    model, optimizer, scheduler = new_run()
    for step in range(1, 6):
        path = save_checkpoint(
            tmp_path,
            step,
            model=model,
            optimizer=optimizer,
            data_cursor={"shard": step},
            extra={"note": "x"},
            keep_last=3,
        )
    assert path == tmp_path / step_dir_name(5)
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_dir_name(s) for s in (3, 4, 5)]
    save_checkpoint(tmp_path, 5, model=model, optimizer=optimizer, data_cursor={"shard": 50})  # replaced
    assert latest_checkpoint(tmp_path) == path
    state = load_checkpoint(path, model=model, optimizer=optimizer)
    assert state == {"step": 5, "layout": {"dp": 1, "tp": 1}, "data_cursor": {"shard": 50}, "extra": {}}
    with pytest.raises(CheckpointError):  # saved without a scheduler
        load_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler)
    assert latest_checkpoint(tmp_path / "absent") is None


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="the training process the crash tests kill")
    parser.add_argument("root", type=Path)
    parser.add_argument("steps", type=int)
    parser.add_argument("--hang-after-save", type=int)
    parser.add_argument("--hang-saving", type=int)
    args = parser.parse_args(argv)
    if args.hang_saving is not None:
        hang_inside_save(args.hang_saving)
    train(args.root, args.steps, resume=True, hang_after_save=args.hang_after_save)


if __name__ == "__main__":
    main(sys.argv[1:])
