"""LoRA for the seed-004 specialists (trainer.lora): the adapter layout, and `bcstack train merge-lora`
with its checks passing on a real adapter and failing on tampered ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from bcstack.cli import app
from core.checkpoint import verify_checkpoint, write_sha256sums
from trainer import lora as lora_mod
from trainer.lora import (
    LoraError,
    LoraSettings,
    adapter_tensor_count,
    attach_lora,
    merge_lora,
    merged_state_dict,
)

runner = CliRunner()


def test_qwen3_4b_layout_has_the_seeds_506_adapter_tensors():
    """Seed 004: 'Export validation checked all 506 adapter tensors' (rank 16 on attn, MLP, lm_head)."""
    from transformers import Qwen3Config

    config = Qwen3Config(  # Qwen/Qwen3-4B's config.json
        vocab_size=151_936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
    )  # fmt: skip
    peft_model = attach_lora(_meta(config), LoraSettings())
    assert adapter_tensor_count(peft_model) == 506
    head = peft_model.get_base_model().lm_head
    assert head.base_layer.weight is not peft_model.get_base_model().model.embed_tokens.weight  # untied
    assert adapter_tensor_count(attach_lora(_meta(config), LoraSettings(targets=("attn",)))) == 36 * 4 * 2
    with pytest.raises(LoraError, match="unknown LoRA target group"):
        LoraSettings(targets=("attn", "ffn")).target_modules()


def _meta(config):
    from transformers import Qwen3ForCausalLM

    with torch.device("meta"):
        return Qwen3ForCausalLM(config)


@pytest.fixture(scope="module")
def kit(tmp_path_factory: pytest.TempPathFactory, tiny_kit) -> Path:
    return tiny_kit(tmp_path_factory.mktemp("lora-kit") / "tiny")


@pytest.fixture(scope="module")
def adapter(kit: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A rank-4 adapter on attn, MLP and lm_head with non-zero B matrices (a trained adapter's shape)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(kit, dtype=torch.float32)
    peft_model = attach_lora(model, LoraSettings(rank=4, alpha=8))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    out = tmp_path_factory.mktemp("adapter") / "adapter"
    peft_model.save_pretrained(str(out), save_embedding_layers=False)
    return out


def test_merge_lora_exports_a_verified_untied_bf16_model_with_provenance(kit, adapter, tmp_path):
    out = tmp_path / "merged"
    result = runner.invoke(
        app, ["train", "merge-lora", "--base", str(kit), "--adapter", str(adapter), "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "30 adapter tensors" in result.output  # 2 layers x 7 modules + lm_head, A and B each
    provenance = json.loads((out / "model_provenance.json").read_text())
    assert provenance["adapter_tensors"] == 30 and provenance["adapted_modules"] == 15
    assert provenance["logits_check"]["passed"] and provenance["logits_check"]["logits_differing"] == 0
    assert provenance["embedding_preserved"] and provenance["head_untied"] and provenance["head_was_tied"]
    assert provenance["merge_max_abs_diff"] <= provenance["merge_tolerance"]
    assert lora_mod.MERGE_ATOL < provenance["merge_tolerance"] < 10 * lora_mod.MERGE_ATOL
    assert provenance["adapter"]["config"]["r"] == 4
    kit_manifest = json.loads((kit / "bcstack_model.json").read_text())
    assert provenance["base"]["revision"] == "sha256:" + kit_manifest["files"]["model.safetensors"]
    summary = verify_checkpoint(out)  # what `bcstack checkpoint verify` runs
    assert summary["dtype"] == "BF16" and not summary["tie_word_embeddings"]
    assert "model_provenance.json" not in summary.get("unlisted_files", [])  # hashed with the rest
    verify = runner.invoke(app, ["checkpoint", "verify", str(out)])
    assert verify.exit_code == 0, verify.output

    weights = load_file(str(next(out.glob("*.safetensors"))))
    base = load_file(str(kit / "model.safetensors"))
    rows = weights["model.embed_tokens.weight"].shape[0]
    # The input embedding is the base's (cast to BF16, trimmed to the tokenizer); the head is adapted.
    assert torch.equal(
        weights["model.embed_tokens.weight"], base["model.embed_tokens.weight"][:rows].bfloat16()
    )
    assert not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])

    again = runner.invoke(
        app, ["train", "merge-lora", "--base", str(kit), "--adapter", str(adapter), "--out", str(out)]
    )
    assert again.exit_code == 2 and "not empty" in again.output


def _tampered(adapter: Path, tmp_path: Path, change) -> Path:
    out = tmp_path / "tampered"
    out.mkdir()
    (out / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    change(tensors)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


def test_merge_lora_refuses_an_adapter_tensor_that_would_not_be_applied(kit, adapter, tmp_path):
    def rename(tensors):
        key = next(k for k in sorted(tensors) if "q_proj.lora_B" in k)
        tensors[key.replace("q_proj", "qq_proj")] = tensors.pop(key)

    bad = _tampered(adapter, tmp_path, rename)
    result = runner.invoke(
        app, ["train", "merge-lora", "--base", str(kit), "--adapter", str(bad), "--out", str(tmp_path / "o")]
    )
    assert result.exit_code == 2
    assert "match no tensor of the adapted base" in result.output and "qq_proj" in result.output
    assert not (tmp_path / "o").exists()


def test_merge_lora_fails_the_logits_checks_on_a_corrupted_adapter(kit, adapter, tmp_path):
    def poison(tensors):
        key = next(k for k in sorted(tensors) if "down_proj.lora_B" in k)
        tensors[key][0, 0] = float("nan")

    bad = _tampered(adapter, tmp_path, poison)
    result = runner.invoke(
        app, ["train", "merge-lora", "--base", str(kit), "--adapter", str(bad), "--out", str(tmp_path / "o")]
    )
    assert result.exit_code == 2 and "FP32 merge differs" in result.output


def test_the_bf16_reload_check_catches_an_export_that_is_not_the_merged_model(
    kit, adapter, tmp_path, monkeypatch
):
    """The bitwise check fails when a single exported value is not the FP32 merge's BF16 cast."""
    import trainer.export as export_mod

    real = export_mod.export_checkpoint

    def export_then_flip(model_dir, out_dir, **kwargs):
        summary = real(model_dir, out_dir, **kwargs)
        path = next(Path(out_dir).glob("*.safetensors"))
        tensors = load_file(str(path))
        w = tensors["model.layers.0.mlp.down_proj.weight"]
        w[0, 0] = (w[0, 0].float() + 0.5).bfloat16()
        save_file(tensors, str(path), metadata={"format": "pt"})
        write_sha256sums(Path(out_dir))
        return summary

    monkeypatch.setattr(export_mod, "export_checkpoint", export_then_flip)
    with pytest.raises(LoraError, match="logits after the BF16 save/reload differ"):
        merge_lora(kit, adapter, tmp_path / "o")
    provenance = json.loads((tmp_path / "o" / "model_provenance.json").read_text())
    assert (
        provenance["logits_check"]["passed"] is False and provenance["logits_check"]["logits_differing"] > 0
    )


def test_merged_state_dict_is_base_plus_delta_and_leaves_the_adapter_unmerged(kit):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    base = AutoModelForCausalLM.from_pretrained(kit, dtype=torch.float32)
    reference = {k: v.clone() for k, v in base.state_dict().items()}
    peft_model = attach_lora(base, LoraSettings(rank=2, alpha=4, targets=("mlp",)))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)
    merged = merged_state_dict(peft_model)
    assert set(merged) == set(reference) | {"lm_head.weight"} or set(merged) == set(reference)
    layer = peft_model.get_base_model().model.layers[0].mlp.up_proj
    delta = layer.get_delta_weight("default")
    assert torch.equal(
        merged["model.layers.0.mlp.up_proj.weight"], reference["model.layers.0.mlp.up_proj.weight"] + delta
    )
    assert torch.equal(
        merged["model.layers.0.self_attn.q_proj.weight"], reference["model.layers.0.self_attn.q_proj.weight"]
    )
    assert torch.equal(
        layer.base_layer.weight, reference["model.layers.0.mlp.up_proj.weight"]
    )  # not merged in place
