"""Prefix caching: KV blocks named by the chained hash of their tokens, shared between requests,
kept after use until their memory is needed, with a host-memory tier behind the device one.

After FlowServe's Relational Tensor Cache (DeepServe): a small API over the block allocator —
match by prefix tokens or by a pinned cache id, allocate / append / free blocks, offload blocks
to host memory and populate them back.

Blocks are named by ``shared.block_hash`` (the spec every engine and the router share).

Ownership. The cache is itself an owner (one reference in the allocator) of every block in its
index. A block nobody else owns is *evictable*: it still serves matches, and it is given up,
least recently used first, only when ``allocate`` finds no unused block. A block in the index is
immutable; a write into it, or into a block another request shares, goes to a copy
(``make_writable``). The host tier holds copies, never originals: a block may be in either tier
or both, and a match that finds a block only on the host populates it back to the device.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import torch

from services.task_executor.engines.torch_engine.kv_cache import NoFreeBlocksError, PagedKVCache
from services.task_executor.engines.torch_engine.scheduler import blocks_for
from shared.block_hash import chain_hashes
from shared.messages.kv import (
    DEVICE,
    HOST,
    KvAllCleared,
    KvBlocksRemoved,
    KvBlocksStored,
    KvEvent,
)


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Cached device blocks handed to a caller, which owns one reference on each and gives it
    back with ``PrefixCache.free``."""

    blocks: list[int]
    block_hashes: list[int]
    num_tokens: int  # tokens the blocks cover: len(blocks) * block_size
    token_ids: tuple[int, ...] = ()  # for a cache id: the token ids it was pinned with
    num_populated: int = 0  # blocks copied back from the host tier to serve this match


@dataclasses.dataclass(frozen=True, slots=True)
class _Pin:
    token_ids: tuple[int, ...]
    match: PrefixMatch


class HostTier:
    """Copies of blocks in host memory, its own capacity and LRU order. Layout
    ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]`` (the export layout)."""

    def __init__(self, num_blocks: int, device_cache: PagedKVCache, *, pin_memory: bool) -> None:
        k0 = device_cache.k[0]
        shape = (len(device_cache.k), 2, num_blocks, *k0.shape[1:])
        self.kv = torch.zeros(shape, dtype=k0.dtype, pin_memory=pin_memory)
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))
        self._slots: collections.OrderedDict[int, tuple[int, int | None]] = (
            collections.OrderedDict()
        )  # hash -> (slot, parent hash), least recently used first

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def slot(self, block_hash: int) -> int:
        self._slots.move_to_end(block_hash)
        return self._slots[block_hash][0]

    def parent(self, block_hash: int) -> int | None:
        return self._slots[block_hash][1]

    def reserve(self, block_hash: int, parent: int | None) -> tuple[int, int | None]:
        """A slot for a new hash, and the hash evicted to make room (or None)."""
        evicted = None
        if not self._free:
            evicted, (slot, _) = self._slots.popitem(last=False)
            self._free.append(slot)
        slot = self._free.pop()
        self._slots[block_hash] = (slot, parent)
        return slot, evicted

    def hashes(self) -> list[int]:
        return list(self._slots)

    def clear(self) -> None:
        self._free = list(range(self.num_blocks))
        self._slots.clear()


class PrefixCache:
    """Block bookkeeping of one ``PagedKVCache``: reference counts (through its allocator), the
    hash index, LRU eviction, pins, the host tier and the events a router indexes.

    With ``enabled=False`` nothing enters the index, so it is a plain allocator."""

    def __init__(
        self,
        kv: PagedKVCache,
        *,
        enabled: bool = True,
        num_host_blocks: int = 0,
        offload_on_evict: bool = True,
    ) -> None:
        self.kv = kv
        self.enabled = enabled
        self.block_size = kv.block_size
        self._alloc = kv.allocator
        self._hash_of: dict[int, int] = {}  # device block -> hash
        self._parent_of: dict[int, int | None] = {}  # device block -> hash of the block before
        self._block_of: dict[int, int] = {}  # hash -> device block
        # Blocks only the cache owns, least recently used first.
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._pins: dict[str, _Pin] = {}
        self.host: HostTier | None = None
        if enabled and num_host_blocks > 0:
            pin = kv.k[0].device.type == "cuda"  # pinned host memory makes the copies async-able
            self.host = HostTier(num_host_blocks, kv, pin_memory=pin)
        self.offload_on_evict = offload_on_evict
        self._events: list[KvEvent] = []

    # --- sizes -------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    @property
    def num_free(self) -> int:
        """Blocks ``allocate`` can hand out: unused ones and evictable cached ones."""
        return self._alloc.num_free + len(self._evictable)

    @property
    def limit(self) -> int:
        """Blocks the cache may use now (``resize``)."""
        return self.kv.limit

    def resize(self, blocks: int) -> int:
        """Use ``blocks`` blocks from now (``PagedKVCache.resize``): cached blocks only the
        cache holds above the new limit are evicted first (written to the host tier where it
        keeps evicted blocks); blocks requests or pins hold stay, and the limit stays above
        them. Returns the new limit."""
        if blocks < self.kv.limit:
            above = [b for b in self._evictable if b >= blocks]
            for b in above:
                del self._evictable[b]
            if above:
                self._evict(above)
        return self.kv.resize(blocks)

    def ref_count(self, block: int) -> int:
        """Owners of ``block`` other than the cache itself (requests and pins)."""
        return self._alloc.ref_count(block) - (block in self._hash_of)

    def cached_block(self, block_hash: int) -> int | None:
        return self._block_of.get(block_hash)

    # --- lookups -----------------------------------------------------------------------------

    def probe(self, block_hashes: Sequence[int]) -> tuple[int, int]:
        """Without side effects: (how many leading blocks a match would find in either tier,
        how many of those are on the device and owned by someone, so cost no free block)."""
        if not self.enabled:
            return 0, 0
        found = in_use = 0
        for h in block_hashes:
            b = self._block_of.get(h)
            if b is not None:
                in_use += self.ref_count(b) > 0
            elif self.host is None or h not in self.host:
                break
            found += 1
        return found, in_use

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """The longest cached prefix of ``token_ids`` in whole blocks; the caller owns the
        returned blocks."""
        return self.match_hashes(chain_hashes(token_ids, self.block_size))

    def match_hashes(self, block_hashes: Sequence[int]) -> PrefixMatch:
        blocks: list[int] = []
        populated = 0
        if self.enabled:
            for h in block_hashes:
                b = self._block_of.get(h)
                if b is None:
                    if self.host is None or h not in self.host:
                        break
                    b = self._populate_one(h)
                    if b is None:
                        break
                    populated += 1
                self._acquire(b)
                blocks.append(b)
        return PrefixMatch(
            blocks=blocks,
            block_hashes=list(block_hashes[: len(blocks)]),
            num_tokens=len(blocks) * self.block_size,
            num_populated=populated,
        )

    def pin(self, cache_id: str, token_ids: Sequence[int]) -> int:
        """Keep the cached prefix of ``token_ids`` on the device under ``cache_id`` until
        ``unpin`` (re-pinning an id replaces it). Returns the tokens the pin covers: only what
        is cached now, so a caller computes the prefix first (a request with max_tokens=1)."""
        self.unpin(cache_id)
        match = self.match_prefix(token_ids)
        self._pins[cache_id] = _Pin(tuple(token_ids), match)
        return match.num_tokens

    def unpin(self, cache_id: str) -> bool:
        pin = self._pins.pop(cache_id, None)
        if pin is None:
            return False
        self.free(pin.match.blocks)
        return True

    def match_cache_id(self, cache_id: str) -> PrefixMatch | None:
        """The pinned blocks (the caller owns a reference on each) and the token ids pinned."""
        pin = self._pins.get(cache_id)
        if pin is None:
            return None
        self._alloc.fork(pin.match.blocks)
        return dataclasses.replace(
            pin.match, blocks=list(pin.match.blocks), token_ids=pin.token_ids, num_populated=0
        )

    # --- blocks ------------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks, evicting least recently used cached blocks when no unused ones
        are left."""
        short = n - self._alloc.num_free
        if short > len(self._evictable):
            raise NoFreeBlocksError(f"asked for {n} blocks, {self.num_free} free")
        if short > 0:
            self._evict([self._evictable.popitem(last=False)[0] for _ in range(short)])
        return self._alloc.allocate(n)

    def append(self, blocks: list[int], num_tokens: int) -> None:
        """Grow a block table in place to cover ``num_tokens``."""
        missing = blocks_for(num_tokens, self.block_size) - len(blocks)
        if missing > 0:
            blocks.extend(self.allocate(missing))

    def free(self, blocks: Sequence[int]) -> None:
        """Give back one reference on each block."""
        # Tail first: a sequence's last blocks are the least likely to be shared, so they
        # should be the first evicted.
        for b in reversed(blocks):
            self._alloc.free([b])
            if b in self._hash_of and self._alloc.ref_count(b) == 1:
                self._evictable[b] = None

    def make_writable(self, blocks: list[int], start_pos: int, end_pos: int) -> int:
        """Copy-on-write: before positions ``[start_pos, end_pos)`` are written, replace every
        block they touch that is shared or in the index by a private copy. Returns the number
        of blocks copied."""
        copied = 0
        bs = self.block_size
        for i in range(start_pos // bs, blocks_for(end_pos, bs)):
            b = blocks[i]
            if b not in self._hash_of and self._alloc.ref_count(b) <= 1:
                continue
            (new,) = self.allocate(1)  # b is owned by the caller, so it cannot be evicted here
            for layer in range(len(self.kv.k)):
                self.kv.k[layer][new] = self.kv.k[layer][b]
                self.kv.v[layer][new] = self.kv.v[layer][b]
            self.free([b])
            blocks[i] = new
            copied += 1
        return copied

    def commit(
        self,
        blocks: Sequence[int],
        block_hashes: Sequence[int],
        num_computed_tokens: int,
        num_committed: int,
    ) -> int:
        """Index a sequence's blocks that are full and computed, from ``num_committed`` (the
        count returned last time) on; return the new count. A hash already indexed under
        another block (two requests computed the same prefix at once) leaves this block
        private."""
        upto = min(len(block_hashes), num_computed_tokens // self.block_size)
        if not self.enabled or upto <= num_committed:
            return max(num_committed, upto)
        stored: list[tuple[int, int | None]] = []
        for i in range(num_committed, upto):
            h, b = block_hashes[i], blocks[i]
            if h in self._block_of or b in self._hash_of:
                continue
            parent = block_hashes[i - 1] if i else None
            self._alloc.fork([b])
            self._hash_of[b], self._parent_of[b], self._block_of[h] = h, parent, b
            stored.append((h, parent))
        self._emit_stored(stored, DEVICE)
        return upto

    # --- host tier ---------------------------------------------------------------------------

    def offload(self, block_hashes: Sequence[int]) -> int:
        """Copy the device blocks with these hashes to the host tier (those not there yet);
        returns how many were copied. Hashes not on the device are skipped."""
        if self.host is None:
            raise RuntimeError("this cache has no host tier")
        blocks = []
        for h in dict.fromkeys(block_hashes):
            if h in self.host:
                self.host.slot(h)  # refresh its LRU position
            elif h in self._block_of:
                blocks.append(self._block_of[h])
        return self._copy_to_host(blocks)

    def populate(self, block_hashes: Sequence[int]) -> int:
        """Copy host-tier blocks with these hashes back into device blocks (cached, evictable);
        returns how many were copied. Stops early when the device has no free block."""
        n = 0
        for h in block_hashes:
            if self.host is None or h in self._block_of or h not in self.host:
                continue
            if self._populate_one(h) is None:
                break
            n += 1
        return n

    # --- events and teardown -----------------------------------------------------------------

    def drain_events(self) -> list[KvEvent]:
        events, self._events = self._events, []
        return events

    def clear(self) -> None:
        """Forget every cached block (the engine is closing); pins and owners are dropped."""
        if self._block_of:
            self._events.append(KvAllCleared(tier=DEVICE))
        if self.host is not None and len(self.host):
            self._events.append(KvAllCleared(tier=HOST))
            self.host.clear()
        self._hash_of.clear()
        self._parent_of.clear()
        self._block_of.clear()
        self._evictable.clear()
        self._pins.clear()

    # --- internals ---------------------------------------------------------------------------

    def _acquire(self, block: int) -> None:
        self._alloc.fork([block])
        self._evictable.pop(block, None)

    def _evict(self, blocks: list[int]) -> None:
        if self.host is not None and self.offload_on_evict:
            self._copy_to_host([b for b in blocks if self._hash_of[b] not in self.host])
        hashes = []
        for b in blocks:
            h = self._hash_of.pop(b)
            del self._parent_of[b], self._block_of[h]
            hashes.append(h)
        self._alloc.free(blocks)
        self._events.append(KvBlocksRemoved(block_hashes=hashes, tier=DEVICE))

    def _copy_to_host(self, blocks: list[int]) -> int:
        assert self.host is not None
        # More than the tier holds: keep the most recently used, which come last (and a batch
        # then never evicts its own entries).
        blocks = blocks[-self.host.num_blocks :]
        if not blocks:
            return 0
        slots, stored, removed = [], [], []
        for b in blocks:
            h, parent = self._hash_of[b], self._parent_of[b]
            slot, evicted = self.host.reserve(h, parent)
            slots.append(slot)
            stored.append((h, parent))
            if evicted is not None:
                removed.append(evicted)
        src = torch.tensor(blocks, device=self.kv.k[0].device)
        dst = torch.tensor(slots)
        for layer, (k, v) in enumerate(zip(self.kv.k, self.kv.v, strict=True)):
            self.host.kv[layer, 0].index_copy_(0, dst, k.index_select(0, src).cpu())
            self.host.kv[layer, 1].index_copy_(0, dst, v.index_select(0, src).cpu())
        if removed:
            self._events.append(KvBlocksRemoved(block_hashes=removed, tier=HOST))
        self._emit_stored(stored, HOST)
        return len(blocks)

    def _populate_one(self, block_hash: int) -> int | None:
        """Copy a host-only block to a new device block, indexed and evictable; None when the
        device is full or the host lost the block while making room."""
        assert self.host is not None
        if self.num_free == 0:
            return None
        # Allocate first: the eviction it may cause writes back to the host tier, which may in
        # turn evict this very hash there.
        (b,) = self.allocate(1)  # the allocator's reference becomes the cache's own
        if block_hash not in self.host:
            self._alloc.free([b])
            return None
        slot, parent = self.host.slot(block_hash), self.host.parent(block_hash)
        for layer, (k, v) in enumerate(zip(self.kv.k, self.kv.v, strict=True)):
            k[b].copy_(self.host.kv[layer, 0, slot], non_blocking=True)
            v[b].copy_(self.host.kv[layer, 1, slot], non_blocking=True)
        self._hash_of[b], self._parent_of[b], self._block_of[block_hash] = block_hash, parent, b
        self._evictable[b] = None
        self._emit_stored([(block_hash, parent)], DEVICE)
        return b

    def _stored(self, run: list[int], parent: int | None, tier: str) -> KvBlocksStored:
        return KvBlocksStored(
            block_hashes=run,
            parent_block_hash=parent,
            token_counts=[self.block_size] * len(run),
            tier=tier,
        )

    def _emit_stored(self, stored: list[tuple[int, int | None]], tier: str) -> None:
        """One KvBlocksStored per run of blocks that chain into each other."""
        run: list[int] = []
        parent: int | None = None
        for h, p in stored:
            if run and p != run[-1]:
                self._events.append(self._stored(run, parent, tier))
                run = []
            if not run:
                parent = p
            run.append(h)
        if run:
            self._events.append(self._stored(run, parent, tier))
