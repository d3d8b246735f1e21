"""Injected failures, for testing what talks to a coordinator LLM (retries, timeouts, parsing).

Each chat completion draws once from a `random.Random(fault_seed)`: below `fail_rate` it gets the
configured fault. Requests that arrive one after another therefore see the same pattern of
faults on every run with the same seed; concurrent requests draw in arrival order. Only valid,
authorized chat completions draw, so a probe of /v1/models or a bad request never shifts it.
"""

from __future__ import annotations

import random
from typing import get_args

from services.coordinator_llm.settings import FailMode

FAIL_MODES: tuple[str, ...] = get_args(FailMode)

# What a `garbage` answer says: prose with a call cut off before `</function>`, so the protocol
# parser finds no call (`parse_calls` gives []), the way a truncated or derailed model turn looks.
GARBAGE_CONTENT = (
    "I think the the answer answer is is\x7f ::: {{ <parameter=prompt> ]] \n"
    "<function=branch>\n<parameter=description>Answer the"
)


class FaultInjector:
    def __init__(self, rate: float, mode: FailMode, seed: int) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"fail rate must be within [0, 1], got {rate}")
        if mode not in FAIL_MODES:
            raise ValueError(f"unknown fail mode {mode!r}; known: {', '.join(FAIL_MODES)}")
        self.rate = rate
        self.mode = mode
        self.seed = seed
        self._rng = random.Random(seed)

    def draw(self) -> FailMode | None:
        """The fault for the next request, or None for a normal answer."""
        if self.rate <= 0.0:
            return None
        return self.mode if self._rng.random() < self.rate else None
