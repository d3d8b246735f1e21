"""A checkpoint's tokenizer read from its `tokenizer.json` by `tokenizers` alone (no transformers).

    tokenizer = load_file_tokenizer(model_dir)   # a FileTokenizer, or None: use transformers'
    ids = tokenizer.encode(text, add_special_tokens=False)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

The worker needs three things of a tokenizer: text to ids without special tokens added, ids to text,
and a special token's id (the CPU engine's scripted policies the same, and its vocabulary size and
context limit). transformers' fast tokenizer does each with the `tokenizers` object it builds from
the same `tokenizer.json` (and SGLang, which serves the ids, reads that file through it), but
importing transformers imports torch when torch is installed: ~3.5 s of CPU, most of a worker's
start here (measured 2026-12-06 on the 2-core CI machine: `AutoTokenizer.from_pretrained` of the
tiny kit 3.5 s, `Tokenizer.from_file` 0.02 s), and torch is otherwise of no use to a worker.
Written by hand because transformers has no import of its tokenizers without torch.

`load_file_tokenizer` reads the file only where that gives transformers' answers: a
`tokenizer.json` is there, `tokenizer_config.json` does not ask for the clean-up of spaces around
punctuation on decode (`clean_up_tokenization_spaces`, which only transformers applies), and every
special token the config names is one of the file's tokens (transformers would add one that is not,
changing the ids). Otherwise it returns None, and the caller (outside the core, which never imports
transformers) loads `AutoTokenizer.from_pretrained`'s tokenizer, which has the same methods.
`tests/test_worker_tokenizer.py` compares both on the tiny kit's tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class TokenizerError(ValueError):
    """A tokenizer folder that cannot be loaded; one line for the user."""


class FileTokenizer:
    """encode / decode / convert_tokens_to_ids of a `tokenizers.Tokenizer`, with the signatures of
    transformers' tokenizers (the calls the worker makes)."""

    def __init__(self, backend: Any, source: str, model_max_length: int | None = None) -> None:
        self.backend = backend
        self.source = source
        self.model_max_length = model_max_length  # tokenizer_config.json's, as transformers reads it

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)


def _named_specials(config: dict[str, Any]) -> Iterator[str]:
    """Every special token `tokenizer_config.json` names (strings or AddedToken dicts)."""
    named: list[Any] = [config.get(key) for key in _SPECIAL_KEYS]
    named += list(config.get("additional_special_tokens") or ())
    named += list(config.get("extra_special_tokens") or ())
    named += list((config.get("added_tokens_decoder") or {}).values())
    for item in named:
        content = item.get("content") if isinstance(item, dict) else item
        if isinstance(content, str) and content:
            yield content


def load_file_tokenizer(path: str | Path) -> FileTokenizer | None:
    """`path`'s tokenizer read from its tokenizer.json; None where only transformers gives its answers
    (the module docstring says when; an unreadable config too: transformers then says what is wrong)."""
    folder = Path(path)
    if not folder.is_dir():
        raise TokenizerError(f"tokenizer {folder}: not a folder (give the served checkpoint's folder)")
    file, config_file = folder / "tokenizer.json", folder / "tokenizer_config.json"
    if not file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    except (OSError, ValueError):
        return None
    if config.get("clean_up_tokenization_spaces"):
        return None
    from tokenizers import Tokenizer

    try:
        backend = Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises plain Exception subclasses with long messages
        detail = " ".join(str(exc).split())[:200]
        raise TokenizerError(f"tokenizer {file} cannot be loaded: {detail}") from None
    if any(backend.token_to_id(token) is None for token in _named_specials(config)):
        return None
    limit = config.get("model_max_length")
    return FileTokenizer(backend, str(file), limit if isinstance(limit, int) else None)
