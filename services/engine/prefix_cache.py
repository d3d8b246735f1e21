"""The CPU engine's prefix cache: the KV of earlier sequences, keyed by their token ids, so that a
request starting with the same tokens prefills only the rest (SGLang's radix cache, on the CPU).

What an entry is: one sequence's token ids whose KV was computed, with that KV (an opaque value to
this module), held in LRU order under a budget of tokens in total (`prefix_cache_tokens`). A
lookup answers the longest prefix of a request that some entry holds, and that entry.

How a lookup finds it without comparing the request with every entry: token ids are cut into
blocks of `block` tokens and each block gets a chained hash, hash(previous chain hash, the block's
ids), as vLLM's automatic prefix caching names its KV blocks; chain hash k therefore names the
first k blocks. An index maps each chain hash to the entries holding those k * block tokens. A
lookup walks the request's chain hashes while the index knows them (one dict look-up per block),
checks the entries found at the deepest block with one slice comparison (so a hash collision can
cost a hit but never give a wrong one) and extends the match token by token into the next,
partial block. Entries shorter than one block are not kept: there is too little to save.

Why not SGLang's radix tree: its tree shares one copy of a common prefix's KV between branches
because its KV lives in a paged pool. Here a sequence's KV is one contiguous tensor per layer
(what `transformers`' DynamicCache holds); cutting it per tree node would mean concatenating on
every hit. The price is duplicated KV where entries share a prefix (many episodes, one system
prompt); the budget counts the duplicates, so memory stays bounded. An entry that is a prefix of
a newer one is dropped when the newer one comes in, so a multi-turn episode keeps one entry (its
latest turn), not one copy per turn.

Not thread-safe: the engine touches it from its step thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V")

BLOCK_TOKENS = 16


def chain_hashes(ids: Sequence[int], blocks: int, block: int) -> list[int]:
    """The chained hash of each of the first `blocks` full blocks of `ids`."""
    hashes, h = [], 0
    for k in range(blocks):
        h = hash((h, tuple(ids[k * block : (k + 1) * block])))
        hashes.append(h)
    return hashes


@dataclass(eq=False)
class _Entry(Generic[V]):
    tokens: tuple[int, ...]
    value: V
    hashes: list[int]  # chain hash per full block of `tokens`


class PrefixCache(Generic[V]):
    """Sequences' KV by token ids, LRU under `capacity_tokens` tokens in all (0 = off)."""

    def __init__(self, capacity_tokens: int, block: int = BLOCK_TOKENS) -> None:
        self.capacity_tokens = capacity_tokens
        self.block = block
        self.tokens = 0  # tokens held, over all entries
        self._lru: OrderedDict[_Entry[V], None] = OrderedDict()  # oldest first
        self._by_block: dict[int, set[_Entry[V]]] = {}  # chain hash k -> entries holding k blocks
        self._by_end: dict[int, set[_Entry[V]]] = {}  # an entry's last full block's chain hash -> it

    @property
    def enabled(self) -> bool:
        return self.capacity_tokens > 0

    def __len__(self) -> int:
        return len(self._lru)

    def match(self, ids: Sequence[int], limit: int | None = None) -> tuple[int, V | None]:
        """(n, value): the longest prefix of `ids[:limit]` an entry holds, n tokens of it, and that
        entry's value (now the most recently used); (0, None) when no entry shares a full block."""
        found = self._longest(ids, len(ids) if limit is None else min(limit, len(ids)))
        if found is None:
            return 0, None
        n, entry = found
        self._lru.move_to_end(entry)
        return n, entry.value

    def insert(self, tokens: Sequence[int], value: V) -> bool:
        """Keep `value` as the KV of `tokens`; False when it is not kept (off, shorter than a block,
        over the budget, or an entry already holds these tokens: that one is touched instead).
        Entries holding a prefix of `tokens` are dropped; then the least recently used go until
        the budget holds."""
        key = tuple(tokens)
        if not self.enabled or len(key) < self.block or len(key) > self.capacity_tokens:
            return False
        held = self._longest(key, len(key))
        if held is not None and held[0] == len(key):
            self._lru.move_to_end(held[1])
            return False
        hashes = chain_hashes(key, len(key) // self.block, self.block)
        for h in hashes:
            for older in list(self._by_end.get(h, ())):
                if key[: len(older.tokens)] == older.tokens:
                    self._remove(older)
        entry = _Entry(key, value, hashes)
        self._lru[entry] = None
        for h in hashes:
            self._by_block.setdefault(h, set()).add(entry)
        self._by_end.setdefault(hashes[-1], set()).add(entry)
        self.tokens += len(key)
        while self.tokens > self.capacity_tokens:
            self._remove(next(iter(self._lru)))
        return True

    def clear(self) -> None:
        self._lru.clear()
        self._by_block.clear()
        self._by_end.clear()
        self.tokens = 0

    # --- internals -------------------------------------------------------------------------------

    def _longest(self, ids: Sequence[int], limit: int) -> tuple[int, _Entry[V]] | None:
        if not self._lru:
            return None
        hashes = chain_hashes(ids, limit // self.block, self.block)
        depth = 0
        while depth < len(hashes) and hashes[depth] in self._by_block:
            depth += 1
        while depth > 0:  # below the deepest known block only after a hash collision
            shared = depth * self.block
            prefix = tuple(ids[:shared])
            best: tuple[int, _Entry[V]] | None = None
            for entry in self._by_block[hashes[depth - 1]]:
                if entry.tokens[:shared] != prefix:
                    continue
                n, end = shared, min(len(entry.tokens), limit)
                while n < end and entry.tokens[n] == ids[n]:
                    n += 1
                if best is None or n > best[0]:
                    best = (n, entry)
            if best is not None:
                return best
            depth -= 1
        return None

    def _remove(self, entry: _Entry[V]) -> None:
        del self._lru[entry]
        for index, h in [*((self._by_block, h) for h in entry.hashes), (self._by_end, entry.hashes[-1])]:
            bucket = index[h]
            bucket.discard(entry)
            if not bucket:
                del index[h]
        self.tokens -= len(entry.tokens)
