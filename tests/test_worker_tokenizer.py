"""services/worker/tokenizer.py: the worker's tokenizer read from tokenizer.json gives transformers'
ids and text on the tiny kit's tokenizer, falls back to transformers where the files ask for what it
does not do, and keeps torch and transformers out of the start of a worker and of a scripted engine."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from core.chat_template import render_chat
from devkit.modelkit.tokenizer import IM_END, IM_START, PAD_TOKEN
from services.worker.tokenizer import FileTokenizer, TokenizerError, load_tokenizer

REPO = Path(__file__).resolve().parents[1]
TEXTS = [
    "",
    "Who founded the Quillan works in 1987?",
    "  leading spaces,\ttabs\nand newlines\n\n",
    "digits 1 12 123 1234 12345 123456789 and 3.14159, -42",
    "unicode: café naïve Ærøskøbing 東京 emoji 🚀 e\u0301",
    f"{IM_START}assistant\n<think>\nfind it\n</think>\n\nanswer{IM_END}\n",
    '<tool_call>\n{"name": "search", "arguments": {"query": "Quillan V8"}}\n</tool_call>',
    f"text{IM_END}{IM_END}{PAD_TOKEN} glued{IM_START}user",
]


@pytest.fixture(scope="module")
def kit(tmp_path_factory, tiny_kit) -> Path:
    return tiny_kit(tmp_path_factory.mktemp("tok") / "tiny")


def test_the_file_tokenizer_gives_transformers_ids_and_text(kit: Path) -> None:
    from transformers import AutoTokenizer

    ours, theirs = load_tokenizer(kit), AutoTokenizer.from_pretrained(kit)
    assert isinstance(ours, FileTokenizer)

    def same_text(ids: list[int]) -> bool:
        return all(
            ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
            for skip in (False, True)
        )

    chat = render_chat(
        [{"role": "user", "content": TEXTS[1]}, {"role": "assistant", "content": TEXTS[6]}],
        add_generation_prompt=True,
    )
    for text in [*TEXTS, chat]:
        for special in (False, True):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == list(theirs.encode(text, add_special_tokens=special)), text
            assert same_text(ids), text
    rng = random.Random(0)
    for _ in range(50):  # any ids, special ones and cut-off byte sequences included
        ids = [rng.randrange(len(theirs)) for _ in range(rng.randrange(1, 40))]
        assert same_text(ids), ids
    for token in (IM_START, IM_END, PAD_TOKEN, "no-such-token-here"):
        assert ours.convert_tokens_to_ids(token) == theirs.convert_tokens_to_ids(token) or (
            ours.convert_tokens_to_ids(token) is None and theirs.convert_tokens_to_ids(token) is None
        )
    assert len(ours) == len(theirs)


def test_what_only_transformers_does_goes_through_transformers(kit: Path, tmp_path: Path) -> None:
    config = json.loads((kit / "tokenizer_config.json").read_text())
    for name, change in (
        ("cleanup", {"clean_up_tokenization_spaces": True}),  # decode's clean-up of spaces
        ("unknown-special", {"extra_special_tokens": [IM_START, IM_END, "<|new_marker|>"]}),
    ):
        folder = tmp_path / name
        folder.mkdir()
        for file in kit.iterdir():
            (folder / file.name).symlink_to(file)
        (folder / "tokenizer_config.json").unlink()
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, **change}))
        tokenizer = load_tokenizer(folder)
        assert not isinstance(tokenizer, FileTokenizer), name
        assert tokenizer.convert_tokens_to_ids(IM_END) == load_tokenizer(kit).convert_tokens_to_ids(IM_END)


def test_a_bad_tokenizer_folder_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="not a folder"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(TokenizerError, match=r"tokenizer\.json cannot be loaded: ") as err:
        load_tokenizer(tmp_path)
    assert "\n" not in str(err.value)


def test_a_worker_starts_without_torch_or_transformers(kit: Path) -> None:
    code = (
        "import sys\n"
        "from services.worker.service import build\n"
        "from services.worker.settings import WorkerSettings\n"
        f"build(WorkerSettings(tokenizer={str(kit)!r}))\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_scripted_engine_starts_without_torch_or_transformers(kit: Path) -> None:
    """The CPU engine's scripted policies (the expert of every toy stack) read the tokenizer the same
    way; a model engine still loads transformers' tokenizer, as SGLang does."""
    code = (
        "import asyncio, sys\n"
        "from services.engine.core import EngineCore\n"
        "from services.engine.settings import EngineSettings\n"
        f"core = EngineCore(EngineSettings(policy='expert', tokenizer={str(kit)!r}))\n"
        "asyncio.run(core.start())\n"
        "assert core.state == 'ready', core.failure\n"
        "print(type(core.tokenizer).__name__, core.context_length)\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    config = json.loads((kit / "tokenizer_config.json").read_text())
    assert done.stdout.split("\n")[:2] == [f"FileTokenizer {config['model_max_length']}", "[]"]
