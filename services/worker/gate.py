"""The runtime STOP gate backed by the worker's own model (off by default, as in every seed evaluation).

Between turns the runner asks the gate about the episode so far, the latest observation included.
This gate renders `core.gate.gate_messages` through the chat template and asks the engine for one
short greedy generation (`stop_gate_max_new_tokens`, temperature 0); a reply saying STOP makes the
runner append `core.gate.GATE_STOP_MESSAGE` to the observation. The gate's generation is not part of
the trajectory and does not count toward the episode's token budget (it is a separate request, as
a gate classifier would be), but its tokens and decisions are counted in Prometheus. An engine error
at the gate is counted and read as CONTINUE: the gate never fails an episode.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from core.budget import WorkerBudget
from core.chat_template import render_chat
from core.gate import GATE_STOP_MESSAGE, STOP, gate_messages, parse_decision

logger = logging.getLogger(__name__)
GATE_MODES = ("off", "model")


class ModelStopGate:
    """`await gate(messages, budget)` → the STOP message, or None to let the episode go on."""

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        *,
        max_new_tokens: int = 16,
        on_decision: Callable[[str, int], None] | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.on_decision = on_decision

    async def __call__(self, messages: Sequence[dict[str, str]], budget: WorkerBudget) -> str | None:
        from core.engine_client import EngineError

        prompt = render_chat(gate_messages(messages), add_generation_prompt=True)
        ids = list(self.tokenizer.encode(prompt, add_special_tokens=False))
        try:
            out = await self.engine.generate(
                ids, max_new_tokens=self.max_new_tokens, temperature=0.0, top_p=1.0, return_logprob=False
            )
        except EngineError as e:  # EngineUnavailable included
            logger.warning("stop gate: engine error, continuing the episode (%s)", e)
            self._count("error", 0)
            return None
        reply = self.tokenizer.decode(list(out.output_ids), skip_special_tokens=True)
        decision = parse_decision(reply)
        self._count((decision or "unclear").lower(), len(out.output_ids))
        return GATE_STOP_MESSAGE if decision == STOP else None

    def _count(self, decision: str, tokens: int) -> None:
        if self.on_decision is not None:
            self.on_decision(decision, tokens)
