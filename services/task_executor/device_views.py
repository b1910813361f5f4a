"""Node pools tell each other what their shared devices hold (``MESHSERVE_KV_PREEMPTION``),
so that a pool whose TE cannot grow its KV pool may preempt a neighbour whose requests
validate on another pool's device (``DeviceArbiter.preempt_blocked``, LLM-Mesh).

A device arbiter knows only its own device: the instances of its TEs and the requests they
hold, as shadow validation plays them. Twice a second each pool publishes that
(``DeviceSnapshot``, its arbiter's ``snapshots``) and keeps the latest it heard from every
other pool's devices; the same beat then looks for a blocked grow on its own devices, with
those as the places a neighbour's requests could go. A snapshot older than ``FRESH_S`` is not
used: its pool stopped (or the bus lost it), and its instances may be gone.

Clocks: a snapshot's times are its host's monotonic seconds; they are moved onto this host's
by the gap between the snapshot's ``at`` and when it came (``snapshot_views``), so the
milliseconds it travelled count as not having passed."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping, Sequence

from services.job_executor.shadow import InstanceView
from services.task_executor.device_arbiter import DeviceArbiter, snapshot_views
from shared.bus import Bus
from shared.errors import MeshserveError
from shared.logging import get_logger
from shared.messages.devices import DeviceSnapshot
from shared.subjects import Subjects

log = get_logger(__name__)

PERIOD_S = 0.5  # how often a pool publishes its devices and looks for a blocked grow
FRESH_S = 2.0  # a snapshot older than this is not used


class DeviceViews:
    def __init__(self, bus: Bus, subjects: Subjects, pool_id: str, arbiter: DeviceArbiter) -> None:
        self._bus, self._subjects = bus, subjects
        self.pool_id = pool_id
        self._arbiter = arbiter
        # (pool, device) -> the latest snapshot and when it came (this host's monotonic)
        self._latest: dict[tuple[str, str], tuple[DeviceSnapshot, float]] = {}

    async def _on_snapshot(self, msg: DeviceSnapshot) -> None:
        if msg.pool_id != self.pool_id:
            self._latest[msg.pool_id, msg.device] = (msg, time.monotonic())

    def others(self, now: float) -> list[tuple[Sequence[InstanceView], Mapping[str, str]]]:
        """Other pools' devices heard from within ``FRESH_S``, on this host's clock."""
        for key, (_, came) in list(self._latest.items()):
            if now - came > FRESH_S:
                del self._latest[key]
        return [snapshot_views(s, came) for s, came in self._latest.values()]

    async def beat(self) -> None:
        """Publish this pool's devices; preempt for a grow blocked on one of them."""
        for snapshot in self._arbiter.snapshots(self.pool_id):
            with contextlib.suppress(MeshserveError):
                await self._bus.publish(self._subjects.device_views(), snapshot)
        now = time.monotonic()
        self._arbiter.preempt_blocked(self.others(now), now)

    async def run(self) -> None:
        sub = await self._bus.subscribe(
            self._subjects.device_views(), {DeviceSnapshot: self._on_snapshot}
        )
        try:
            while True:
                await self.beat()
                await asyncio.sleep(PERIOD_S)
        finally:
            with contextlib.suppress(Exception):
                await sub.close()
