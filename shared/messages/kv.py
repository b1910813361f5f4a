"""KV cache events: what entered and left each instance's prefix cache, so a router can
keep a global prompt index. Sent in batches, never one message per block."""

from __future__ import annotations

import msgspec

from shared.messages.base import Message


class KvBlocksStored(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    block_hashes: list[int]  # chained: each hash covers every token before it
    parent_block_hash: int | None = None
    token_counts: list[int] = msgspec.field(default_factory=list)
    tier: str = "device"


class KvBlocksRemoved(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    block_hashes: list[int]
    tier: str = "device"


class KvAllCleared(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    tier: str = "device"


class KvEventBatch(Message):
    """Events of one TE in the order they happened. seq counts batches from 0 per TE, so
    an index can tell it missed one and rebuild that TE's entries."""

    te_id: str
    model: str
    seq: int
    block_size: int
    events: list[KvBlocksStored | KvBlocksRemoved | KvAllCleared]
