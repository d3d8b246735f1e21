"""Serving-format export and verification (DESIGN.md §5, seed 000) on the tiny Qwen3 kit.

The kit is built once per module (float32, 4,105 tokens, 4,224 padded embedding rows) and
exported once; each test that breaks a checkpoint works on its own copy. What a user relies on:
the export verifies, every kept row is the original row in BF16 byte for byte, transformers loads
the result and computes the original model's logits, Qwen3-4B's layout has 398 tensors, verify
names the first problem of a broken checkpoint, and a failed export leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import trainer.export as export_module
from core.checkpoint import (
    SUMS_FILE,
    VerifyError,
    expected_tensors,
    verify_checkpoint,
    write_sha256sums,
)
from trainer.cli import app
from trainer.export import ExportError, export_checkpoint

TOKENS = 4105  # the kit's tokenizer: 4,096 BPE tokens + 9 added (Qwen3's special and control tokens)
PADDED_ROWS = 4224
EMBEDDING = "model.embed_tokens.weight"
runner = CliRunner()


@pytest.fixture(scope="module")
def kit(tmp_path_factory: pytest.TempPathFactory, tiny_kit) -> Path:
    return tiny_kit(tmp_path_factory.mktemp("kit") / "tiny")


@pytest.fixture(scope="module")
def served(kit: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("served") / "tiny-bf16"
    return out, export_checkpoint(kit, out)


@pytest.fixture
def served_copy(served: tuple[Path, dict], tmp_path: Path) -> Path:
    return Path(shutil.copytree(served[0], tmp_path / "copy"))


def _rewrite_weights(folder: Path, mutate: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Change the tensors and re-hash, so that verify gets past SHA256SUMS to the tensor checks."""
    tensors = load_file(folder / "model.safetensors")
    mutate(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    write_sha256sums(folder)


def _edit_json(folder: Path, name: str, edit: Callable[[dict], None]) -> None:
    data = json.loads((folder / name).read_text(encoding="utf-8"))
    edit(data)
    (folder / name).write_text(json.dumps(data, indent=2), encoding="utf-8")
    write_sha256sums(folder)


def _qwen3_4b_config(tie_word_embeddings: bool = True) -> dict:
    from transformers import Qwen3Config

    # Qwen/Qwen3-4B's config.json (public values), as transformers writes it.
    return Qwen3Config(
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=tie_word_embeddings,
        attention_bias=False,
    ).to_dict()


def test_export_of_the_tiny_model_verifies(kit: Path, served: tuple[Path, dict]) -> None:
    out, summary = served
    assert sorted(path.name for path in out.iterdir()) == [
        SUMS_FILE,
        "bcstack_export.json",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert summary["source_vocab_rows"] == PADDED_ROWS and summary["vocab_rows"] == TOKENS
    assert summary["tokenizer_tokens"] == TOKENS and summary["dtype"] == "BF16"
    assert summary["tensors"] == 24 and summary["tie_word_embeddings"]  # 2 layers x 11 + embedding + norm
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == TOKENS and config["dtype"] == "bfloat16"
    # Tokenizer and generation config restored unchanged.
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (kit / name).read_bytes()
    # sha256sum format, every other file listed.
    lines = (out / SUMS_FILE).read_text().splitlines()
    assert lines == [
        f"{hashlib.sha256((out / name).read_bytes()).hexdigest()}  {name}"
        for name in sorted(p.name for p in out.iterdir() if p.name != SUMS_FILE)
    ]
    assert verify_checkpoint(out)["tensors"] == 24
    assert not list(out.parent.glob(".*partial*"))
    manifest = json.loads((out / "bcstack_export.json").read_text())
    assert manifest == {
        "vocab_rows": TOKENS,
        "vocab_rows_from": "the tokenizer",
        "source_vocab_rows": PADDED_ROWS,
    }


def test_the_base_models_vocabulary_is_kept_when_the_tokenizer_comes_from_it(
    kit: Path, tmp_path: Path
) -> None:
    # The seed's real case: 152,064 trained rows -> the base Qwen3-4B's 151,936, whose tokenizer has
    # only 151,669 tokens. Here: 4,224 trained rows -> a "base" with 4,160 rows -> 4,105 tokens.
    base = tmp_path / "base"
    base.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(kit / name, base / name)
    base_rows = TOKENS + 55
    (base / "config.json").write_text(
        json.dumps({**json.loads((kit / "config.json").read_text()), "vocab_size": base_rows})
    )
    out = tmp_path / "serving"
    export_checkpoint(kit, out, tokenizer_dir=base)
    manifest = json.loads((out / "bcstack_export.json").read_text())
    assert manifest["vocab_rows"] == base_rows and str(base) in manifest["vocab_rows_from"]
    summary = verify_checkpoint(out)  # no flags: the declared rows are checked
    assert summary["vocab_rows"] == base_rows
    # a manifest that lies is caught by its hash; one re-hashed to match is caught by the rows check
    path = out / "bcstack_export.json"
    path.write_text(json.dumps({**manifest, "vocab_rows": TOKENS}))
    with pytest.raises(VerifyError, match="bcstack_export.json"):
        verify_checkpoint(out)
    write_sha256sums(out)
    with pytest.raises(VerifyError, match=f"declares {TOKENS}"):
        verify_checkpoint(out)


def test_kept_rows_are_the_original_rows_in_bf16_byte_for_byte(kit: Path, served: tuple[Path, dict]) -> None:
    original = load_file(kit / "model.safetensors")
    exported = load_file(served[0] / "model.safetensors")
    assert original[EMBEDDING].shape == (PADDED_ROWS, 64) and original[EMBEDDING].dtype == torch.float32
    assert exported[EMBEDDING].shape == (TOKENS, 64)
    assert set(exported) == set(original)
    for name, tensor in exported.items():
        want = original[name].to(torch.bfloat16)[: tensor.shape[0]]
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor.view(torch.int16), want.view(torch.int16)), name


def test_serving_model_loads_with_transformers_and_matches_the_original_logits(
    kit: Path, served: tuple[Path, dict], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(served[0])
    assert len(tokenizer) == TOKENS
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Which museum was founded in 1887?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    # transformers 5 spells torch_dtype as dtype.
    original = AutoModelForCausalLM.from_pretrained(kit, dtype=torch.bfloat16).eval()
    serving = AutoModelForCausalLM.from_pretrained(served[0], dtype=torch.bfloat16).eval()
    assert serving.config.vocab_size == TOKENS
    assert serving.lm_head.weight.data_ptr() == serving.model.embed_tokens.weight.data_ptr()  # still tied
    with torch.no_grad():
        want = original(input_ids).logits[..., :TOKENS]
        got = serving(input_ids).logits
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-2, rtol=1.6e-2)  # BF16 tolerance
    assert torch.equal(got.argmax(-1), want.argmax(-1))

    # A sharded export is the same model.
    sharded = tmp_path / "sharded"
    summary = export_checkpoint(kit, sharded, max_shard_size=200_000)
    assert len(summary["weight_files"]) > 1 and (sharded / "model.safetensors.index.json").is_file()
    assert summary["weight_files"][0] == f"model-00001-of-{len(summary['weight_files']):05d}.safetensors"
    with torch.no_grad():
        resharded = (
            AutoModelForCausalLM.from_pretrained(sharded, dtype=torch.bfloat16).eval()(input_ids).logits
        )
    assert torch.equal(resharded, got)


def test_qwen3_4b_layout_has_398_tensors_tied_and_399_untied() -> None:
    tied = expected_tensors(_qwen3_4b_config())
    assert len(tied) == 398
    assert tied[EMBEDDING] == ((151936, 2560), "BF16")
    assert "lm_head.weight" not in tied
    assert tied["model.layers.35.self_attn.q_proj.weight"] == ((4096, 2560), "BF16")
    assert tied["model.layers.35.self_attn.k_proj.weight"] == ((1024, 2560), "BF16")
    assert tied["model.layers.0.self_attn.q_norm.weight"] == ((128,), "BF16")
    assert tied["model.layers.0.mlp.down_proj.weight"] == ((2560, 9728), "BF16")
    assert {dtype for _, dtype in tied.values()} == {"BF16"}

    untied = expected_tensors(_qwen3_4b_config(tie_word_embeddings=False))
    assert len(untied) == 399 and untied["lm_head.weight"] == ((151936, 2560), "BF16")
    # The Megatron export's padded rows, from the row count alone.
    assert expected_tensors(_qwen3_4b_config(), vocab_size=152064)[EMBEDDING][0] == (152064, 2560)


def _flip_a_weight_byte(folder: Path) -> None:
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _drop_up_proj(folder: Path) -> None:
    _rewrite_weights(folder, lambda tensors: tensors.pop("model.layers.1.mlp.up_proj.weight"))


def _shrink_norm(folder: Path) -> None:
    _rewrite_weights(
        folder, lambda tensors: tensors.update({"model.norm.weight": torch.ones(63, dtype=torch.bfloat16)})
    )


def _fp32_norm(folder: Path) -> None:
    _rewrite_weights(folder, lambda tensors: tensors.update({"model.norm.weight": torch.ones(64)}))


def _too_few_rows(folder: Path) -> None:
    _rewrite_weights(folder, lambda tensors: tensors.update({EMBEDDING: tensors[EMBEDDING][:4000].clone()}))
    _edit_json(folder, "config.json", lambda config: config.update(vocab_size=4000))


def _config_disagrees(folder: Path) -> None:
    _edit_json(folder, "config.json", lambda config: config.update(vocab_size=PADDED_ROWS))


def _embedding_rows_disagree(folder: Path) -> None:
    _rewrite_weights(folder, lambda tensors: tensors.update({EMBEDDING: tensors[EMBEDDING][:4000].clone()}))


def _no_tokenizer_json(folder: Path) -> None:
    (folder / "tokenizer.json").unlink()
    write_sha256sums(folder)


def _no_chat_template(folder: Path) -> None:
    _edit_json(folder, "tokenizer_config.json", lambda config: config.pop("chat_template"))


def _no_sums(folder: Path) -> None:
    (folder / SUMS_FILE).unlink()


def _extra_weights(folder: Path) -> None:
    shutil.copyfile(folder / "model.safetensors", folder / "model-extra.safetensors")


def _unlisted_tokenizer_file(folder: Path) -> None:
    (folder / "tokenizer.json").unlink()  # SHA256SUMS still lists it


BROKEN = {
    "wrong hash": (_flip_a_weight_byte, r"^model\.safetensors: SHA256 mismatch"),
    "missing tensor": (_drop_up_proj, r"^missing tensor model\.layers\.1\.mlp\.up_proj\.weight"),
    "wrong shape": (_shrink_norm, r"tensor model\.norm\.weight has shape \[63\], expected \[64\]"),
    "wrong dtype": (_fp32_norm, r"tensor model\.norm\.weight is F32, expected BF16"),
    "too few rows": (
        _too_few_rows,
        r"config\.json vocab_size 4000 is smaller than the tokenizer's 4105 tokens",
    ),
    "config vocab": (_config_disagrees, r"has 4105 rows but config\.json vocab_size is 4224"),
    "embedding rows": (_embedding_rows_disagree, r"has 4000 rows but config\.json vocab_size is 4105"),
    "missing tokenizer file": (_no_tokenizer_json, r"^tokenizer\.json: missing"),
    "deleted listed file": (_unlisted_tokenizer_file, r"^tokenizer\.json: listed in SHA256SUMS but missing"),
    "no chat template": (_no_chat_template, r"^no chat template"),
    "missing SHA256SUMS": (_no_sums, r"^SHA256SUMS: missing"),
    "extra weight file": (_extra_weights, r"^model-extra\.safetensors: weight file not listed in SHA256SUMS"),
}


@pytest.mark.parametrize("breakage", list(BROKEN))
def test_verify_names_the_first_problem(served_copy: Path, breakage: str) -> None:
    break_it, message = BROKEN[breakage]
    break_it(served_copy)
    with pytest.raises(VerifyError, match=message) as caught:
        verify_checkpoint(served_copy)
    assert "\n" not in str(caught.value)


def test_untrimmed_vocabulary_fails_unless_the_engine_keeps_it(kit: Path, tmp_path: Path) -> None:
    padded = tmp_path / "padded"
    summary = export_checkpoint(kit, padded, vocab_size=PADDED_ROWS)  # verified with its own row count
    assert summary["vocab_rows"] == PADDED_ROWS
    assert verify_checkpoint(padded)["vocab_rows"] == PADDED_ROWS  # the export declared its choice
    # without the export's manifest (a checkpoint made elsewhere) the tokenizer is the expectation
    (padded / "bcstack_export.json").unlink()
    write_sha256sums(padded)
    with pytest.raises(VerifyError, match=r"has 4224 rows but the tokenizer has 4105 tokens"):
        verify_checkpoint(padded)
    assert verify_checkpoint(padded, vocab_size=PADDED_ROWS)["vocab_rows"] == PADDED_ROWS
    # The engine serves the padded original: its config is the expectation.
    assert verify_checkpoint(padded, expect_config=kit / "config.json")["expect_config"]


def test_expect_config_checks_the_served_architecture(served: tuple[Path, dict], tmp_path: Path) -> None:
    out = served[0]
    assert verify_checkpoint(out, expect_config=out)["tensors"] == 24
    other = json.loads((out / "config.json").read_text())
    other["hidden_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(other))
    with pytest.raises(VerifyError, match=r"hidden_size is 64, the served model's config has 128"):
        verify_checkpoint(out, expect_config=tmp_path / "config.json")
    other["num_hidden_layers"] = 4  # inconsistent with its layer_types: transformers refuses it
    (tmp_path / "config.json").write_text(json.dumps(other))
    with pytest.raises(
        VerifyError, match=r"^expect-config .*config\.json: unreadable \(.*num_hidden_layers"
    ) as caught:
        verify_checkpoint(out, expect_config=tmp_path / "config.json")
    assert "\n" not in str(caught.value)


def test_unlisted_non_weight_files_are_reported_not_rejected(served_copy: Path) -> None:
    (served_copy / "README.md").write_text("model card\n")
    assert verify_checkpoint(served_copy)["unlisted_files"] == ["README.md"]


def test_tied_lm_head_from_a_megatron_export_is_dropped_only_if_equal(kit: Path, tmp_path: Path) -> None:
    source = Path(shutil.copytree(kit, tmp_path / "megatron"))
    tensors = load_file(source / "model.safetensors")
    tensors["lm_head.weight"] = tensors[EMBEDDING].clone()
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    summary = export_checkpoint(source, tmp_path / "out")
    assert summary["dropped_tied_lm_head"] == "lm_head.weight" and summary["tensors"] == 24

    tensors["lm_head.weight"][0, 0] += 1.0
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ExportError, match=r"lm_head\.weight differs from model\.embed_tokens\.weight"):
        export_checkpoint(source, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


def test_export_refuses_a_vocabulary_smaller_than_the_tokenizer(kit: Path, tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=r"vocab_size 4000 is smaller than the tokenizer's 4105 tokens"):
        export_checkpoint(kit, tmp_path / "out", vocab_size=4000)
    assert list(tmp_path.iterdir()) == []


def test_killed_export_leaves_no_checkpoint(
    kit: Path, served: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_save = export_module.save_file

    def save_then_die(tensors, filename, metadata=None):
        real_save(tensors, filename, metadata=metadata)
        Path(filename).write_bytes(Path(filename).read_bytes()[:1000])  # half written
        raise KeyboardInterrupt("killed while writing weights")

    monkeypatch.setattr(export_module, "save_file", save_then_die)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        export_checkpoint(kit, out)
    assert list(tmp_path.iterdir()) == []

    # Replacing a checkpoint: a failed export keeps the old one as it was.
    previous = Path(shutil.copytree(served[0], out))
    before = (previous / SUMS_FILE).read_bytes()
    with pytest.raises(KeyboardInterrupt):
        export_checkpoint(kit, out, force=True)
    assert (out / SUMS_FILE).read_bytes() == before and verify_checkpoint(out)["vocab_rows"] == TOKENS
    assert [path.name for path in tmp_path.iterdir()] == ["out"]


def test_cli_export_and_verify(kit: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli"
    result = runner.invoke(app, ["export", "--model", str(kit), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "Exported and verified" in result.stdout and "4,105 embedding rows" in result.stdout

    result = runner.invoke(app, ["export", "--model", str(kit), "--out", str(out)])
    assert result.exit_code == 2 and "not empty" in result.stderr

    result = runner.invoke(app, ["verify", str(out), "--expect-config", str(out / "config.json")])
    assert result.exit_code == 0, result.output
    assert "Verified" in result.stdout and "all hashes match" in result.stdout

    _flip_a_weight_byte(out)
    result = runner.invoke(app, ["verify", str(out)])
    assert result.exit_code == 2
    assert (
        result.stderr == "error: model.safetensors: SHA256 mismatch (changed since SHA256SUMS was written)\n"
    )
