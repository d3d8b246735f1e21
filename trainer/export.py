"""Serving-format export of a trained Qwen3 checkpoint (DESIGN.md §5, seed 000).

The format and its check live in core/checkpoint.py (torch-free, so the worker sidecar can verify a
checkpoint before a hot reload); this module writes it:

- the source weights (an HF model folder, or safetensors/.bin state dict files with config.json)
  cast to BF16 and written as safetensors, sharded past `max_shard_size`;
- embedding rows trimmed to the tokenizer's vocabulary: a Megatron HF export pads the tied
  embedding (Qwen3-4B: 152,064 rows); the serving copy drops only the padding rows and keeps every
  real row byte-for-byte (it slices, never re-initialises or re-quantises); a stored copy of a tied
  `lm_head.weight` is dropped when it equals the embedding;
- config.json with `vocab_size` and `dtype` set, generation_config.json, the tokenizer files and
  chat template copied unchanged, `bcstack_export.json` (the row count and why), SHA256SUMS last.

Note on "the tokenizer's vocabulary": Qwen3-4B's tokenizer has 151,669 tokens (len(tokenizer))
while the released Qwen3-4B has 151,936 embedding rows, its own padding, and the seed's serving
copy keeps those 151,936 (152,064 trained rows minus Megatron's 128). So the target is the base
model's vocab_size when the tokenizer is restored from the base model's folder (which holds its
config.json), else the tokenizer's size (the tiny kit: 4,105 tokens, 4,224 rows), else what
`vocab_size` says; `bcstack_export.json` records the choice and verify checks against it.

An export is written into a hidden sibling folder, verified there, and renamed into place, so an
interrupted export never leaves a half checkpoint at `out_dir`.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from core.atomic import swap_in
from core.checkpoint import (
    CONFIG_FILE,
    EXPORT_FILE,
    GENERATION_CONFIG_FILE,
    REQUIRED_TOKENIZER_FILES,
    SUMS_FILE,
    TOKENIZER_FILES,
    WEIGHTS_INDEX_FILE,
    WEIGHTS_SHARD_PATTERN,
    VerifyError,
    chat_template_source,
    expected_tensors,
    layout_problem,
    read_model_config,
    read_tokenizer_size,
    verify_checkpoint,
    vocabulary_tensors,
    write_sha256sums,
)

DEFAULT_MAX_SHARD_SIZE = "5GB"
# safetensors' dtype names for torch dtypes (the names core.checkpoint checks headers against).
SAFETENSORS_DTYPES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class ExportError(ValueError):
    """The source checkpoint, tokenizer or output folder cannot give a serving-format export."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


def safetensors_dtype(dtype: torch.dtype) -> str:
    """The safetensors header name of a torch dtype ("BF16" for torch.bfloat16)."""
    return SAFETENSORS_DTYPES.get(dtype, str(dtype).removeprefix("torch."))


# ----------------------------------------------------------------------------------------------
# Export


def _source_weight_files(model_dir: Path) -> list[Path]:
    for index_name in (WEIGHTS_INDEX_FILE, "pytorch_model.bin.index.json"):
        index = model_dir / index_name
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            return [model_dir / name for name in sorted(set(weight_map.values()))]
    for pattern in ("*.safetensors", "pytorch_model*.bin"):
        found = sorted(model_dir.glob(pattern))
        if found:
            return found
    raise ExportError(f"{model_dir}: no weights (model.safetensors, *.safetensors or pytorch_model*.bin)")


def _read_source(model_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All tensors of the source checkpoint, floating ones cast to `dtype` one at a time."""
    tensors: dict[str, torch.Tensor] = {}

    def add(key: str, tensor: torch.Tensor, origin: Path) -> None:
        if key in tensors:
            raise ExportError(f"{origin.name}: tensor {key} appears in more than one weight file")
        tensors[key] = tensor.to(dtype) if tensor.is_floating_point() else tensor

    for path in _source_weight_files(model_dir):
        if path.suffix == ".safetensors":
            with safe_open(path, framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                    add(key, handle.get_tensor(key), path)
        else:
            for key, tensor in torch.load(path, map_location="cpu", weights_only=True, mmap=True).items():
                add(key, tensor, path)
    return tensors


def _check_out_dir(out_dir: Path, force: bool) -> None:
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise ExportError(f"{out_dir} exists and is not a folder")
    if any(out_dir.iterdir()) and not force:
        raise ExportError(f"{out_dir} is not empty; pass --force to replace it")


def _write_weights(folder: Path, tensors: dict[str, torch.Tensor], max_shard_size: int | str) -> list[str]:
    from huggingface_hub import split_torch_state_dict_into_shards

    split = split_torch_state_dict_into_shards(
        tensors, filename_pattern=WEIGHTS_SHARD_PATTERN, max_shard_size=max_shard_size
    )
    for filename, names in split.filename_to_tensors.items():
        save_file({name: tensors[name] for name in names}, folder / filename, metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": dict(sorted(split.tensor_to_filename.items()))}
        (folder / WEIGHTS_INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return list(split.filename_to_tensors)


def _write_export(
    staging: Path,
    model_dir: Path,
    tokenizer_dir: Path,
    vocab_size: int | None,
    dtype: torch.dtype,
    max_shard_size: int | str,
    step: Callable[[str], None],
) -> dict[str, Any]:
    from transformers import AutoConfig

    step("Reading the config and tokenizer")
    if not (model_dir / CONFIG_FILE).is_file():
        raise ExportError(f"{model_dir}: no {CONFIG_FILE}")
    config = AutoConfig.from_pretrained(model_dir)
    try:
        layout_config = read_model_config(config.to_dict(), where=str(model_dir / CONFIG_FILE))
    except VerifyError as error:  # an architecture the serving-format check does not know
        raise ExportError(str(error)) from None
    for name in REQUIRED_TOKENIZER_FILES:
        if not (tokenizer_dir / name).is_file():
            raise ExportError(f"{tokenizer_dir}: no {name} (the tokenizer to restore)")
    tokenizer_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    if chat_template_source(tokenizer_dir, tokenizer_config) is None:
        raise ExportError(f"{tokenizer_dir}: no chat template (tokenizer_config.json or chat_template.jinja)")
    try:
        needed = read_tokenizer_size(tokenizer_dir).rows
    except VerifyError as error:
        raise ExportError(f"{tokenizer_dir}: {error}") from None
    rows, rows_from = _target_rows(vocab_size, needed, model_dir, tokenizer_dir)
    if rows < needed:
        raise ExportError(f"vocab_size {rows} is smaller than the tokenizer's {needed} tokens")

    step(f"Reading the weights and casting to {safetensors_dtype(dtype)}")
    tensors = _read_source(model_dir, dtype)
    vocab_names = vocabulary_tensors(layout_config)
    embedding_name = vocab_names[0]
    if embedding_name not in tensors:
        raise ExportError(f"{model_dir}: no {embedding_name} in the weights")
    source_rows = tensors[embedding_name].shape[0]
    if rows > source_rows:
        raise ExportError(f"cannot trim {embedding_name} to {rows} rows: the source has only {source_rows}")
    dropped_lm_head = None
    if layout_config.tie_word_embeddings:
        # A Megatron export may store the tied output layer as well; it must be the same matrix.
        for name in [name for name in tensors if name not in vocab_names and name.startswith("lm_head.")]:
            if not torch.equal(tensors[name], tensors[embedding_name]):
                raise ExportError(f"{name} differs from {embedding_name} but config.json ties them")
            del tensors[name]
            dropped_lm_head = name

    step(f"Trimming the vocabulary rows {source_rows:,} → {rows:,}")
    for name in vocab_names:
        if name in tensors and tensors[name].shape[0] != rows:
            # A slice of the leading rows: every kept row is the source row, byte for byte.
            tensors[name] = tensors[name][:rows].clone()
    config.vocab_size = rows
    config.dtype = dtype
    expected = expected_tensors(layout_config, vocab_size=rows, dtype=safetensors_dtype(dtype))
    problem = layout_problem(
        {name: (tuple(tensor.shape), safetensors_dtype(tensor.dtype)) for name, tensor in tensors.items()},
        expected,
        {name: model_dir.name for name in tensors},
    )
    if problem is not None:
        raise ExportError(f"source checkpoint: {problem}")
    ordered = {name: tensors[name].contiguous() for name in expected}

    step("Writing the weights")
    weight_files = _write_weights(staging, ordered, max_shard_size)
    del ordered, tensors

    step("Writing the config and restoring the tokenizer files")
    config.save_pretrained(staging)
    generation_source = next(
        (folder for folder in (model_dir, tokenizer_dir) if (folder / GENERATION_CONFIG_FILE).is_file()), None
    )
    if generation_source is not None:
        shutil.copyfile(generation_source / GENERATION_CONFIG_FILE, staging / GENERATION_CONFIG_FILE)
    tokenizer_files = [name for name in TOKENIZER_FILES if (tokenizer_dir / name).is_file()]
    for name in tokenizer_files:
        shutil.copyfile(tokenizer_dir / name, staging / name)
    for path in staging.iterdir():
        path.chmod(0o644)  # safetensors leaves files owner-only; a serving container may be another user

    manifest = {"vocab_rows": rows, "vocab_rows_from": rows_from, "source_vocab_rows": source_rows}
    (staging / EXPORT_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    (staging / EXPORT_FILE).chmod(0o644)

    step(f"Writing {SUMS_FILE}")
    write_sha256sums(staging)
    return {
        "source_vocab_rows": source_rows,
        "weight_files": weight_files,
        "tokenizer_files": tokenizer_files,
        "generation_config": str(generation_source) if generation_source is not None else None,
        "dropped_tied_lm_head": dropped_lm_head,
    }


def _target_rows(
    vocab_size: int | None, needed: int, model_dir: Path, tokenizer_dir: Path
) -> tuple[int, str]:
    """The embedding rows to keep, and where that number comes from.

    Seed 000/001: the trained checkpoint has 152,064 rows (Megatron pads the vocabulary); the
    serving copy drops the 128 padding rows and keeps the base Qwen3-4B's 151,936, every one byte
    for byte, while its tokenizer (restored from the base) has 151,669 tokens. So when the
    tokenizer comes from another folder holding the base model's config.json, its vocab_size is
    the target; otherwise (the tiny kit: tokenizer and model in one folder) the tokenizer's size.
    An explicit `vocab_size` wins.
    """
    if vocab_size is not None:
        return vocab_size, "--vocab-size"
    base = tokenizer_dir / CONFIG_FILE
    if tokenizer_dir.resolve() != model_dir.resolve() and base.is_file():
        try:
            base_rows = int(json.loads(base.read_text(encoding="utf-8"))["vocab_size"])
        except (ValueError, KeyError, TypeError):
            base_rows = 0
        if base_rows >= needed:
            return base_rows, f"the base model's {base}"
    return needed, "the tokenizer"


def export_checkpoint(
    model_dir: Path,
    out_dir: Path,
    *,
    tokenizer_dir: Path | None = None,
    vocab_size: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    force: bool = False,
    step: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Write `model_dir` (an HF model folder, or safetensors/.bin state dict files with config.json)
    to `out_dir` in the serving format, verify it, and return verify's summary plus export details.

    `tokenizer_dir` (default `model_dir`) is the pinned tokenizer whose files are restored and whose
    size sets the embedding rows; `vocab_size` overrides that row count (for an engine that keeps
    padding rows). `out_dir` must be missing or empty unless `force`. Raises ExportError for a bad
    source or output folder and VerifyError if the written checkpoint fails verification; in every
    failure nothing is left at `out_dir` (a replaced checkpoint stays as it was).
    """
    step = step or (lambda _description: None)
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir is not None else model_dir
    if out_dir.resolve() in (model_dir.resolve(), tokenizer_dir.resolve()):
        raise ExportError(f"{out_dir}: the export must go to a new folder, not the source")
    _check_out_dir(out_dir, force)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        details = _write_export(staging, model_dir, tokenizer_dir, vocab_size, dtype, max_shard_size, step)
        step("Verifying the export")
        summary = verify_checkpoint(staging, vocab_size=vocab_size, dtype=safetensors_dtype(dtype))
        _check_out_dir(out_dir, force)  # someone may have filled it while we exported
        swap_in(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {
        **summary,
        **details,
        "path": str(out_dir),
        "source": str(model_dir),
        "tokenizer_source": str(tokenizer_dir),
    }
