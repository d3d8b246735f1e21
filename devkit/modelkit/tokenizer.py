"""A small byte-level BPE tokenizer with Qwen3's special tokens, trained locally.

It is built the way Qwen2/Qwen3's tokenizer is (NFC normalizer, Qwen's pre-tokenizer split
regex, byte-level mapping and decoder), so text pre-tokenizes as it would for Qwen3-4B: in
particular `\\s*[\\r\\n]+` keeps a run of newlines together whatever follows it, which keeps the
generation prompt's tokens a prefix of the tokens of the rendered reply. Added tokens come
after the learned vocabulary, as in Qwen3 (151,643 learned + added tokens from 151,643 on).

Determinism: the BPE trainer picks the most frequent pair and breaks count ties by pair ids,
which follow the sorted byte alphabet and the merge order, so training is a function of the
word counts only (checked: byte-identical tokenizer.json with RAYON_NUM_THREADS=1, 2, 16 and
across processes).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

from core import budget

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
EOS_TOKEN = IM_END = "<|im_end|>"
# Special: skipped by decode(skip_special_tokens=True).
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)
# Added but not special, as in Qwen3: they stay single ids and survive skip_special_tokens.
CONTROL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
ADDED_TOKENS = SPECIAL_TOKENS + CONTROL_TOKENS

DEFAULT_BPE_VOCAB_SIZE = 4096
MODEL_MAX_LENGTH = budget.CONTEXT_LENGTH

# Qwen2/Qwen3's pre-tokenizer pattern (transformers' Qwen2Tokenizer.PRETOKENIZE_REGEX).
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# The scaffolding every worker prompt holds (chat roles, FoldAgent calls, observation headers;
# DESIGN.md §3). Trained alongside the corpus so it costs a few tokens, not one per byte, as it
# would in Qwen3's large vocabulary.
PROTOCOL_TEXTS = (
    "system\nuser\nassistant\n",
    "<function=search>\n<parameter=query>",
    "</parameter>\n<parameter=topk>5</parameter>\n</function>\n",
    "<function=open_page>\n<parameter=docid>",
    "</parameter>\n</function>\n",
    "<function=finish>\n<parameter=answer>",
    "</parameter>\n<parameter=explanation>",
    "</parameter>\n<parameter=confidence>80%</parameter>\n</function>",
    '[Search Results for "',
    "--- #1: ",
    "---\ndocid: ",
    "\nurl: ",
    "\ncontent: ",
    "[Opened Page Content]\ndocid: ",
    "[Document is truncated.]",
    "No function call was detected in the model response.",
)
_PROTOCOL_REPEATS = 64  # enough for the pairs inside them to clear min_frequency and rank early


def pretokenize_regex(number_digits: int = 1) -> str:
    """Qwen's pattern, with digit runs of up to `number_digits` kept together (Qwen3: 1, each digit
    its own pre-token). A model that must copy a year from its context copies one or two tokens
    instead of four digits, each of which appears all over the context (years, docids)."""
    if number_digits < 1:
        raise ValueError(f"number_digits must be at least 1, got {number_digits}")
    if number_digits == 1:
        return QWEN_PRETOKENIZE_REGEX
    return QWEN_PRETOKENIZE_REGEX.replace(r"|\p{N}|", rf"|\p{{N}}{{1,{number_digits}}}|", 1)


def _untrained_tokenizer(number_digits: int = 1) -> Tokenizer:
    tokenizer = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pretokenize_regex(number_digits)), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def train_tokenizer(
    texts: Iterable[str],
    bpe_vocab_size: int = DEFAULT_BPE_VOCAB_SIZE,
    chat_template: str | None = None,
    number_digits: int = 1,
) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE on `texts` (plus the protocol scaffolding) and add Qwen3's tokens.

    `bpe_vocab_size` counts the 256 byte symbols and the learned merges; the 9 added tokens come
    on top, so `len(tokenizer)` is at most `bpe_vocab_size + 9` (less when the corpus runs out of
    pairs seen at least twice).
    """
    from transformers import PreTrainedTokenizerFast

    if bpe_vocab_size < 256:
        raise ValueError(f"bpe_vocab_size must be at least 256 (the byte alphabet), got {bpe_vocab_size}")
    tokenizer = _untrained_tokenizer(number_digits)
    trainer = BpeTrainer(
        vocab_size=bpe_vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )

    def training_texts() -> Iterable[str]:
        yield from texts
        for _ in range(_PROTOCOL_REPEATS):
            yield from PROTOCOL_TEXTS

    tokenizer.train_from_iterator(training_texts(), trainer=trainer)
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS]
    )
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in CONTROL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=None,  # Qwen3 has no BOS token in its tokenizer
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        extra_special_tokens=[IM_START, IM_END],  # Qwen3 lists its chat markers here too
        chat_template=chat_template,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` (chat template inside, as Qwen3 ships it).

    transformers 5 writes `tokenizer_class: TokenizersBackend`, a name transformers 4.x cannot
    resolve, and a list under `extra_special_tokens`, a key 4.x reads as a dict; the names
    Qwen3 ships (`PreTrainedTokenizerFast`, `additional_special_tokens`) load the same in both.
    """
    out_dir = Path(out_dir)
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if "extra_special_tokens" in config:
        config["additional_special_tokens"] = config.pop("extra_special_tokens")
    config_path.write_text(
        json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8"
    )
