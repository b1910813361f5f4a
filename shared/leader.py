"""One decider at a time among a service's replicas (the scaler): a leader lease in Redis with
a fencing number.

Any number of replicas may run; each tries to take the lease every third of its length. The
one holding it decides; the others watch and take over once it lapses (a leader that
stopped, or whose host was cut off, renews no more). Each time the lease changes hands its
``epoch`` grows by one, and every command a leader sends carries the epoch it holds
(``fence``): whoever carries out the command refuses one older than the current epoch
(``stale``), so a deposed leader's late decision (a process paused past its lease, then
waking up) changes nothing.

A leader counts itself as one only until its last successful renewal, as sent, plus 80% of
the lease: with Redis unreachable it stops deciding before another replica can start
(Redis's expiry runs on Redis's clock, the local deadline on the replica's monotonic clock;
only their rates need agree).

Layout (``Keys.leader``): ``<cluster>:leader:<role>`` the holder's id, expiring with the
lease; ``<cluster>:leader:<role>:epoch`` the fencing number."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from shared.logging import get_logger
from shared.store import Store
from shared.subjects import Keys

log = get_logger(__name__)

# KEYS: lease, epoch. ARGV: me, ttl ms. The epoch held (taken or renewed), or 0.
_TAKE = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return tonumber(redis.call('GET', KEYS[2]) or '0')
end
if holder then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return redis.call('INCR', KEYS[2])
"""
# KEYS: lease. ARGV: me.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
VALID_SHARE = 0.8  # of the lease, after a renewal was sent, that a leader trusts it
SCALER = "scaler"  # the scaler's lease: its epoch fences LoadModel, PreloadModel, UnloadModel
CLUSTER_MANAGER = "cluster_manager"  # who pushes the view and tells members down


class LeaderLease:
    """``holder``'s side of ``role``'s lease: ``leading`` says whether it may decide now, and
    ``epoch`` the fence its commands carry."""

    def __init__(
        self,
        store: Store,
        cluster: str,
        role: str,
        holder: str,
        ttl_s: float,
        *,
        on_change: Callable[[bool], None] | None = None,
    ) -> None:
        self._redis = store.redis
        keys = Keys(cluster)
        self._lease, self._epoch_key = keys.leader(role), keys.leader_epoch(role)
        self.role, self.holder, self.ttl_s = role, holder, ttl_s
        self.epoch = 0  # the one held (0: none yet)
        self._valid_until = 0.0  # monotonic
        self._on_change = on_change
        self._was = False

    def leading(self) -> bool:
        return self.epoch > 0 and time.monotonic() < self._valid_until

    async def try_take(self) -> bool:
        """Take or renew the lease; whether this replica leads now."""
        sent = time.monotonic()
        try:
            epoch = int(
                await self._redis.eval(
                    _TAKE, 2, self._lease, self._epoch_key, self.holder, int(self.ttl_s * 1000)
                )
            )
        except RedisError as e:
            log.warning("leader lease not renewed", role=self.role, error=str(e))
            epoch = -1  # unknown: it leads until its last renewal runs out
        if epoch > 0:
            self.epoch, self._valid_until = epoch, sent + self.ttl_s * VALID_SHARE
        elif epoch == 0:
            self._valid_until = 0.0
        self._changed()
        return self.leading()

    async def run(self, stopping: asyncio.Event) -> None:
        """Take or renew every third of the lease until ``stopping``; then let it go."""
        try:
            while not stopping.is_set():
                await self.try_take()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), self.ttl_s / 3)
        finally:
            await self.release()

    async def release(self) -> None:
        """Give the lease up (a clean stop): another replica takes over at once."""
        self._valid_until = 0.0
        self._changed()
        with contextlib.suppress(RedisError, ConnectionError, OSError):
            await self._redis.eval(_RELEASE, 1, self._lease, self.holder)

    def _changed(self) -> None:
        now = self.leading()
        if now != self._was:
            self._was = now
            log.info(
                "leader" if now else "not leader",
                role=self.role,
                holder=self.holder,
                epoch=self.epoch,
            )
            if self._on_change is not None:
                self._on_change(now)


async def stale(store: Store, cluster: str, role: str, fence: int) -> bool:
    """Whether a command ``role``'s leader sent under epoch ``fence`` comes from a deposed
    one (a newer epoch exists). 0: a command from no leader (a test, an operator): never
    stale. Redis unreachable: stale (its sender cannot renew its lease either)."""
    if fence <= 0:
        return False
    try:
        current = await store.redis.get(Keys(cluster).leader_epoch(role))
    except RedisError:
        return True
    return fence < int(current or 0)
