"""Engine KV events (plain dataclasses) as their wire messages."""

from __future__ import annotations

from services.task_executor.engines.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
)
from shared.messages.kv import KvAllCleared, KvBlocksRemoved, KvBlocksStored

KvWireEvent = KvBlocksStored | KvBlocksRemoved | KvAllCleared


def to_wire(event: KvEvent) -> KvWireEvent:
    if isinstance(event, BlockStored):
        return KvBlocksStored(
            block_hashes=list(event.block_hashes),
            parent_block_hash=event.parent_block_hash,
            token_counts=list(event.token_counts),
            tier=event.tier,
        )
    if isinstance(event, BlockRemoved):
        return KvBlocksRemoved(block_hashes=list(event.block_hashes), tier=event.tier)
    if isinstance(event, AllBlocksCleared):
        return KvAllCleared(tier=event.tier)
    raise TypeError(f"unknown KV event {event!r}")
