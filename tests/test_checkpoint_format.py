"""core.checkpoint: the serving-format check, torch-free, against transformers' own model.

core/model_layout.py computes a checkpoint's tensors from config.json by hand so that the worker
sidecar verifies exports without torch or transformers. What a user relies on: that layout is
exactly what transformers builds (names, order, shapes) for the tiny kit, Qwen3-4B (398 tensors
tied, 399 untied) and every architecture the check knows, including the defaults of a config that
omits fields; an architecture it does not know is named as such; and verifying an export in a
fresh interpreter leaves torch and transformers unimported.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from core.checkpoint import (
    ARCHITECTURES,
    COMPATIBLE_FIELDS,
    VerifyError,
    expected_tensors,
    read_model_config,
    read_tokenizer_size,
    verify_checkpoint,
    write_sha256sums,
)
from trainer.export import export_checkpoint

REPO = Path(__file__).resolve().parents[1]
# Qwen/Qwen3-4B's config.json (public values; the fields the layout reads).
QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": True,
    "attention_bias": False,
}
SMALL = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 300,
}


def _without(config: dict, *fields: str) -> dict:
    return {key: value for key, value in config.items() if key not in fields}


# Each switch the layout honours, on a small config.
VARIANTS = {
    "qwen3 with attention biases": {**SMALL, "model_type": "qwen3", "attention_bias": True},
    "qwen3 without head_dim (transformers' default 128)": {
        **_without(SMALL, "head_dim"),
        "model_type": "qwen3",
    },
    "qwen3 with a null num_key_value_heads": {**SMALL, "model_type": "qwen3", "num_key_value_heads": None},
    "qwen2 (q/k/v biases, no q/k norms, derived head_dim)": {
        **_without(SMALL, "head_dim"),
        "model_type": "qwen2",
    },
    "qwen2 tied with its own head_dim": {**SMALL, "model_type": "qwen2", "tie_word_embeddings": True},
    "llama (derived head_dim)": {**_without(SMALL, "head_dim"), "model_type": "llama"},
    "llama with attention and MLP biases, tied": {
        **SMALL,
        "model_type": "llama",
        "attention_bias": True,
        "mlp_bias": True,
        "tie_word_embeddings": True,
    },
}


def _meta_layout(config: dict) -> list[tuple[str, tuple[tuple[int, ...], str]]]:
    """transformers' model of `config`, built on the meta device: [(name, (shape, "BF16"))] in
    named_parameters() order (a tied output layer is listed once, as the embedding)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(config)
    hf_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    assert all(param.is_floating_point() for param in model.parameters())
    return [(name, (tuple(param.shape), "BF16")) for name, param in model.named_parameters()]


@pytest.fixture(scope="module")
def kit(tmp_path_factory: pytest.TempPathFactory, tiny_kit) -> Path:
    return tiny_kit(tmp_path_factory.mktemp("kit") / "tiny")


@pytest.fixture(scope="module")
def served(kit: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("served") / "tiny-bf16"
    export_checkpoint(kit, out)
    return out


def test_layout_of_the_tiny_kit_is_transformers_layout(kit: Path, served: Path) -> None:
    config = json.loads((kit / "config.json").read_text())
    assert list(expected_tensors(config).items()) == _meta_layout(config)
    # The trimmed export: the row override gives the layout of a model with that vocabulary.
    trimmed = expected_tensors(config, vocab_size=4105)
    assert list(trimmed.items()) == _meta_layout({**config, "vocab_size": 4105})
    assert list(expected_tensors(json.loads((served / "config.json").read_text())).items()) == list(
        trimmed.items()
    )


def test_qwen3_4b_layout_is_transformers_layout_398_tied_399_untied() -> None:
    tied = expected_tensors(QWEN3_4B)
    assert len(tied) == 398 and "lm_head.weight" not in tied
    assert list(tied.items()) == _meta_layout(QWEN3_4B)

    untied_config = {**QWEN3_4B, "tie_word_embeddings": False}
    untied = expected_tensors(untied_config)
    assert len(untied) == 399 and untied["lm_head.weight"] == ((151936, 2560), "BF16")
    assert list(untied.items()) == _meta_layout(untied_config)
    # Megatron's padded rows, and another dtype, from the arguments alone.
    padded = expected_tensors(QWEN3_4B, vocab_size=152064, dtype="F32")
    assert padded["model.embed_tokens.weight"] == ((152064, 2560), "F32")
    assert {dtype for _, dtype in padded.values()} == {"F32"}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_layout_of_each_known_architecture_is_transformers_layout(variant: str) -> None:
    config = VARIANTS[variant]
    assert list(expected_tensors(config).items()) == _meta_layout(config)


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_omitted_fields_take_transformers_defaults(model_type: str) -> None:
    from transformers import AutoConfig

    # A config.json naming only its model_type: transformers fills in every default.
    assert list(expected_tensors({"model_type": model_type}).items()) == _meta_layout(
        {"model_type": model_type}
    )
    ours = read_model_config({"model_type": model_type})
    theirs = AutoConfig.for_model(model_type)
    for field in COMPATIBLE_FIELDS:
        want = getattr(theirs, field, None)
        if field == "head_dim" and want is None:  # Qwen2Config has none: the model derives it
            want = theirs.hidden_size // theirs.num_attention_heads
        assert getattr(ours, field) == want, field


def test_an_omitted_default_and_an_explicit_one_compare_equal() -> None:
    # What the served model's config is compared on: the model the engine builds, not the spelling.
    assert read_model_config(_without(QWEN3_4B, "head_dim", "attention_bias")) == read_model_config(QWEN3_4B)
    llama = {**_without(SMALL, "head_dim"), "model_type": "llama"}
    derived = _without(llama, "num_key_value_heads")
    assert read_model_config(derived) == read_model_config(
        {**llama, "num_key_value_heads": 4, "head_dim": 16}
    )
    assert read_model_config(derived) != read_model_config(llama)  # 2 KV heads is not the default


def test_an_unknown_architecture_is_named_with_the_known_ones(served: Path, tmp_path: Path) -> None:
    with pytest.raises(VerifyError, match=r"model_type 'mistral' is not an architecture this check knows"):
        expected_tensors({**SMALL, "model_type": "mistral"})
    copy = Path(shutil.copytree(served, tmp_path / "copy"))
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    write_sha256sums(copy)
    with pytest.raises(VerifyError, match=r"^config\.json: model_type 'mistral' .*\(llama, qwen2, qwen3\)$"):
        verify_checkpoint(copy)


def test_tokenizer_size_is_what_transformers_counts(served: Path) -> None:
    from transformers import AutoTokenizer

    size = read_tokenizer_size(served)
    assert size.tokens == len(AutoTokenizer.from_pretrained(served)) == 4105
    assert size.rows == 4105  # the kit's ids have no gaps


def test_verify_runs_without_torch_or_transformers(served: Path) -> None:
    script = (
        "import json, sys\n"
        "from core.checkpoint import verify_checkpoint\n"
        "summary = verify_checkpoint(sys.argv[1], expect_config=sys.argv[1])\n"
        "heavy = sorted({name.split('.')[0] for name in sys.modules} & {'torch', 'transformers'})\n"
        "assert not heavy, f'verify imported {heavy}'\n"
        "print(json.dumps(summary))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(served)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary == verify_checkpoint(served, expect_config=served)
    assert summary["tensors"] == 24 and summary["vocab_rows"] == 4105 and summary["dtype"] == "BF16"
