"""The serving-format checkpoint and its check (DESIGN.md §5, seed 000); no torch, no transformers.

The serving format is what the engine loads and what gets published (trainer/export.py writes it):

- BF16 safetensors (`model.safetensors`, or `model-0000i-of-0000n.safetensors` shards with
  `model.safetensors.index.json`), `config.json` with `vocab_size` and `dtype` set to match,
  `generation_config.json` when one exists;
- embedding rows equal to the vocabulary the export chose (recorded in `bcstack_export.json`);
- exactly the tensors a model of that config has, each with its shape and dtype (398 for Qwen3-4B
  with tied embeddings: 36 layers x 11 + embedding + final norm; a tied `lm_head.weight` is not
  stored);
- the tokenizer files and chat template of the pinned tokenizer folder;
- `SHA256SUMS` (`sha256sum -c` format), written last, covering every file above.

The expected layout comes from config.json alone (`core.model_layout`, which says why it is
computed by hand: the CPU worker sidecar runs this check and must not import torch).

Headers are read with `safetensors.safe_open(framework="numpy")`, which validates the header
against the file and never imports torch; the tokenizer's size comes from the `tokenizers` package.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open
from tokenizers import Tokenizer

from core.model_layout import (  # noqa: F401 - re-exported: the layout is part of the check's API
    ARCHITECTURES,
    CONFIG_FILE,
    Architecture,
    ModelConfig,
    TensorSpec,
    VerifyError,
    expected_tensors,
    layout_problem,
    read_json,
    read_model_config,
    vocabulary_tensors,
)

SUMS_FILE = "SHA256SUMS"
# What the export kept and why, listed in SHA256SUMS: verify reads the intended row count from it.
EXPORT_FILE = "bcstack_export.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_SHARD_PATTERN = "model{suffix}.safetensors"  # huggingface_hub's -0000i-of-0000n suffix
# Copied from the tokenizer folder when present; the first two are required.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
REQUIRED_TOKENIZER_FILES = TOKENIZER_FILES[:2]
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
# Files an engine could load weights from; one not covered by SHA256SUMS fails verification.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".npz")
# What must agree with the served model's config for the engine to load this checkpoint.
COMPATIBLE_FIELDS = (
    "model_type",
    "architectures",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
)
# Bytes per element of the safetensors dtypes a checkpoint may hold (header strings, as
# safe_open's get_dtype reports them).
DTYPE_BYTES = {
    "BF16": 2,
    "F16": 2,
    "F32": 4,
    "F64": 8,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
_SUMS_LINE = re.compile(r"^([0-9a-f]{64}) [ *](.+)$")


# ----------------------------------------------------------------------------------------------
# Files and hashes


def sha256_file(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _is_hidden(relative: Path) -> bool:
    # Hub downloads keep `.cache/` and `.gitattributes` beside the files; they are not the model.
    return any(part.startswith(".") for part in relative.parts)


def checkpoint_files(folder: Path) -> list[str]:
    """Every regular file under `folder` except SHA256SUMS and hidden ones, as sorted POSIX paths."""
    found = []
    for path in folder.rglob("*"):
        relative = path.relative_to(folder)
        if path.is_file() and relative.as_posix() != SUMS_FILE and not _is_hidden(relative):
            found.append(relative.as_posix())
    return sorted(found)


def write_sha256sums(folder: Path) -> Path:
    """Write `folder/SHA256SUMS` over every other file, atomically (temp file, fsync, rename)."""
    lines = "".join(f"{sha256_file(folder / name)}  {name}\n" for name in checkpoint_files(folder))
    target = folder / SUMS_FILE
    temporary = folder / f".{SUMS_FILE}.tmp"
    with temporary.open("w", encoding="utf-8", newline="\n") as handle:
        handle.write(lines)
        handle.flush()
        os.fsync(handle.fileno())
    temporary.chmod(0o644)
    os.replace(temporary, target)
    return target


def read_sha256sums(folder: Path) -> dict[str, str]:
    """SHA256SUMS as {relative path: hex digest}; VerifyError when missing or malformed."""
    path = folder / SUMS_FILE
    if not path.is_file():
        raise VerifyError(f"{SUMS_FILE}: missing in {folder}")
    sums: dict[str, str] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        match = _SUMS_LINE.match(line)
        relative = Path(match.group(2)) if match else None
        if relative is None or relative.is_absolute() or ".." in relative.parts:
            raise VerifyError(
                f"{SUMS_FILE} line {number}: expected '<sha256>  <relative path>', got {line!r}"
            )
        sums[relative.as_posix()] = match.group(1)
    return sums


# ----------------------------------------------------------------------------------------------
# The tokenizer


@dataclass(frozen=True)
class TokenizerSize:
    tokens: int  # the vocabulary with added tokens (transformers' len(tokenizer))
    rows: int  # embedding rows it needs: tokens, or the largest id + 1 if the ids have gaps


def read_tokenizer_size(folder: Path) -> TokenizerSize:
    """The size of `folder/tokenizer.json`; VerifyError when it does not load."""
    try:
        vocab = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab(with_added_tokens=True)
    except Exception as error:  # tokenizers raises plain Exception for a bad file
        raise VerifyError(f"tokenizer: does not load ({error})") from None
    return TokenizerSize(len(vocab), max(len(vocab), max(vocab.values(), default=-1) + 1))


def chat_template_source(folder: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    """The file the chat template comes from, or None when there is none."""
    for name in CHAT_TEMPLATE_FILES:
        if (folder / name).is_file():
            return name
    if tokenizer_config.get("chat_template"):
        return "tokenizer_config.json"
    return None


# ----------------------------------------------------------------------------------------------
# Verification


def check_hashes(folder: Path) -> tuple[dict[str, str], list[str]]:
    """Every file listed in `folder`'s SHA256SUMS present with its hash (VerifyError on the first
    that is not, or on a weight file not listed); (the sums, the other files not listed)."""
    sums = read_sha256sums(folder)
    for name, digest in sums.items():
        path = folder / name
        if not path.is_file():
            raise VerifyError(f"{name}: listed in {SUMS_FILE} but missing")
        if sha256_file(path) != digest:
            raise VerifyError(f"{name}: SHA256 mismatch (changed since {SUMS_FILE} was written)")
    unlisted = [name for name in checkpoint_files(folder) if name not in sums]
    for name in unlisted:
        if name.endswith((*WEIGHT_SUFFIXES, ".index.json")):
            raise VerifyError(f"{name}: weight file not listed in {SUMS_FILE}")
    return sums, unlisted


def _require_listed(name: str, folder: Path, sums: Mapping[str, str], what: str) -> Path:
    path = folder / name
    if not path.is_file():
        raise VerifyError(f"{name}: missing ({what})")
    if name not in sums:
        raise VerifyError(f"{name}: not listed in {SUMS_FILE}")
    return path


def _weight_files(folder: Path, sums: Mapping[str, str]) -> tuple[list[str], dict[str, str] | None]:
    """The weight files the engine will load, and the index's weight map when sharded."""
    on_disk = [name for name in checkpoint_files(folder) if name.endswith(".safetensors")]
    if (folder / WEIGHTS_INDEX_FILE).is_file():
        index_path = _require_listed(WEIGHTS_INDEX_FILE, folder, sums, "weight index")
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError) as error:
            raise VerifyError(f"{WEIGHTS_INDEX_FILE}: unreadable ({error})") from None
        shards = sorted(set(weight_map.values()))
        for name in on_disk:
            if name not in shards:
                raise VerifyError(f"{name}: weight file not referenced by {WEIGHTS_INDEX_FILE}")
        for name in shards:
            _require_listed(name, folder, sums, f"shard named in {WEIGHTS_INDEX_FILE}")
        return shards, weight_map
    _require_listed(WEIGHTS_FILE, folder, sums, "weights")
    for name in on_disk:
        if name != WEIGHTS_FILE:
            raise VerifyError(f"{name}: extra weight file beside {WEIGHTS_FILE} (no index)")
    return [WEIGHTS_FILE], None


def _read_layout(
    folder: Path, files: list[str], weight_map: Mapping[str, str] | None
) -> tuple[dict[str, TensorSpec], dict[str, str], int]:
    """Tensor name -> (shape, dtype) from the safetensors headers, where each lives, payload bytes."""
    layout: dict[str, TensorSpec] = {}
    where: dict[str, str] = {}
    payload = 0
    for name in files:
        try:
            # safe_open checks the header against the file: offsets contiguous, payload length exact.
            # framework="numpy" only names the type get_tensor would return; headers need no torch.
            with safe_open(folder / name, framework="numpy") as handle:
                for key in handle.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                    if key in layout:
                        raise VerifyError(f"{name}: tensor {key} also stored in {where[key]}")
                    if weight_map is not None and weight_map.get(key) != name:
                        raise VerifyError(
                            f"{name}: holds {key}, which {WEIGHTS_INDEX_FILE} maps to {weight_map.get(key)}"
                        )
                    tensor_slice = handle.get_slice(key)
                    dtype = tensor_slice.get_dtype()
                    shape = tuple(tensor_slice.get_shape())
                    if dtype not in DTYPE_BYTES:
                        raise VerifyError(f"{name}: tensor {key} has unsupported dtype {dtype}")
                    layout[key] = (shape, dtype)
                    where[key] = name
                    payload += math.prod(shape) * DTYPE_BYTES[dtype]
        except VerifyError:
            raise
        except Exception as error:  # safetensors raises its own error types for a bad header
            raise VerifyError(f"{name}: not a readable safetensors file ({error})") from None
    if weight_map is not None:
        for key, name in weight_map.items():
            if key not in layout:
                raise VerifyError(f"{WEIGHTS_INDEX_FILE}: maps {key} to {name}, which does not hold it")
    return layout, where, payload


def _load_expect_config(path: Path) -> ModelConfig:
    path = Path(path)
    if path.is_dir():
        path = path / CONFIG_FILE
    if not path.is_file():
        raise VerifyError(f"expect-config {path}: no such file")
    where = f"expect-config {path}"
    return read_model_config(read_json(path, where), where)


def verify_checkpoint(
    path: Path,
    *,
    expect_config: Path | None = None,
    vocab_size: int | None = None,
    dtype: str = "BF16",
) -> dict[str, Any]:
    """Check that `path` is a complete, untouched serving-format checkpoint; return a summary.

    In order: SHA256SUMS present and every listed file's hash (no unlisted weight file); config,
    tokenizer files and chat template present and listed; weight files readable (with a
    consistent index when sharded); embedding rows == config vocab_size == the expected row count
    (`vocab_size`, else `expect_config`'s vocab_size, else the row count the export declared in
    bcstack_export.json, else the tokenizer's size); every tensor's key, shape and dtype (`dtype`,
    a safetensors name, BF16) as `expected_tensors(config)`; with `expect_config` (the served
    model's config.json, or its folder) the architecture fields in COMPATIBLE_FIELDS equal.
    Raises VerifyError with the first problem.
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not a safetensors dtype ({', '.join(DTYPE_BYTES)})")
    folder = Path(path)
    if not folder.is_dir():
        raise VerifyError(f"{folder}: not a folder")
    sums, unlisted = check_hashes(folder)

    _require_listed(CONFIG_FILE, folder, sums, "model config")
    config = read_model_config(read_json(folder / CONFIG_FILE, CONFIG_FILE))

    for name in REQUIRED_TOKENIZER_FILES:
        _require_listed(name, folder, sums, "tokenizer file")
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            _require_listed(name, folder, sums, "tokenizer file")
    tokenizer_config = read_json(folder / "tokenizer_config.json", "tokenizer_config.json")
    if not isinstance(tokenizer_config, Mapping):
        raise VerifyError("tokenizer_config.json: unreadable (not a JSON object)")
    chat_template = chat_template_source(folder, tokenizer_config)
    if chat_template is None:
        raise VerifyError(
            "no chat template: tokenizer_config.json has no chat_template and there is no "
            + " or ".join(CHAT_TEMPLATE_FILES)
        )
    tokenizer = read_tokenizer_size(folder)

    files, weight_map = _weight_files(folder, sums)
    actual, where, payload = _read_layout(folder, files, weight_map)

    served = _load_expect_config(expect_config) if expect_config is not None else None
    declared = None
    if (folder / EXPORT_FILE).is_file():
        _require_listed(EXPORT_FILE, folder, sums, "export manifest")
        try:
            declared = int(json.loads((folder / EXPORT_FILE).read_text(encoding="utf-8"))["vocab_rows"])
        except (ValueError, KeyError, TypeError) as error:
            raise VerifyError(f"{EXPORT_FILE}: unreadable ({error})") from None
    if config.vocab_size < tokenizer.rows:
        # Said before any row count: the engine could not even build this model (the special
        # token ids fall outside its embedding).
        raise VerifyError(
            f"vocabulary: config.json vocab_size {config.vocab_size} is smaller than the tokenizer's "
            f"{tokenizer.rows} tokens"
        )
    expected = expected_tensors(config, dtype=dtype)
    for name in vocabulary_tensors(config):
        if name not in actual:
            raise VerifyError(f"missing tensor {name} (the vocabulary embedding)")
        rows = actual[name][0][0]
        if rows != config.vocab_size:
            raise VerifyError(
                f"{where[name]}: {name} has {rows} rows but config.json vocab_size is {config.vocab_size}"
            )
        if vocab_size is not None and rows != vocab_size:
            raise VerifyError(f"vocabulary: {name} has {rows} rows, {vocab_size} were requested")
        if vocab_size is None and served is not None and rows != served.vocab_size:
            raise VerifyError(
                f"vocabulary: {name} has {rows} rows, "
                f"the served model's config has vocab_size {served.vocab_size}"
            )
        if vocab_size is None and served is None and declared is not None and rows != declared:
            raise VerifyError(f"vocabulary: {name} has {rows} rows, {EXPORT_FILE} declares {declared}")
        if vocab_size is None and served is None and declared is None and rows != tokenizer.rows:
            raise VerifyError(
                f"vocabulary: {name} has {rows} rows but the tokenizer has {tokenizer.rows} tokens "
                "(pass --vocab-size or --expect-config if the engine keeps padding rows)"
            )
    problem = layout_problem(actual, expected, where)
    if problem is not None:
        raise VerifyError(problem)

    if served is not None:
        for field in COMPATIBLE_FIELDS:
            ours, theirs = getattr(config, field), getattr(served, field)
            if ours != theirs:
                raise VerifyError(f"{CONFIG_FILE}: {field} is {ours}, the served model's config has {theirs}")

    return {
        "path": str(folder),
        "architecture": config.architecture,
        "model_type": config.model_type,
        "tensors": len(actual),
        "parameters": sum(math.prod(shape) for shape, _ in actual.values()),
        "dtype": dtype,
        "vocab_rows": config.vocab_size,
        "tokenizer_tokens": tokenizer.tokens,
        "tie_word_embeddings": config.tie_word_embeddings,
        "weight_files": files,
        "weight_bytes": payload,
        "chat_template": chat_template,
        "hashed_files": len(sums),
        "unlisted_files": unlisted,
        "expect_config": str(expect_config) if expect_config is not None else None,
    }
