"""KV cache events: what entered and left each instance's prefix cache, so a router can
keep a global prompt index. Sent in batches, never one message per block.

These are the events' only shape: an engine records them as it caches and evicts, its child
process (if it runs in one) sends them over the pipe, and the TE publishes them as they are.
Block hashes are chained: the hash of a block covers every token before it, so one hash names
a whole prefix, and an index needs no token ids. Every engine must hash the same way for one
index to serve them all: ``shared.block_hash`` is the spec (the event shape follows vLLM's
KV events)."""

from __future__ import annotations

import msgspec

from shared.messages.base import Message

DEVICE = "device"  # the memory the engine computes from (GPU memory, or host memory on a CPU)
HOST = "host"  # a second, slower tier: host memory holding blocks evicted or offloaded


class KvBlocksStored(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    """A chain of consecutive blocks became available in ``tier``."""

    block_hashes: list[int]  # in sequence order; each chains from the one before it
    parent_block_hash: int | None = None  # the block before the first one; None at the start
    token_counts: list[int] = msgspec.field(default_factory=list)  # tokens in each block
    tier: str = DEVICE


class KvBlocksRemoved(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    """Blocks that ``tier`` no longer holds (evicted, or the engine closed)."""

    block_hashes: list[int]
    tier: str = DEVICE


class KvAllCleared(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    """Every block of ``tier`` is gone at once (the engine closed): an index drops this
    instance's entries for the tier without waiting for one removal per block."""

    tier: str = DEVICE


KvEvent = KvBlocksStored | KvBlocksRemoved | KvAllCleared


class KvEventBatch(Message):
    """Events of one TE in the order they happened. seq counts batches from 0 per TE, so
    an index can tell it missed one and rebuild that TE's entries."""

    te_id: str
    model: str
    seq: int
    block_size: int
    events: list[KvEvent]
