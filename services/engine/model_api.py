"""What the scheduler and the engine need of a token model, without torch: the `TokenModel` protocol
(services/engine/models.py has its contract), a `Choice` (token, log-prob) and `WeightLoadError`.
A scripted engine (`--policy`) imports these and never torch (its start: ~1 s instead of ~4.5 s)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from services.engine.sequence import Sequence

Choice = tuple[int, float]


class TokenModel(Protocol):
    model_path: str
    vocab_size: int
    eos_token_ids: frozenset[int]
    max_position_embeddings: int

    def prefill(self, seq: Sequence) -> Choice | None: ...

    def decode(self, seqs: list[Sequence]) -> list[Choice]: ...


class WeightLoadError(RuntimeError):
    """A checkpoint that cannot be loaded (or cannot replace the one being served)."""
