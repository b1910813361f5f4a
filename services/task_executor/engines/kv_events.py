"""Changes to an engine's prefix cache, in a form a router can index.

Engines that cache KV blocks by content record what entered and left each memory tier; the TE
shell drains them (``engine.drain_kv_events()``) and publishes them in batches, and the job
executor keeps a global index of which instance holds which prefix (DeepServe's locality-aware
scheduling; the event shape follows vLLM's KV events). Block hashes are chained: the hash of a
block covers every token before it, so one hash names a whole prefix, and an index needs no
token ids. Every engine must hash the same way for one index to serve them all; the torch
engine's ``prefix_cache.hash_block_tokens`` is the reference.
"""

from __future__ import annotations

import dataclasses

DEVICE = "device"  # the memory the engine computes from (GPU memory, or host memory on a CPU)
HOST = "host"  # a second, slower tier: host memory holding blocks evicted or offloaded


@dataclasses.dataclass(frozen=True, slots=True)
class BlockStored:
    """A chain of consecutive blocks became available in ``tier``."""

    block_hashes: list[int]  # in sequence order; each chains from the one before it
    parent_block_hash: int | None  # the block before the first one; None at a sequence's start
    token_counts: list[int]  # tokens in each block (the block size: only full blocks are stored)
    tier: str = DEVICE


@dataclasses.dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks that ``tier`` no longer holds (evicted, or the engine closed)."""

    block_hashes: list[int]
    tier: str = DEVICE


@dataclasses.dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block of ``tier`` is gone at once (the engine closed): an index drops this
    instance's entries for the tier without waiting for one removal per block."""

    tier: str = DEVICE


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared
