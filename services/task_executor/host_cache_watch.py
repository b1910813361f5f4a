"""What this host's weight cache holds, read again whenever the cache's index changes (and
every ``HOST_CACHE_REREAD_S`` whatever). Each TE watches it for its heartbeats (what it
holds of each model, its room: the scaler's ``load_time``, ``fork_source`` and pre-loads);
the node pool that owns the host's weight server watches it too and publishes it into Redis
(``HostCachePublication``, ``Keys.host_cache``: every tensor with its size and uses, each
model's resident bytes, the pool's weight server and free room), once for the pool."""

from __future__ import annotations

import asyncio
import math
import time

import msgspec

from services.task_executor.weight_cache.index import CacheState, budget_bytes, read_state
from shared.logging import get_logger
from shared.settings import Settings
from shared.store import Store
from shared.subjects import Keys

log = get_logger(__name__)

CACHED_WEIGHTS_S = 5.0  # how often the cache's index is looked at for a change
HOST_CACHE_REREAD_S = 60.0


class HostCachePublication:
    """A node pool's host cache in Redis, for the operator and the placement code that
    reads it (``Keys.host_cache``)."""

    def __init__(self, settings: Settings, pool_id: str, store: Store) -> None:
        self._settings = settings
        self._pool_id = pool_id
        self._store = store
        self._keys = Keys(settings.cluster)

    async def write(self, state: CacheState) -> bool:
        """False when Redis did not take it (logged: the next round writes it all again)."""
        enc = msgspec.json.encode
        pool = {
            "server": self._settings.host_cache.server,
            "free_bytes": state.free_bytes,
            "updated_at": time.time(),
        }
        try:
            await self._store.replace_hash(
                self._keys.host_cache(self._pool_id, "tensors"),
                {k: enc(v) for k, v in state.tensors.items()},
            )
            await self._store.replace_hash(
                self._keys.host_cache(self._pool_id, "models"),
                {m: enc(c) for m, c in state.models.items()},
            )
            await self._store.replace_hash(
                self._keys.host_cache(self._pool_id, "pool"),
                {k: str(v).encode() for k, v in pool.items()},
            )
        except Exception as e:
            log.warning("publishing the host cache's metadata failed", error=str(e))
            return False
        return True

    async def lost(self) -> bool:
        """Redis no longer holds this pool's host cache metadata (it restarted without its
        data): written again at the next look, not a minute later."""
        key = self._keys.host_cache(self._pool_id, "pool")
        try:
            return not await self._store.redis.exists(key)
        except Exception:  # Redis away: nothing to write to yet
            return False


class HostCacheWatch:
    def __init__(self, settings: Settings, publication: HostCachePublication | None = None) -> None:
        self._settings = settings
        self._publication = publication
        self.state = CacheState({}, {}, 0)  # as last read
        self._read_at = -math.inf

    async def run(self) -> None:
        seen = 0
        while True:
            await asyncio.sleep(CACHED_WEIGHTS_S)
            try:
                changed = (self._settings.host_cache.dir / "index.json").stat().st_mtime_ns
            except OSError:
                continue
            if (
                changed != seen
                or time.monotonic() - self._read_at >= HOST_CACHE_REREAD_S
                or (self._publication is not None and await self._publication.lost())
            ):
                if await self.read():
                    seen = changed

    async def read(self) -> bool:
        """Read the cache's state (and publish it); False when that failed (logged)."""
        root = self._settings.host_cache.dir
        try:
            state = await asyncio.to_thread(read_state, root, budget_bytes(self._settings))
        except OSError as e:
            log.warning("reading the host cache failed", error=str(e))
            return False
        self.state, self._read_at = state, time.monotonic()
        if self._publication is None:
            return True
        return await self._publication.write(state)
