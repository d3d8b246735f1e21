"""Build the tiny model kit into a folder: tokenizer, chat template, Qwen3 weights, manifest.

The folder loads with `AutoTokenizer.from_pretrained` / `AutoModelForCausalLM.from_pretrained`
and is a function of the arguments only: the same arguments give byte-identical files (no
timestamps or paths in any file; BPE training and the seeded init are deterministic). Files are
written into a temporary sibling folder that is renamed into place at the end, so a crash never
leaves a half-written kit behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.atomic import swap_in
from core.chat_template import CHAT_TEMPLATE_PATH, load_chat_template
from devkit.modelkit.corpus import Corpus, read_corpus_jsonl, toy_world_corpus
from devkit.modelkit.model import TinyQwen3Shape, build_tiny_qwen3
from devkit.modelkit.tokenizer import ADDED_TOKENS, DEFAULT_BPE_VOCAB_SIZE, save_tokenizer, train_tokenizer

KIT_NAME = "bcstack-tiny-qwen3"
KIT_VERSION = "1"  # bump when the same arguments would build different files
MANIFEST_FILE = "bcstack_model.json"


class OutputDirError(RuntimeError):
    """The output folder exists and holds files, and overwriting was not asked for."""


def _check_output_dir(out_dir: Path, force: bool) -> None:
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise OutputDirError(f"{out_dir} exists and is not a folder")
    if any(out_dir.iterdir()) and not force:
        raise OutputDirError(f"{out_dir} is not empty; pass --force to replace it")


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _library_versions() -> dict[str, str]:
    import tokenizers
    import torch
    import transformers

    return {
        "tokenizers": tokenizers.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def _write_kit(
    folder: Path,
    corpus: Corpus,
    seed: int,
    bpe_vocab_size: int,
    shape: TinyQwen3Shape,
    step: Callable[[str], None],
    number_digits: int = 1,
) -> dict[str, Any]:
    step("Training the byte-level BPE tokenizer")
    tokenizer = train_tokenizer(
        (doc["text"] for doc in corpus.documents),
        bpe_vocab_size=bpe_vocab_size,
        chat_template=load_chat_template(),
        number_digits=number_digits,
    )
    save_tokenizer(tokenizer, folder)

    step("Initialising the tiny Qwen3 model")
    from transformers.utils import logging as hf_logging

    model = build_tiny_qwen3(tokenizer, shape=shape, seed=seed)
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # its tqdm bar would tear through the Rich status line
    try:
        model.save_pretrained(folder)  # transformers 5 always writes safetensors (no safe_serialization)
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()

    step("Writing the manifest")
    # safetensors leaves its file owner-only; a serving container may run as another user.
    for path in folder.iterdir():
        path.chmod(0o644)
    files = {path.name: _sha256_file(path) for path in sorted(folder.iterdir()) if path.is_file()}
    manifest = {
        "kit": KIT_NAME,
        "kit_version": KIT_VERSION,
        "seed": seed,
        "corpus": {
            "source": corpus.source,
            "name": corpus.name,
            "sha256": corpus.sha256,
            "documents": len(corpus.documents),
        },
        "tokenizer": {
            "bpe_vocab_size_requested": bpe_vocab_size,
            "bpe_vocab_size": len(tokenizer) - len(ADDED_TOKENS),
            "number_digits": number_digits,
            "added_tokens": list(ADDED_TOKENS),
            "size": len(tokenizer),
            "eos_token": tokenizer.eos_token,
            "pad_token": tokenizer.pad_token,
        },
        "model": {
            "architecture": type(model).__name__,
            "config_vocab_size": model.config.vocab_size,
            "parameters": sum(parameter.numel() for parameter in model.parameters()),
            "dtype": str(model.dtype).removeprefix("torch."),
            "shape": shape.as_dict(),
        },
        "chat_template": {"name": CHAT_TEMPLATE_PATH.name, "sha256": _sha256_file(CHAT_TEMPLATE_PATH)},
        "libraries": _library_versions(),
        "files": files,
    }
    (folder / MANIFEST_FILE).write_text(
        json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )
    return manifest


def build_tiny_kit(
    out_dir: str | Path,
    corpus_path: str | Path | None = None,
    seed: int = 0,
    bpe_vocab_size: int = DEFAULT_BPE_VOCAB_SIZE,
    force: bool = False,
    shape: TinyQwen3Shape = TinyQwen3Shape(),
    step: Callable[[str], None] | None = None,
    number_digits: int = 1,
) -> dict[str, Any]:
    """Build the kit into `out_dir` and return its manifest (also written as `bcstack_model.json`).

    `corpus_path` is a BrowseComp-Plus corpus JSONL; without it the toy world's corpus is used.
    `number_digits`: digit runs kept together by the pre-tokenizer (1: Qwen3's single digits).
    `step` is called with a short description as each stage starts (for progress output).
    Raises `CorpusError` for a bad corpus and `OutputDirError` for a non-empty `out_dir`
    without `force`; in both cases nothing is written.
    """
    step = step or (lambda _description: None)
    out_dir = Path(out_dir)
    _check_output_dir(out_dir, force)

    step("Reading the corpus" if corpus_path is not None else "Generating the toy world corpus")
    corpus = read_corpus_jsonl(corpus_path) if corpus_path is not None else toy_world_corpus()

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        manifest = _write_kit(staging, corpus, seed, bpe_vocab_size, shape, step, number_digits)
        _check_output_dir(out_dir, force)  # someone may have filled it while we built
        swap_in(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest
