"""A TE's prefix-cache events on their way out: collected from the engine after each
iteration, published in batches (at most one message per ``KV_FLUSH_S``) on the TE's
``kv_events`` subject for the job executors' prompt indexes, and written to Redis first
(``KvIndexStore``: the durable copy a replica resyncs from; this TE is its only writer).
Every ``KV_CHECK_S`` the store is checked to still hold this TE's entries (Redis may have
restarted and lost them while no batch was due) and rewritten whole where it does not."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from services.task_executor.engines.capabilities import KvEventSource
from shared.bus import Bus
from shared.errors import PeerUnreachable
from shared.kv_index_store import KvIndexStore, apply_events
from shared.logging import get_logger
from shared.messages.kv import KvEvent, KvEventBatch
from shared.store import Store
from shared.subjects import Subjects

log = get_logger(__name__)

KV_FLUSH_S = 0.05  # prefix-cache events are published at most this often, as one batch
KV_CHECK_S = 2.0


class KvEventPublisher:
    def __init__(
        self,
        *,
        te_id: str,
        bus: Bus,
        subjects: Subjects,
        store: Store | None,
        cluster: str,
        model: Callable[[], str | None],
    ) -> None:
        """``model``: the model loaded now (the batches' model; None: nothing to publish)."""
        self._te_id = te_id
        self._bus = bus
        self._subject = subjects.kv_events(te_id)
        self._store = KvIndexStore(store, cluster) if store is not None else None
        self._model = model
        self._pending: list[KvEvent] = []
        self._held: dict[str, set[int]] = {}  # tier -> block hashes, as published
        self._stored_ok = True  # the last write to the store went through
        self.block_size = 0  # of the model loaded (its engine's KV blocks)
        self._seq = 0  # batches published by this TE, across every model it loads

    def collect(self, source: KvEventSource | None) -> None:
        """The engine's events since the last iteration (``source``: its ``kv_events``
        capability; None: an engine without)."""
        if source is not None:
            self._pending.extend(source.drain_kv_events())

    async def run(self) -> None:
        checked = time.monotonic()
        while True:
            await asyncio.sleep(KV_FLUSH_S)
            await self.flush()
            if time.monotonic() - checked >= KV_CHECK_S:
                checked = time.monotonic()
                await self._check_store()

    async def flush(self) -> None:
        model = self._model()
        if not self._pending or model is None:
            return
        batch = KvEventBatch(
            te_id=self._te_id,
            model=model,
            seq=self._seq,
            block_size=self.block_size,
            events=self._pending,
        )
        self._pending = []
        self._seq += 1
        apply_events(self._held, batch.events)
        await self._write(batch)  # before publishing: a replica resyncing reads it there
        try:
            await self._bus.publish(self._subject, batch)
        except PeerUnreachable as e:
            log.warning("kv event publish failed", error=str(e))

    async def forget(self, model: str) -> None:
        """The model is unloaded: its entries leave the store (replicas drop them on the
        view)."""
        self._held = {}
        if self._store is not None:
            try:
                await self._store.forget(model, self._te_id)
            except Exception as e:  # the cluster manager forgets it when the TE goes
                log.warning("prompt index store forget failed", error=str(e))

    async def _write(self, batch: KvEventBatch) -> None:
        if self._store is None:
            return
        try:
            if not (self._stored_ok and await self._store.apply(batch)):
                await self._store.snapshot(
                    batch.model, self._te_id, batch.seq, batch.block_size, self._held
                )
            self._stored_ok = True
        except Exception as e:  # Redis away: the next batch writes a snapshot
            if self._stored_ok:
                log.warning("prompt index store write failed", error=str(e))
            self._stored_ok = False

    async def _check_store(self) -> None:
        model = self._model()
        if self._store is None or model is None or not self.block_size or self._seq == 0:
            return
        try:
            stored = await self._store.stored_seq(model, self._te_id)
            if stored != self._seq - 1:
                log.info("prompt index entries rewritten", stored_seq=stored, seq=self._seq - 1)
                await self._store.snapshot(
                    model, self._te_id, self._seq - 1, self.block_size, self._held
                )
            self._stored_ok = True
        except Exception as e:
            if self._stored_ok:
                log.warning("prompt index store check failed", error=str(e))
            self._stored_ok = False
