"""Tensor parallelism (DESIGN.md §5): TP=2 under torchrun reproduces TP=1 on the tiny Qwen3.

The TP=2 side runs tests/tp_worker.py under `torchrun --nproc_per_node 2` (gloo on the CPU); the
TP=1 side is the unsharded model in this process, given the same batch and the same AdamW step.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from trainer.parallel import QWEN3_TP_PLAN, causal_lm_loss, init_distributed, loss_context

WORKER = Path(__file__).with_name("tp_worker.py")
REPO_ROOT = Path(__file__).resolve().parents[1]
TP = 2
# Adam's first step moves each weight by lr·g/(|g|+eps). For |g| ≲ eps that amplifies float32
# rounding differences between the TP=1 and TP=2 reduction orders by lr/eps: with torch's default
# eps (1e-8) and lr 1e-3 gradients of ~1e-10 moved weights 5e-5 apart. lr/eps = 100 keeps that
# below 2e-7 while the step itself still moves weights by up to 1e-4, far above the 1e-6 tolerance.
ADAMW = {"lr": 1e-4, "eps": 1e-6, "weight_decay": 0.1}


def load_model(kit: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(kit, dtype=torch.float32).train()


@pytest.fixture(scope="module")
def kit(tmp_path_factory: pytest.TempPathFactory, tiny_kit) -> Path:
    return tiny_kit(tmp_path_factory.mktemp("tp") / "tiny")


@pytest.fixture(scope="module")
def batch(kit: Path) -> dict:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(kit).vocab_size
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab, (3, 24), generator=generator)
    input_ids[0, -1] = vocab - 1  # a row of the second vocabulary shard, as input and as target
    labels = input_ids.clone()
    labels[1, :5] = -100  # a masked prompt
    return {"input_ids": input_ids, "labels": labels, "adamw": ADAMW}


@pytest.fixture(scope="module")
def tp2(kit: Path, batch: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("tp2")
    torch.save(batch, work / "batch.pt")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(TP), "--standalone"]
    command += [str(WORKER), str(kit), str(work / "batch.pt"), str(work / "out.pt")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"torchrun failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return torch.load(work / "out.pt")


@pytest.fixture(scope="module")
def tp1(kit: Path, batch: dict) -> dict:
    model = load_model(kit)
    optimizer = torch.optim.AdamW(model.parameters(), **batch["adamw"])
    logits = model(input_ids=batch["input_ids"], use_cache=False).logits
    loss = causal_lm_loss(logits, batch["labels"])
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer.step()
    return {
        "logits": logits.detach(),
        "loss": loss.detach(),
        "grads": grads,
        "before": before,
        "weights": {name: p.detach().clone() for name, p in model.named_parameters()},
        "config": model.config,
    }


def test_tp2_runs_on_gloo_with_vocab_sharded_logits(tp2: dict) -> None:
    assert (tp2["backend"], tp2["world_size"]) == ("gloo", TP)
    assert tp2["logits_type"] == "DTensor"  # kept sharded for the vocab-parallel loss
    assert tp2["tied"]  # lm_head and the embedding are still one parameter after sharding


def test_tp2_splits_heads_mlp_and_vocabulary(tp2: dict, tp1: dict) -> None:
    config = tp1["config"]
    hidden, head_dim, inter = config.hidden_size, config.head_dim, config.intermediate_size
    assert config.num_attention_heads % TP == 0 and config.num_key_value_heads % TP == 0
    shapes = tp2["local_shapes"]
    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    assert shapes[f"{attn}.q_proj.weight"] == (config.num_attention_heads // TP * head_dim, hidden)
    assert shapes[f"{attn}.k_proj.weight"] == (config.num_key_value_heads // TP * head_dim, hidden)
    assert shapes[f"{attn}.v_proj.weight"] == (config.num_key_value_heads // TP * head_dim, hidden)
    assert shapes[f"{attn}.o_proj.weight"] == (hidden, config.num_attention_heads // TP * head_dim)
    assert shapes[f"{attn}.q_norm.weight"] == (head_dim,)  # replicated
    assert shapes[f"{mlp}.gate_proj.weight"] == (inter // TP, hidden)
    assert shapes[f"{mlp}.down_proj.weight"] == (hidden, inter // TP)
    assert shapes["model.embed_tokens.weight"] == (config.vocab_size // TP, hidden)
    assert shapes["model.norm.weight"] == (hidden,)


def test_tp2_logits_and_loss_match_tp1(tp2: dict, tp1: dict) -> None:
    torch.testing.assert_close(tp2["logits"], tp1["logits"], rtol=0, atol=1e-5)
    torch.testing.assert_close(tp2["loss"], tp1["loss"], rtol=0, atol=1e-5)


def test_tp2_gradients_match_tp1(tp2: dict, tp1: dict) -> None:
    assert tp2["grads"].keys() == tp1["grads"].keys()
    for name, grad in tp1["grads"].items():
        # q_norm/k_norm included: each rank sees half the heads, so this needs the all-reduce.
        torch.testing.assert_close(tp2["grads"][name], grad, rtol=0, atol=1e-5, msg=name)


def test_tp2_weights_after_one_adamw_step_match_tp1(tp2: dict, tp1: dict) -> None:
    moved = max((tp1["weights"][n] - w).abs().max().item() for n, w in tp1["before"].items())
    assert moved > 50 * 1e-6  # the step is large against the tolerance
    for name, weight in tp1["weights"].items():
        torch.testing.assert_close(tp2["weights"][name], weight, rtol=0, atol=1e-6, msg=name)


def test_plan_shards_every_weight_matrix_of_qwen3(kit: Path) -> None:
    from fnmatch import fnmatch

    model = load_model(kit)

    def planned(path: str) -> bool:
        return any(
            len(path.split(".")) == len(pattern.split("."))
            and all(
                fnmatch(part, want) for part, want in zip(path.split("."), pattern.split("."), strict=True)
            )
            for pattern in QWEN3_TP_PLAN
        )

    matrices = [path for path, m in model.named_modules() if isinstance(m, nn.Linear | nn.Embedding)]
    assert matrices and all(planned(path) for path in matrices), [p for p in matrices if not planned(p)]
    norms = [path for path, m in model.named_modules() if type(m).__name__ == "Qwen3RMSNorm"]
    assert [path for path in norms if planned(path)] == [
        path for path in norms if path.endswith(("q_norm", "k_norm"))
    ]


def test_causal_lm_loss_is_transformers_shifted_loss(kit: Path, batch: dict) -> None:
    model = load_model(kit)
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False)
        with loss_context(out.logits):  # plain logits: a no-op context
            ours = causal_lm_loss(out.logits, batch["labels"])
    torch.testing.assert_close(ours, out.loss, rtol=0, atol=1e-6)


def test_init_distributed_outside_torchrun_is_single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    env = init_distributed()
    assert (env.rank, env.world_size, env.backend, env.is_main) == (0, 1, None, True)
