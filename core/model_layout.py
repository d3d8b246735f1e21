"""A model's tensor layout from its config.json alone: no torch, no transformers (DESIGN.md §5).

`expected_tensors(config)` lists every tensor a serving checkpoint of that config holds, name ->
(shape, safetensors dtype), in transformers' named_parameters() order; `core.checkpoint` compares
it with the safetensors headers of an export.

Why by hand instead of building the model on torch's meta device: the check runs in the CPU worker
sidecar (before every hot reload, and in the checkpoint watcher), which must not pull in torch and
transformers for it (pyproject.toml's import-linter contracts). The price is a fixed set of
architectures (`ARCHITECTURES`: the Qwen3 family, and Qwen2 and Llama, which differ only in biases
and q/k norms). tests/test_checkpoint_format.py keeps it honest against transformers' meta-device
model (names, order and shapes) for the tiny kit, Qwen3-4B and each architecture's defaults.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
TensorSpec = tuple[tuple[int, ...], str]  # (shape, safetensors dtype)


class VerifyError(ValueError):
    """A checkpoint is not in the serving format; the message is the first problem, on one line."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))  # library errors quoted inside may span lines


# ----------------------------------------------------------------------------------------------
# The model config, from config.json alone


@dataclass(frozen=True)
class Architecture:
    """What one model_type's tensors depend on beyond the sizes they all share.

    `defaults` are transformers' config defaults for the fields the layout reads, taken by a field
    missing from config.json; None (the default, or an explicit null) is derived as transformers
    derives it: num_key_value_heads = num_attention_heads, head_dim = hidden_size //
    num_attention_heads. A bias is either always there (True), never (False), or switched by the
    config field named.
    """

    causal_lm: str  # the transformers class, named in the summary when config.json names none
    defaults: Mapping[str, Any]
    qkv_bias: bool | str
    o_bias: bool | str
    mlp_bias: bool | str
    qk_norm: bool  # RMSNorm over head_dim on the queries and keys (Qwen3)


# transformers 5's defaults (Qwen3Config, Qwen2Config, LlamaConfig); Qwen2Config has no head_dim.
_QWEN_DEFAULTS = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "intermediate_size": 22016,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
}
ARCHITECTURES: dict[str, Architecture] = {
    "qwen3": Architecture(
        "Qwen3ForCausalLM",
        {**_QWEN_DEFAULTS, "head_dim": 128, "attention_bias": False},
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        mlp_bias=False,
        qk_norm=True,
    ),
    "qwen2": Architecture(
        "Qwen2ForCausalLM",
        {**_QWEN_DEFAULTS, "head_dim": None},
        qkv_bias=True,
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
    ),
    "llama": Architecture(
        "LlamaForCausalLM",
        {
            **_QWEN_DEFAULTS,
            "num_key_value_heads": None,
            "head_dim": None,
            "intermediate_size": 11008,
            "vocab_size": 32000,
            "attention_bias": False,
            "mlp_bias": False,
        },
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        mlp_bias="mlp_bias",
        qk_norm=False,
    ),
}


@dataclass(frozen=True)
class ModelConfig:
    """The fields of a config.json that fix the tensor layout, defaults filled in.

    An omitted default and an explicit one give equal ModelConfigs, so COMPATIBLE_FIELDS compare
    what the engine would build, not how the file spells it.
    """

    model_type: str
    architectures: list[str] | None
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool

    @property
    def architecture(self) -> str:
        return ",".join(self.architectures or [ARCHITECTURES[self.model_type].causal_lm])


def read_model_config(fields: Mapping[str, Any], where: str = CONFIG_FILE) -> ModelConfig:
    """config.json's contents as a ModelConfig; VerifyError (naming `where`) when it is not one."""
    if not isinstance(fields, Mapping):
        raise VerifyError(f"{where}: unreadable (not a JSON object)")
    model_type = fields.get("model_type")
    arch = ARCHITECTURES.get(model_type) if isinstance(model_type, str) else None
    if arch is None:
        raise VerifyError(
            f"{where}: model_type {model_type!r} is not an architecture this check knows "
            f"({', '.join(sorted(ARCHITECTURES))})"
        )

    def value(name: str) -> Any:
        return fields[name] if name in fields else arch.defaults.get(name)

    def size(name: str, given: Any) -> int:
        if isinstance(given, bool) or not isinstance(given, int) or given <= 0:
            raise VerifyError(f"{where}: unreadable ({name} must be a positive integer, got {given!r})")
        return given

    def flag(switch: bool | str) -> bool:
        if isinstance(switch, bool):
            return switch
        given = value(switch)
        if not isinstance(given, bool):
            raise VerifyError(f"{where}: unreadable ({switch} must be true or false, got {given!r})")
        return given

    sizes = {
        name: size(name, value(name))
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    }
    heads = sizes["num_attention_heads"]
    kv_heads = value("num_key_value_heads")
    head_dim = value("head_dim")
    if head_dim is None and sizes["hidden_size"] % heads:
        raise VerifyError(
            f"{where}: unreadable (hidden_size ({sizes['hidden_size']}) is not a multiple of "
            f"num_attention_heads ({heads}))"
        )
    architectures = fields.get("architectures")
    if architectures is not None and (
        not isinstance(architectures, list) or not all(isinstance(name, str) for name in architectures)
    ):
        raise VerifyError(f"{where}: unreadable (architectures must be a list of names)")
    layer_types = fields.get("layer_types")
    if layer_types is not None and (
        not isinstance(layer_types, list) or len(layer_types) != sizes["num_hidden_layers"]
    ):
        count = len(layer_types) if isinstance(layer_types, list) else layer_types
        raise VerifyError(
            f"{where}: unreadable (num_hidden_layers ({sizes['num_hidden_layers']}) must equal the "
            f"number of layer_types ({count}))"
        )
    return ModelConfig(
        model_type=model_type,
        architectures=architectures,
        **sizes,
        num_key_value_heads=size("num_key_value_heads", heads if kv_heads is None else kv_heads),
        head_dim=size("head_dim", sizes["hidden_size"] // heads if head_dim is None else head_dim),
        vocab_size=size("vocab_size", value("vocab_size")),
        tie_word_embeddings=flag("tie_word_embeddings"),
        qkv_bias=flag(arch.qkv_bias),
        o_bias=flag(arch.o_bias),
        mlp_bias=flag(arch.mlp_bias),
        qk_norm=arch.qk_norm,
    )


def read_json(path: Path, where: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise VerifyError(f"{where}: unreadable ({error})") from None


# ----------------------------------------------------------------------------------------------
# The expected layout


def _as_model_config(config: ModelConfig | Mapping[str, Any]) -> ModelConfig:
    return config if isinstance(config, ModelConfig) else read_model_config(config)


def expected_tensors(
    config: ModelConfig | Mapping[str, Any], vocab_size: int | None = None, dtype: str = "BF16"
) -> dict[str, TensorSpec]:
    """Every tensor a serving checkpoint of `config` holds, name -> (shape, dtype), in the order
    transformers' named_parameters() lists them (the order the export writes).

    `config` is config.json's contents (or a ModelConfig); `vocab_size` overrides its embedding row
    count (the tokenizer's vocabulary); `dtype` is a safetensors dtype name. Tied output
    embeddings are not listed (Qwen3-4B: 398 tensors; untied: 399). An architecture not in
    ARCHITECTURES is a VerifyError.
    """
    config = _as_model_config(config)
    rows = config.vocab_size if vocab_size is None else vocab_size
    hidden, head_dim = config.hidden_size, config.head_dim
    q_size, kv_size = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    layer: list[tuple[str, tuple[int, ...]]] = []

    def linear(name: str, out_features: int, in_features: int, bias: bool) -> None:
        layer.append((f"{name}.weight", (out_features, in_features)))
        if bias:
            layer.append((f"{name}.bias", (out_features,)))

    # One decoder layer, in module registration order: attention, MLP, then the two norms.
    linear("self_attn.q_proj", q_size, hidden, config.qkv_bias)
    linear("self_attn.k_proj", kv_size, hidden, config.qkv_bias)
    linear("self_attn.v_proj", kv_size, hidden, config.qkv_bias)
    linear("self_attn.o_proj", hidden, q_size, config.o_bias)
    if config.qk_norm:
        layer += [("self_attn.q_norm.weight", (head_dim,)), ("self_attn.k_norm.weight", (head_dim,))]
    linear("mlp.gate_proj", config.intermediate_size, hidden, config.mlp_bias)
    linear("mlp.up_proj", config.intermediate_size, hidden, config.mlp_bias)
    linear("mlp.down_proj", hidden, config.intermediate_size, config.mlp_bias)
    layer += [("input_layernorm.weight", (hidden,)), ("post_attention_layernorm.weight", (hidden,))]

    expected = {"model.embed_tokens.weight": ((rows, hidden), dtype)}
    for index in range(config.num_hidden_layers):
        expected.update({f"model.layers.{index}.{name}": (shape, dtype) for name, shape in layer})
    expected["model.norm.weight"] = ((hidden,), dtype)
    if not config.tie_word_embeddings:
        expected["lm_head.weight"] = ((rows, hidden), dtype)
    return expected


def vocabulary_tensors(config: ModelConfig | Mapping[str, Any]) -> list[str]:
    """The vocabulary-indexed tensors: the embedding, and the output layer unless tied to it."""
    config = _as_model_config(config)
    return ["model.embed_tokens.weight"] + ([] if config.tie_word_embeddings else ["lm_head.weight"])


def layout_problem(
    actual: Mapping[str, TensorSpec], expected: Mapping[str, TensorSpec], where: Mapping[str, str]
) -> str | None:
    """The first difference between two layouts, as a one-line message; None when equal."""
    for name, (shape, dtype) in expected.items():
        if name not in actual:
            return f"missing tensor {name} (expected shape {list(shape)})"
        got_shape, got_dtype = actual[name]
        if tuple(got_shape) != tuple(shape):
            return (
                f"{where.get(name, '?')}: tensor {name} has shape {list(got_shape)}, expected {list(shape)}"
            )
        if got_dtype != dtype:
            return f"{where.get(name, '?')}: tensor {name} is {got_dtype}, expected {dtype}"
    for name in actual:
        if name not in expected:
            return f"{where.get(name, '?')}: unexpected tensor {name} (not part of {len(expected)} expected)"
    return None
