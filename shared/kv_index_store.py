"""The durable copy of the global prompt index, in Redis: per model, each TE's block hashes
per tier and the ``seq`` of the last event batch they include.

Each TE is the only writer of its own entries. It writes a batch here before it publishes it,
with a script that applies the batch only if it follows the stored ``seq``; when it does not
(Redis restarted and lost the TE's entries, or a write failed), the TE writes a full snapshot
of what it holds instead. So whenever a job executor reads a TE's entries here, they are at
least as new as every batch it has received, and a replica that saw a gap resyncs from here.
The cluster manager deletes a TE's entries when it declares the TE gone. Nothing here is
state that the TEs cannot rebuild: it is the shared copy a new or restarted job executor
loads, not a source of truth."""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping

from shared.messages.kv import (
    DEVICE,
    HOST,
    KvAllCleared,
    KvBlocksRemoved,
    KvBlocksStored,
    KvEvent,
    KvEventBatch,
)
from shared.store import Store
from shared.subjects import Keys

TIERS = (DEVICE, HOST)
CHUNK = 4096  # members per SADD/SREM (Lua's unpack has a stack limit)

# KEYS: the TEs hash, then one set per tier in TIERS order. ARGV: te id, seq, block size, then
# ops of (op, tier number from 0, count, members...): op S adds, R removes, C clears.
_APPLY = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
local seq = tonumber(ARGV[2])
if cur then
  local prev = tonumber(string.match(cur, '^(%-?%d+)'))
  if prev ~= seq - 1 then return 0 end
elseif seq ~= 0 then
  return 0
end
local i = 4
while i <= #ARGV do
  local op, key, n = ARGV[i], KEYS[tonumber(ARGV[i + 1]) + 2], tonumber(ARGV[i + 2])
  i = i + 3
  if op == 'C' then
    redis.call('DEL', key)
  else
    local cmd = (op == 'S') and 'SADD' or 'SREM'
    local j = i
    while j < i + n do
      local last = math.min(j + 4095, i + n - 1)
      redis.call(cmd, key, unpack(ARGV, j, last))
      j = last + 1
    end
  end
  i = i + n
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ' ' .. ARGV[3])
return 1
"""


def apply_events(tiers: dict[str, set[int]], events: Iterable[KvEvent]) -> None:
    """Keep ``tiers`` (tier -> block hashes) current with events: what a TE holds, for its
    snapshots."""
    for event in events:
        if isinstance(event, KvBlocksStored):
            tiers.setdefault(event.tier, set()).update(event.block_hashes)
        elif isinstance(event, KvBlocksRemoved):
            tiers.get(event.tier, set()).difference_update(event.block_hashes)
        elif isinstance(event, KvAllCleared):
            tiers.pop(event.tier, None)


def pack(block_hash: int) -> bytes:
    return struct.pack("<Q", block_hash)


def unpack(member: bytes) -> int:
    return int(struct.unpack("<Q", member)[0])


class KvIndexStore:
    def __init__(self, store: Store, cluster: str) -> None:
        self._redis = store.redis
        self._keys = Keys(cluster)
        self._apply = self._redis.register_script(_APPLY)

    def _set_keys(self, model: str, te_id: str) -> list[str]:
        return [self._keys.kv_index_blocks(model, te_id, tier) for tier in TIERS]

    async def apply(self, batch: KvEventBatch) -> bool:
        """Write the batch if it follows the stored seq; False: write a snapshot instead."""
        args: list[bytes | str | int] = [batch.te_id, batch.seq, batch.block_size]
        for event in batch.events:
            tier = TIERS.index(event.tier) if event.tier in TIERS else None
            if tier is None:
                continue
            if isinstance(event, KvAllCleared):
                args += ["C", tier, 0]
            elif isinstance(event, KvBlocksStored | KvBlocksRemoved):
                op = "S" if isinstance(event, KvBlocksStored) else "R"
                args += [op, tier, len(event.block_hashes)]
                args += [pack(h) for h in event.block_hashes]
        keys = [self._keys.kv_index_tes(batch.model), *self._set_keys(batch.model, batch.te_id)]
        return bool(await self._apply(keys=keys, args=args))

    async def snapshot(
        self,
        model: str,
        te_id: str,
        seq: int,
        block_size: int,
        tiers: Mapping[str, Iterable[int]],
    ) -> None:
        """Replace the TE's entries with everything it holds as of ``seq``."""
        async with self._redis.pipeline(transaction=True) as p:
            for tier, key in zip(TIERS, self._set_keys(model, te_id), strict=True):
                p.delete(key)
                members = [pack(h) for h in tiers.get(tier, ())]
                for i in range(0, len(members), CHUNK):
                    p.sadd(key, *members[i : i + CHUNK])
            p.hset(self._keys.kv_index_tes(model), te_id, f"{seq} {block_size}")
            await p.execute()

    async def stored_seq(self, model: str, te_id: str) -> int | None:
        raw = await self._redis.hget(self._keys.kv_index_tes(model), te_id)
        return None if raw is None else int(raw.split()[0])

    async def forget(self, model: str, te_id: str) -> None:
        """The TE is gone, or no longer serves the model."""
        async with self._redis.pipeline(transaction=True) as p:
            p.hdel(self._keys.kv_index_tes(model), te_id)
            p.delete(*self._set_keys(model, te_id))
            await p.execute()

    async def tes(self, model: str) -> dict[str, tuple[int, int]]:
        """TE id -> (seq, block size) of every TE with entries for the model."""
        raw = await self._redis.hgetall(self._keys.kv_index_tes(model))
        out = {}
        for k, v in raw.items():
            seq, block_size = v.split()
            out[k.decode() if isinstance(k, bytes) else k] = (int(seq), int(block_size))
        return out

    async def read(self, model: str, te_id: str) -> tuple[int, int, dict[str, set[int]]] | None:
        """(seq, block size, tier -> hashes) of one TE, read atomically; None if absent."""
        keys = self._set_keys(model, te_id)
        async with self._redis.pipeline(transaction=True) as p:
            p.hget(self._keys.kv_index_tes(model), te_id)
            for key in keys:
                p.smembers(key)
            head, *sets = await p.execute()
        if head is None:
            return None
        seq, block_size = head.split()
        tiers = {
            tier: {unpack(m) for m in members} for tier, members in zip(TIERS, sets, strict=True)
        }
        return int(seq), int(block_size), tiers
