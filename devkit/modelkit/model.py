"""A tiny Qwen3-architecture causal LM: Qwen3-4B's layout at toy width, randomly initialised.

It has the same module tree, tensor naming, tied embeddings, GQA ratio, QK-norm, RoPE base and
context length as Qwen3-4B, so the engine, the trainer, tensor parallelism and the exporter run
the same code on it as on the real checkpoint; only the sizes differ.

Weights are float32, not Qwen3's bfloat16: on the CPU the engine's rollout log-probs and the
trainer's recomputed log-probs then agree to float32 precision with no cast in between, TP=2 vs
TP=1 comparisons can be tight, and CPU kernels need no bf16 support. At ~0.4M parameters the
size is irrelevant; the BF16 export path is exercised by the exporter, not by this kit.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from core import budget

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

VOCAB_MULTIPLE = 128


@dataclass(frozen=True)
class TinyQwen3Shape:
    """The architecture numbers; the defaults keep Qwen3-4B's ratios (2 query heads per KV head)."""

    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 192
    max_position_embeddings: int = budget.CONTEXT_LENGTH  # Qwen3-4B's; the worker's server context
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6

    def as_dict(self) -> dict[str, int | float]:
        return asdict(self)


def padded_vocab_size(n_tokens: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """The embedding row count: the next multiple of `multiple` strictly above `n_tokens`.

    Strictly above, as in Qwen3-4B (151,669 tokens, 151,936 rows), so code that confuses the
    tokenizer's size with the config's vocab_size fails on the tiny model too.
    """
    return (n_tokens // multiple + 1) * multiple


def build_tiny_qwen3(
    tokenizer: PreTrainedTokenizerFast,
    shape: TinyQwen3Shape = TinyQwen3Shape(),
    seed: int = 0,
) -> Qwen3ForCausalLM:
    """A freshly initialised Qwen3ForCausalLM sized for `tokenizer`, deterministic in `seed`."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    pad_id = tokenizer.pad_token_id
    eos_id = tokenizer.eos_token_id
    config = Qwen3Config(
        vocab_size=padded_vocab_size(len(tokenizer)),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        rms_norm_eps=shape.rms_norm_eps,
        tie_word_embeddings=True,
        use_sliding_window=False,
        max_window_layers=shape.num_hidden_layers,
        # Qwen3's config.json uses <|endoftext|> as bos_token_id although its tokenizer has no BOS.
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=pad_id,
        eos_token_id=[eos_id, pad_id],  # as Qwen3-4B: stop on <|im_end|> or <|endoftext|>
        pad_token_id=pad_id,
        # The worker's sampling defaults (DESIGN.md §3); callers wanting greedy pass do_sample=False.
        do_sample=True,
        temperature=budget.TEMPERATURE,
        top_p=budget.TOP_P,
    )
    return model.eval()
