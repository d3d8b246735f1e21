"""The scripted engine: a toy-world policy served behind the same `/generate` as a model.

`bcstack serve engine --policy expert --tokenizer DIR` answers token-in-token-out requests with
the toy world's expert worker (`devkit.toyworld.policies.expert_worker_policy`): the prompt ids
are decoded, the Qwen3 ChatML rendering is read back into `{"role", "content"}` messages, the
policy writes the next assistant message, and its tokens followed by `<|im_end|>` (EOS) are
emitted one per decode step with log-prob 0.0 (the policy is deterministic). `max_new_tokens`,
stop tokens and stop strings apply as for a model. Model time is nil, so it is the reference
worker for tests and the demo.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

from devkit.modelkit.tokenizer import IM_END, IM_START
from services.engine.model_api import Choice
from services.engine.sequence import Sequence

Message = dict[str, str]
Policy = Callable[[Seq[Message]], str]

_TURN = re.compile(re.escape(IM_START) + r"([a-z]+)\n(.*?)(" + re.escape(IM_END) + r"|\Z)", re.S)


def parse_chatml(text: str) -> list[Message]:
    """Messages from a Qwen3 ChatML rendering (`<|im_start|>role\\ncontent<|im_end|>\\n` ...).

    An assistant turn left open at the end is the reply being generated (the generation prompt
    `<|im_start|>assistant\\n`, perhaps with a prefilled start), not a message: it is dropped.
    """
    messages, open_turn = [], False
    for match in _TURN.finditer(text):
        messages.append({"role": match.group(1), "content": match.group(2)})
        open_turn = match.group(3) == ""
    if messages and open_turn and messages[-1]["role"] == "assistant":
        messages.pop()
    return messages


def expert_policy() -> Policy:
    from devkit.toyworld.policies import expert_worker_policy

    return expert_worker_policy


def expert_snippets_policy() -> Policy:
    from functools import partial

    from devkit.toyworld.policies import expert_worker_policy

    return partial(expert_worker_policy, read_snippets=True)


POLICIES: dict[str, Callable[[], Policy]] = {
    "expert": expert_policy,
    "expert-snippets": expert_snippets_policy,
}


class ScriptedModel:
    """A policy as a token model: the reply is computed at prefill, then emitted token by token."""

    def __init__(self, policy: Policy, tokenizer: Any, name: str, max_position_embeddings: int) -> None:
        self.policy = policy
        self.tokenizer = tokenizer
        self.model_path = f"scripted:{name}"
        self.vocab_size = len(tokenizer)
        eos = tokenizer.convert_tokens_to_ids(IM_END)
        self.eos_token_id = int(eos)
        self.eos_token_ids = frozenset({self.eos_token_id})
        self.max_position_embeddings = max_position_embeddings

    def script(self, prompt_ids: list[int]) -> list[int]:
        """The reply's token ids, `<|im_end|>` included."""
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        reply = self.policy(parse_chatml(text))
        return [*self.tokenizer.encode(reply, add_special_tokens=False), self.eos_token_id]

    def prefill(self, seq: Sequence) -> Choice | None:
        seq.model_state = self.script(seq.prompt_ids)
        if seq.request.return_logprob and seq.request.logprob_start_len >= 0 and not seq.output_ids:
            scored = len(seq.prompt_ids) - seq.request.logprob_start_len
            seq.input_logprobs = [None, *([0.0] * (scored - 1))]
        if seq.output_ids or seq.sampling.max_new_tokens == 0:
            return None
        return self._next(seq)

    def decode(self, seqs: list[Sequence]) -> list[Choice]:
        return [self._next(s) for s in seqs]

    def release(self, seq: Sequence, reusable: bool = True) -> None:
        seq.model_state = None  # no prefix cache: a script is recomputed from the prompt in no time

    def _next(self, seq: Sequence) -> Choice:
        script: list[int] = seq.model_state
        position = len(seq.output_ids)
        # Past the end of the script (ignore_eos), keep emitting EOS.
        return (script[position] if position < len(script) else self.eos_token_id), 0.0
