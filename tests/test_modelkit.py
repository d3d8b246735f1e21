"""The tiny model kit: `bcstack model tiny` builds a loadable, deterministic Qwen3-shaped model.

The kit is built once per session from a small synthetic BrowseComp-Plus corpus; the tests
load it the way the engine and trainer do (transformers Auto classes) and check what a user
of the kit relies on: special tokens, the append-only keep-thinking chat template (as strings
and as token ids), the padded vocabulary, generation, byte-identical rebuilds and CLI errors.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import types
from pathlib import Path

import jinja2
import pytest
from typer.testing import CliRunner

from bcstack.cli import app
from core.chat_template import load_chat_template, render_chat
from devkit.modelkit.build import MANIFEST_FILE, build_tiny_kit
from devkit.modelkit.corpus import DEFAULT_TOY_WORLD, toy_world_corpus
from devkit.modelkit.model import padded_vocab_size
from devkit.modelkit.tokenizer import ADDED_TOKENS, CONTROL_TOKENS, SPECIAL_TOKENS

KIT_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    MANIFEST_FILE,
}
BPE_VOCAB = 1024
runner = CliRunner()


def _synthetic_corpus(path: Path, n_docs: int = 300) -> Path:
    rng = random.Random(7)
    syllables = ["ka", "lo", "mi", "ter", "an", "ous", "vel", "dra", "pen", "sto", "ré", "ø", "bel"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(800)]
    with path.open("w", encoding="utf-8") as handle:
        for i in range(n_docs):
            body = " ".join(rng.choice(words) for _ in range(rng.randint(30, 120)))
            founded = f"Founded in {rng.randint(1200, 2020)}."
            text = f"{body.capitalize()}. {founded}\n\nSee also: {rng.choice(words)}."
            record = {"docid": str(10000 + i), "text": text, "url": f"https://toy.example/doc/{i}"}
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def _file_hashes(folder: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(folder.iterdir())}


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _synthetic_corpus(tmp_path_factory.mktemp("corpus") / "corpus.jsonl")


@pytest.fixture(scope="session")
def kit_dir(tmp_path_factory: pytest.TempPathFactory, corpus_file: Path) -> Path:
    out = tmp_path_factory.mktemp("kits") / "tiny"
    args = ["model", "tiny", "--out", str(out), "--corpus", str(corpus_file), "--vocab-size", str(BPE_VOCAB)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "Wrote" in result.output
    return out


@pytest.fixture(scope="session")
def tokenizer(kit_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(kit_dir)


@pytest.fixture(scope="session")
def model(kit_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(kit_dir).eval()


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# A worker trajectory in the FoldAgent protocol: every assistant turn thinks and calls a tool,
# tool results come back as `tool` messages (two in a row share one user turn).
SEARCH_CALL = "<function=search>\n<parameter=query>Nobel laureate born in Tartu</parameter>\n</function>"
CONVERSATION = [
    {"role": "system", "content": "You are a research worker. Use search, open_page and finish."},
    {"role": "user", "content": "Which painter founded the harbour museum?"},
    {"role": "assistant", "content": f"<think>\nI should search first.\n</think>\n\n{SEARCH_CALL}"},
    {"role": "tool", "content": '[Search Results for "harbour museum"]\n--- #1: 18639---\ndocid: 18639'},
    {
        "role": "assistant",
        "content": "<think>\nOpen 18639.\n</think>\n\n"
        "<function=open_page>\n<parameter=docid>18639</parameter>\n</function>",
    },
    {"role": "tool", "content": "[Opened Page Content]\ndocid: 18639\ncontent: Kalo Ter founded it."},
    {"role": "tool", "content": "[Opened Page Content]\ndocid: 2\ncontent: other. [Document is truncated.]"},
    {"role": "assistant", "reasoning_content": "The page says Kalo Ter.", "content": "Checking once more."},
    {"role": "user", "content": "No function call was detected in the model response."},
    {
        "role": "assistant",
        "content": "<think>\nDone.\n</think>\n\n<function=finish>\n<parameter=answer>Kalo Ter</parameter>\n"
        "<parameter=explanation>[18639]</parameter>\n<parameter=confidence>80%</parameter>\n</function>",
    },
]


def _turn_boundaries(messages: list[dict]) -> list[int]:
    """Prefix lengths k that do not split a run of tool messages (such a run is one user turn)."""
    return [
        k
        for k in range(1, len(messages) + 1)
        if k == len(messages) or not (messages[k - 1]["role"] == "tool" and messages[k]["role"] == "tool")
    ]


def test_kit_folder_holds_the_expected_files_and_loads(kit_dir: Path, tokenizer, model) -> None:
    assert {path.name for path in kit_dir.iterdir()} == KIT_FILES
    assert not list(kit_dir.parent.glob(".tiny.*")), "a staging folder was left behind"
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config.tie_word_embeddings is True
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.config.max_position_embeddings == 40960
    assert model.config.rope_parameters["rope_theta"] == 1_000_000.0
    config = json.loads((kit_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["chat_template"] == load_chat_template()


def test_special_tokens_are_single_ids_and_round_trip(tokenizer) -> None:
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    for token in ADDED_TOKENS:
        ids = _ids(tokenizer, token)
        assert len(ids) == 1, token
        assert tokenizer.convert_ids_to_tokens(ids) == [token]
        assert tokenizer.decode(ids) == token
    # Qwen3's split: <|...|> tokens are special; <think>, <tool_call>, ... survive skip_special_tokens.
    text = "<|im_start|>assistant\n<think>\nx\n</think>\n\n<tool_call>\ny\n</tool_call><|im_end|>\n"
    kept = tokenizer.decode(_ids(tokenizer, text), skip_special_tokens=True)
    assert kept == "assistant\n<think>\nx\n</think>\n\n<tool_call>\ny\n</tool_call>\n"
    assert set(SPECIAL_TOKENS) <= set(tokenizer.all_special_tokens)
    assert not set(CONTROL_TOKENS) & set(tokenizer.all_special_tokens)


def test_ordinary_text_round_trips(tokenizer) -> None:
    text = "Kalo Ter (1843–1921) founded the Tartu harbour museum. Ünïcødé, 80%!\n\n\tdone"
    assert tokenizer.decode(_ids(tokenizer, text)) == text


def test_config_vocab_is_padded_past_the_tokenizer(kit_dir: Path, tokenizer, model) -> None:
    vocab_size = model.config.vocab_size
    assert vocab_size > len(tokenizer)
    assert vocab_size % 128 == 0
    assert vocab_size == padded_vocab_size(len(tokenizer))
    assert model.get_input_embeddings().weight.shape[0] == vocab_size
    assert model.config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert model.config.pad_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert model.config.bos_token_id == model.config.pad_token_id  # as Qwen3's config.json
    assert model.generation_config.eos_token_id == [model.config.eos_token_id, model.config.pad_token_id]
    manifest = json.loads((kit_dir / MANIFEST_FILE).read_text())
    assert manifest["tokenizer"]["size"] == len(tokenizer) == BPE_VOCAB + len(ADDED_TOKENS)
    assert manifest["model"]["config_vocab_size"] == vocab_size
    assert manifest["model"]["parameters"] == sum(p.numel() for p in model.parameters())


def test_padded_vocab_size_is_strictly_above() -> None:
    assert padded_vocab_size(1033) == 1152
    assert padded_vocab_size(1024) == 1152
    assert padded_vocab_size(151_669) == 151_680


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_apply_chat_template_equals_render_chat(tokenizer, add_generation_prompt: bool) -> None:
    for k in range(1, len(CONVERSATION) + 1):
        messages = CONVERSATION[:k]
        expected = render_chat(messages, add_generation_prompt=add_generation_prompt)
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert rendered == expected


def test_render_chat_format() -> None:
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "<think>\nA\n</think>\n\nB"},
        {"role": "tool", "content": "R1"},
        {"role": "tool", "content": "R2"},
        {"role": "assistant", "reasoning_content": "\nC\n", "content": "D"},
    ]
    assert render_chat(messages, add_generation_prompt=True) == (
        "<|im_start|>system\nS<|im_end|>\n"
        "<|im_start|>user\nQ<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nA\n</think>\n\nB<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nR1\n</tool_response>\n<tool_response>\nR2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\nC\n</think>\n\nD<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_think = render_chat(messages[:2], add_generation_prompt=True, enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_earlier_think_blocks_are_kept() -> None:
    rendered = render_chat(CONVERSATION)
    for message in CONVERSATION:
        if message["role"] == "assistant":
            assert message["content"] in rendered
    assert rendered.count("<think>") == 4  # three in content, one from reasoning_content


def test_rendering_is_append_only_as_strings_and_token_ids(tokenizer) -> None:
    boundaries = _turn_boundaries(CONVERSATION)
    for shorter, longer in zip(boundaries, boundaries[1:], strict=False):
        head, full = render_chat(CONVERSATION[:shorter]), render_chat(CONVERSATION[:longer])
        assert full.startswith(head), (shorter, longer)
        head_ids, full_ids = _ids(tokenizer, head), _ids(tokenizer, full)
        assert full_ids[: len(head_ids)] == head_ids, (shorter, longer)


def test_generation_prompt_is_a_prefix_of_the_reply(tokenizer) -> None:
    for index, message in enumerate(CONVERSATION):
        if message["role"] != "assistant":
            continue
        prompt = render_chat(CONVERSATION[:index], add_generation_prompt=True)
        replied = render_chat(CONVERSATION[: index + 1])
        assert replied.startswith(prompt), index
        prompt_ids = _ids(tokenizer, prompt)
        assert _ids(tokenizer, replied)[: len(prompt_ids)] == prompt_ids, index
    # With thinking off, the reply is stored as an empty reasoning_content plus the generated text.
    prompt = render_chat(CONVERSATION[:2], add_generation_prompt=True, enable_thinking=False)
    reply = {"role": "assistant", "reasoning_content": "", "content": "Kalo Ter"}
    replied = render_chat([*CONVERSATION[:2], reply])
    assert replied.startswith(prompt)
    prompt_ids = _ids(tokenizer, prompt)
    assert _ids(tokenizer, replied)[: len(prompt_ids)] == prompt_ids


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "critic", "content": "x"}],
        [{"role": "assistant", "content": "", "tool_calls": [{"name": "search", "arguments": {}}]}],
        [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
    ],
)
def test_template_refuses_what_it_would_drop(messages: list[dict]) -> None:
    with pytest.raises(jinja2.TemplateError):
        render_chat(messages)


def test_model_generates_greedily_and_deterministically(tokenizer, model) -> None:
    import torch

    prompt = tokenizer.apply_chat_template(
        CONVERSATION[:2], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        first = model.generate(**prompt, max_new_tokens=6, do_sample=False)
        second = model.generate(**prompt, max_new_tokens=6, do_sample=False)
    assert first.shape[1] > prompt["input_ids"].shape[1]
    assert torch.equal(first, second)
    assert int(first.max()) < model.config.vocab_size
    # The generated text, appended as the assistant message, keeps the prompt a prefix.
    generated = tokenizer.decode(first[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    prompt_text = render_chat(CONVERSATION[:2], add_generation_prompt=True)
    reply = {"role": "assistant", "content": generated}
    assert render_chat([*CONVERSATION[:2], reply]).startswith(prompt_text)


def test_same_arguments_build_byte_identical_files(kit_dir: Path, corpus_file: Path, tmp_path: Path) -> None:
    # Through the installed entry point, in a fresh process on one BPE thread: neither the process
    # nor the thread count may change a byte.
    again = tmp_path / "again"
    command = [sys.executable, "-m", "bcstack", "model", "tiny", "--out", str(again)]
    command += ["--corpus", str(corpus_file), "--vocab-size", str(BPE_VOCAB)]
    env = {**os.environ, "RAYON_NUM_THREADS": "1"}
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr
    assert _file_hashes(again) == _file_hashes(kit_dir)
    manifest = json.loads((kit_dir / MANIFEST_FILE).read_text())
    assert manifest["files"] == {k: v for k, v in _file_hashes(kit_dir).items() if k != MANIFEST_FILE}
    assert manifest["corpus"]["sha256"] == hashlib.sha256(corpus_file.read_bytes()).hexdigest()


def test_seed_changes_the_weights_only(kit_dir: Path, corpus_file: Path, tmp_path: Path) -> None:
    build_tiny_kit(tmp_path / "seed1", corpus_path=corpus_file, seed=1, bpe_vocab_size=BPE_VOCAB)
    original, reseeded = _file_hashes(kit_dir), _file_hashes(tmp_path / "seed1")
    assert reseeded["model.safetensors"] != original["model.safetensors"]
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        assert reseeded[name] == original[name], name


def test_missing_corpus_is_a_clear_error(tmp_path: Path) -> None:
    result = runner.invoke(app, ["model", "tiny", "--out", str(tmp_path / "kit"), "--corpus", "nope.jsonl"])
    assert result.exit_code == 1
    assert "corpus file not found: nope.jsonl" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "kit").exists()


def test_invalid_corpus_line_is_named(tmp_path: Path) -> None:
    corpus = tmp_path / "bad.jsonl"
    lines = ['{"docid": "1", "text": "fine", "url": "u"}', "", '{"docid": "2", "text": 3']
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = runner.invoke(app, ["model", "tiny", "--out", str(tmp_path / "kit"), "--corpus", str(corpus)])
    assert result.exit_code == 1
    assert "bad.jsonl, line 3: not valid JSON" in result.output
    corpus.write_text('{"docid": 2, "text": "t", "url": "u"}\n', encoding="utf-8")
    result = runner.invoke(app, ["model", "tiny", "--out", str(tmp_path / "kit"), "--corpus", str(corpus)])
    assert result.exit_code == 1
    assert "line 1: field 'docid' is missing or not a string" in result.output
    assert not (tmp_path / "kit").exists()


def test_non_empty_out_dir_needs_force(tmp_path: Path, corpus_file: Path) -> None:
    out = tmp_path / "kit"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    args = ["model", "tiny", "--out", str(out), "--corpus", str(corpus_file), "--vocab-size", "300"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1
    assert "is not empty; pass --force" in result.output
    assert (out / "precious.txt").read_text() == "keep me"

    result = runner.invoke(app, [*args, "--force"])
    assert result.exit_code == 0, result.output
    assert {path.name for path in out.iterdir()} == KIT_FILES
    assert sorted(path.name for path in tmp_path.iterdir()) == ["kit"]  # no staging or retired folder left


def test_default_corpus_is_the_toy_world(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def generate_world(**kwargs):
        calls.append(kwargs)
        return types.SimpleNamespace(
            corpus=[{"docid": "7", "text": "Kalo Ter", "url": "https://toy.example/7"}]
        )

    fake = types.ModuleType("devkit.toyworld.generator")
    fake.generate_world = generate_world
    monkeypatch.setitem(sys.modules, "devkit.toyworld.generator", fake)
    corpus = toy_world_corpus()
    assert calls == [DEFAULT_TOY_WORLD] == [{"n_docs": 2000, "seed": 7919}]
    assert corpus.source == "toyworld"
    assert corpus.documents == [{"docid": "7", "text": "Kalo Ter", "url": "https://toy.example/7"}]


def test_number_digits_keeps_a_year_whole_and_the_default_is_qwens(corpus_file: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from devkit.modelkit.tokenizer import QWEN_PRETOKENIZE_REGEX, pretokenize_regex

    assert pretokenize_regex() == QWEN_PRETOKENIZE_REGEX
    assert r"\p{N}{1,4}" in pretokenize_regex(4)
    with pytest.raises(ValueError, match="at least 1"):
        pretokenize_regex(0)
    # In process (the fresh-process build is test_same_arguments_build_byte_identical_files): the
    # command's --number-digits reaches the tokenizer.
    args = ["model", "tiny", "--out", str(tmp_path / "kit4"), "--corpus", str(corpus_file)]
    result = runner.invoke(app, [*args, "--vocab-size", str(BPE_VOCAB), "--number-digits", "4"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "kit4" / MANIFEST_FILE).read_text())["tokenizer"]["number_digits"] == 4
    grouped = AutoTokenizer.from_pretrained(tmp_path / "kit4")
    pieces = grouped.tokenize("founded in 17945 in 1794")
    assert all(len(p.strip("Ġ")) <= 4 for p in pieces if p.strip("Ġ").isdigit())
    assert sum(p.strip("Ġ").isdigit() for p in pieces) < 9  # fewer tokens than one per digit
    # Still a lossless byte-level tokenizer, and the chat template's prefix property holds.
    text = "docid: 55841, born in 1830; 0123456789 x9"
    assert grouped.decode(grouped(text, add_special_tokens=False)["input_ids"]) == text
    messages = [{"role": "user", "content": "In what year? 1794"}]
    prompt = grouped.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    full = grouped.apply_chat_template(
        [*messages, {"role": "assistant", "content": "<think>\n1794\n</think>\n\n 1794"}], tokenize=False
    )
    prompt_ids = grouped(prompt, add_special_tokens=False)["input_ids"]
    assert grouped(full, add_special_tokens=False)["input_ids"][: len(prompt_ids)] == prompt_ids
