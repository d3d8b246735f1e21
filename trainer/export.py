"""Serving-format export of a trained Qwen3 checkpoint, and its verification (DESIGN.md §5, seed 000).

The serving format is what the engine loads and what gets published:

- BF16 safetensors (`model.safetensors`, or `model-0000i-of-0000n.safetensors` shards with
  `model.safetensors.index.json` when larger than `max_shard_size`), `config.json` with
  `vocab_size` and `dtype` set to match, `generation_config.json` when one exists;
- embedding rows trimmed to the tokenizer's vocabulary: a Megatron HF export pads the tied
  embedding (Qwen3-4B: 152,064 rows); the serving copy drops only the padding rows and keeps every
  real row byte-for-byte (it slices, never re-initialises or re-quantises);
- exactly the tensors a Qwen3 model of that config has, each with its shape and dtype (398 for
  Qwen3-4B with tied embeddings: 36 layers x 11 + embedding + final norm; a tied `lm_head.weight`
  is not stored);
- the tokenizer files and chat template copied unchanged from the pinned tokenizer folder;
- `SHA256SUMS` (`sha256sum -c` format), written last, covering every file above.

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

import hashlib
import json
import math
import os
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from core.atomic import swap_in

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

SUMS_FILE = "SHA256SUMS"
CONFIG_FILE = "config.json"
# What the export kept and why, listed in SHA256SUMS: verify reads the intended row count from it.
EXPORT_FILE = "bcstack_export.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_SHARD_PATTERN = "model{suffix}.safetensors"  # huggingface_hub's -0000i-of-0000n suffix
DEFAULT_MAX_SHARD_SIZE = "5GB"
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
_SUMS_LINE = re.compile(r"^([0-9a-f]{64}) [ *](.+)$")
# safetensors' dtype names for torch dtypes (header strings as safe_open's get_dtype reports them).
_SAFETENSORS_DTYPES = {
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

TensorSpec = tuple[tuple[int, ...], torch.dtype]


class VerifyError(ValueError):
    """A checkpoint is not in the serving format; the message is the first problem, on one line."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))  # library errors quoted inside may span lines


class ExportError(ValueError):
    """The source checkpoint, tokenizer or output folder cannot give a serving-format export."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


# ----------------------------------------------------------------------------------------------
# The expected layout, from the config alone


def _meta_model(config: PretrainedConfig) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        return AutoModelForCausalLM.from_config(config)


def _as_config(config: PretrainedConfig | Mapping[str, Any]) -> PretrainedConfig:
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        return config
    fields = dict(config)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def _layout(
    config: PretrainedConfig | Mapping[str, Any], vocab_size: int | None, dtype: torch.dtype
) -> tuple[dict[str, TensorSpec], list[str]]:
    """Expected tensors and the names of the vocabulary-indexed ones (embedding, untied lm_head)."""
    config = _as_config(config)
    if vocab_size is not None:
        config = config.__class__.from_dict({**config.to_dict(), "vocab_size": vocab_size})
    model = _meta_model(config)
    # named_parameters() lists a tied parameter once, under its first name (the embedding), which
    # is the key set save_pretrained writes.
    names = {id(param): name for name, param in model.named_parameters()}
    expected = {
        name: (tuple(param.shape), dtype if param.is_floating_point() else param.dtype)
        for name, param in model.named_parameters()
    }
    vocab_names = [names[id(model.get_input_embeddings().weight)]]
    output = model.get_output_embeddings()
    if output is not None and names[id(output.weight)] not in vocab_names:
        vocab_names.append(names[id(output.weight)])
    return expected, vocab_names


def expected_tensors(
    config: PretrainedConfig | Mapping[str, Any],
    vocab_size: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, TensorSpec]:
    """Every tensor a serving checkpoint of `config` holds: name -> (shape, dtype).

    `config` is a transformers config (or config.json's contents); `vocab_size` overrides its
    embedding row count (the tokenizer's vocabulary). Built on the meta device, so a 4B config
    costs no memory. Tied output embeddings are not listed (Qwen3-4B: 398 tensors; untied: 399).
    """
    return _layout(config, vocab_size, dtype)[0]


def _first_layout_problem(
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
            return (
                f"{where.get(name, '?')}: tensor {name} is {_dtype_name(got_dtype)}, "
                f"expected {_dtype_name(dtype)}"
            )
    for name in actual:
        if name not in expected:
            return f"{where.get(name, '?')}: unexpected tensor {name} (not part of {len(expected)} expected)"
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return _SAFETENSORS_DTYPES.get(dtype, str(dtype).removeprefix("torch."))


# ----------------------------------------------------------------------------------------------
# Files and hashes


def sha256_file(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _is_hidden(relative: Path) -> bool:
    # Hub downloads keep `.cache/` and `.gitattributes` beside the files; they are not the model.
    return any(part.startswith(".") for part in relative.parts)


def _files(folder: Path) -> list[str]:
    """Every regular file under `folder` except SHA256SUMS and hidden ones, as sorted POSIX paths."""
    found = []
    for path in folder.rglob("*"):
        relative = path.relative_to(folder)
        if path.is_file() and relative.as_posix() != SUMS_FILE and not _is_hidden(relative):
            found.append(relative.as_posix())
    return sorted(found)


def write_sha256sums(folder: Path) -> Path:
    """Write `folder/SHA256SUMS` over every other file, atomically (temp file, fsync, rename)."""
    lines = "".join(f"{sha256_file(folder / name)}  {name}\n" for name in _files(folder))
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
# Verification


def _check_hashes(folder: Path) -> tuple[dict[str, str], list[str]]:
    sums = read_sha256sums(folder)
    for name, digest in sums.items():
        path = folder / name
        if not path.is_file():
            raise VerifyError(f"{name}: listed in {SUMS_FILE} but missing")
        if sha256_file(path) != digest:
            raise VerifyError(f"{name}: SHA256 mismatch (changed since {SUMS_FILE} was written)")
    unlisted = [name for name in _files(folder) if name not in sums]
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


def _chat_template_source(folder: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    for name in CHAT_TEMPLATE_FILES:
        if (folder / name).is_file():
            return name
    if tokenizer_config.get("chat_template"):
        return "tokenizer_config.json"
    return None


def _tokenizer_rows(tokenizer: Any) -> int:
    """Embedding rows the tokenizer needs: its size, or its largest id + 1 if the ids have gaps."""
    return max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)


def _load_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def _weight_files(folder: Path, sums: Mapping[str, str]) -> tuple[list[str], dict[str, str] | None]:
    """The weight files the engine will load, and the index's weight map when sharded."""
    on_disk = [name for name in _files(folder) if name.endswith(".safetensors")]
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
    from_name = {value: key for key, value in _SAFETENSORS_DTYPES.items()}
    layout: dict[str, TensorSpec] = {}
    where: dict[str, str] = {}
    payload = 0
    for name in files:
        try:
            # safe_open checks the header against the file: offsets contiguous, payload length exact.
            with safe_open(folder / name, framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                    if key in layout:
                        raise VerifyError(f"{name}: tensor {key} also stored in {where[key]}")
                    if weight_map is not None and weight_map.get(key) != name:
                        raise VerifyError(
                            f"{name}: holds {key}, which {WEIGHTS_INDEX_FILE} maps to {weight_map.get(key)}"
                        )
                    tensor_slice = handle.get_slice(key)
                    dtype_name = tensor_slice.get_dtype()
                    shape = tuple(tensor_slice.get_shape())
                    dtype = from_name.get(dtype_name)
                    if dtype is None:
                        raise VerifyError(f"{name}: tensor {key} has unsupported dtype {dtype_name}")
                    layout[key] = (shape, dtype)
                    where[key] = name
                    payload += math.prod(shape) * dtype.itemsize
        except VerifyError:
            raise
        except Exception as error:  # safetensors raises its own error types for a bad header
            raise VerifyError(f"{name}: not a readable safetensors file ({error})") from None
    if weight_map is not None:
        for key, name in weight_map.items():
            if key not in layout:
                raise VerifyError(f"{WEIGHTS_INDEX_FILE}: maps {key} to {name}, which does not hold it")
    return layout, where, payload


def _load_expect_config(path: Path) -> PretrainedConfig:
    from transformers import AutoConfig

    path = Path(path)
    if path.is_dir():
        path = path / CONFIG_FILE
    if not path.is_file():
        raise VerifyError(f"expect-config {path}: no such file")
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as error:
        raise VerifyError(f"expect-config {path}: unreadable ({error})") from None


def verify_checkpoint(
    path: Path,
    *,
    expect_config: Path | None = None,
    vocab_size: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, Any]:
    """Check that `path` is a complete, untouched serving-format checkpoint; return a summary.

    In order: SHA256SUMS present and every listed file's hash (no unlisted weight file); config,
    tokenizer files and chat template present and listed; weight files readable (with a
    consistent index when sharded); embedding rows == config vocab_size == the expected row count
    (`vocab_size`, else `expect_config`'s vocab_size, else the row count the export declared in
    bcstack_export.json, else the tokenizer's size); every tensor's
    key, shape and dtype (`dtype`, BF16) as `expected_tensors(config)`; with `expect_config` (the
    served model's config.json, or its folder) the architecture fields in COMPATIBLE_FIELDS equal.
    Raises VerifyError with the first problem.
    """
    from transformers import AutoConfig

    folder = Path(path)
    if not folder.is_dir():
        raise VerifyError(f"{folder}: not a folder")
    sums, unlisted = _check_hashes(folder)

    _require_listed(CONFIG_FILE, folder, sums, "model config")
    try:
        config = AutoConfig.from_pretrained(folder)
    except Exception as error:
        raise VerifyError(f"{CONFIG_FILE}: unreadable ({error})") from None

    for name in REQUIRED_TOKENIZER_FILES:
        _require_listed(name, folder, sums, "tokenizer file")
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            _require_listed(name, folder, sums, "tokenizer file")
    try:
        tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except ValueError as error:
        raise VerifyError(f"tokenizer_config.json: unreadable ({error})") from None
    chat_template = _chat_template_source(folder, tokenizer_config)
    if chat_template is None:
        raise VerifyError(
            "no chat template: tokenizer_config.json has no chat_template and there is no "
            + " or ".join(CHAT_TEMPLATE_FILES)
        )
    try:
        tokenizer = _load_tokenizer(folder)
    except Exception as error:
        raise VerifyError(f"tokenizer: does not load ({error})") from None
    tokenizer_rows = _tokenizer_rows(tokenizer)

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
    if config.vocab_size < tokenizer_rows:
        # Checked before building the layout: a model whose special token ids fall outside its
        # vocabulary does not even construct.
        raise VerifyError(
            f"vocabulary: config.json vocab_size {config.vocab_size} is smaller than the tokenizer's "
            f"{tokenizer_rows} tokens"
        )
    try:
        expected, vocab_names = _layout(config, None, dtype)
    except Exception as error:
        raise VerifyError(f"{CONFIG_FILE}: does not describe a loadable causal LM ({error})") from None
    for name in vocab_names:
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
        if vocab_size is None and served is None and declared is None and rows != tokenizer_rows:
            raise VerifyError(
                f"vocabulary: {name} has {rows} rows but the tokenizer has {tokenizer_rows} tokens "
                "(pass --vocab-size or --expect-config if the engine keeps padding rows)"
            )
    problem = _first_layout_problem(actual, expected, where)
    if problem is not None:
        raise VerifyError(problem)

    if served is not None:
        for field in COMPATIBLE_FIELDS:
            ours, theirs = getattr(config, field, None), getattr(served, field, None)
            if ours != theirs:
                raise VerifyError(f"{CONFIG_FILE}: {field} is {ours}, the served model's config has {theirs}")

    return {
        "path": str(folder),
        "architecture": ",".join(config.architectures or [type(config).__name__]),
        "model_type": config.model_type,
        "tensors": len(actual),
        "parameters": sum(math.prod(shape) for shape, _ in actual.values()),
        "dtype": _dtype_name(dtype),
        "vocab_rows": config.vocab_size,
        "tokenizer_tokens": len(tokenizer),
        "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        "weight_files": files,
        "weight_bytes": payload,
        "chat_template": chat_template,
        "hashed_files": len(sums),
        "unlisted_files": unlisted,
        "expect_config": str(expect_config) if expect_config is not None else None,
    }


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
    for name in REQUIRED_TOKENIZER_FILES:
        if not (tokenizer_dir / name).is_file():
            raise ExportError(f"{tokenizer_dir}: no {name} (the tokenizer to restore)")
    tokenizer_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    if _chat_template_source(tokenizer_dir, tokenizer_config) is None:
        raise ExportError(f"{tokenizer_dir}: no chat template (tokenizer_config.json or chat_template.jinja)")
    tokenizer = _load_tokenizer(tokenizer_dir)
    needed = _tokenizer_rows(tokenizer)
    rows, rows_from = _target_rows(vocab_size, needed, model_dir, tokenizer_dir)
    if rows < needed:
        raise ExportError(f"vocab_size {rows} is smaller than the tokenizer's {needed} tokens")

    step(f"Reading the weights and casting to {_dtype_name(dtype)}")
    tensors = _read_source(model_dir, dtype)
    _, vocab_names = _layout(config, None, dtype)
    embedding_name = vocab_names[0]
    if embedding_name not in tensors:
        raise ExportError(f"{model_dir}: no {embedding_name} in the weights")
    source_rows = tensors[embedding_name].shape[0]
    if rows > source_rows:
        raise ExportError(f"cannot trim {embedding_name} to {rows} rows: the source has only {source_rows}")
    dropped_lm_head = None
    if getattr(config, "tie_word_embeddings", False):
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
    expected = expected_tensors(config, dtype=dtype)
    problem = _first_layout_problem(
        {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in tensors.items()},
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
        summary = verify_checkpoint(staging, vocab_size=vocab_size, dtype=dtype)
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
