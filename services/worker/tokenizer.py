"""The worker's tokenizer: the checkpoint's tokenizer.json read without transformers where that gives
transformers' answers (`core.tokenizer`: a worker's start then imports neither transformers nor
torch), transformers' `AutoTokenizer` otherwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.tokenizer import FileTokenizer, TokenizerError, load_file_tokenizer

__all__ = ["FileTokenizer", "TokenizerError", "load_tokenizer"]


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer of the model folder `path`: a core FileTokenizer, or transformers' where it must be."""
    tokenizer = load_file_tokenizer(path)
    if tokenizer is not None:
        return tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
