"""The simulator's model of one instance's prefix cache: an LRU of chained block keys.

A trace names shared prompt content by ``hash_ids`` (one id per block of ``block_size``
trace tokens; equal leading ids mean an equal prefix). The simulator keys each such block by
its chain (the ids before it and its own), as an engine's chained block hash does, so a
block matches only where the whole prefix before it matches. The cache holds as many trace
blocks as the engine's KV blocks hold tokens (``capacity_tokens``), least recently used
evicted first. This is the device tier only, and it does not subtract the blocks running
requests hold from the cache's room (in an engine those blocks are shared, not copied).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from loadgen.plan import Planned


def chain_keys(hash_ids: Sequence[int]) -> tuple[int, ...]:
    """A key per trace block that names its whole prefix."""
    keys = []
    parent = 0
    for h in hash_ids:
        parent = hash((parent, h))
        keys.append(parent)
    return tuple(keys)


class PrefixLRU:
    """Blocks are used and inserted tail first, so that of one chain the leading blocks (the
    ones other prompts share) are the last to go, as an engine frees a sequence's blocks."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = max(capacity_tokens, 0)
        self._keys: collections.OrderedDict[int, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def match(self, keys: Sequence[int], *, touch: bool = False) -> int:
        """Leading blocks of ``keys`` held; ``touch`` marks them recently used."""
        held = self._keys
        n = 0
        for k in keys:
            if k not in held:
                break
            n += 1
        if touch:
            for k in reversed(keys[:n]):
                held.move_to_end(k)
        return n

    def insert(self, keys: Sequence[int], block_tokens: int) -> None:
        """The blocks of a prompt just computed, now the most recently used."""
        capacity = self.capacity_tokens // max(block_tokens, 1)
        if not capacity:
            return
        held = self._keys
        for k in reversed(keys[:capacity]):
            if k in held:
                held.move_to_end(k)
            else:
                held[k] = None
        while len(held) > capacity:
            held.popitem(last=False)


def reuse_bound(planned: Sequence[Planned]) -> float:
    """The share of prompt tokens that an unbounded cache seen by every request would hold:
    each prompt's leading blocks that an earlier prompt had, whole blocks, never its last
    token; ``planned`` in arrival order. No router and no cache of real size does better."""
    seen: set[int] = set()
    total = reused = 0
    for p in planned:
        n, hash_ids, block = p.input_tokens, p.hash_ids, p.block_size
        total += n
        if not block or not hash_ids:
            continue
        keys = chain_keys(hash_ids[: n // block])
        k = 0
        while k < len(keys) and keys[k] in seen:
            k += 1
        reused += min(k * block, n - 1) if k else 0
        seen.update(keys)
    return reused / total if total else 0.0
