"""A job executor's replica of the global prompt index, kept current from the TEs' KV event
batches and loaded from (and resynced with) the durable copy in Redis.

- Every JE subscribes to every TE's batches (not a queue group: each replica needs all).
- A model's entries are loaded from Redis the first time a view shows it served, so a JE
  that starts or restarts routes on what the TEs already hold.
- A batch out of sequence (one was lost, or the TE is new to this replica) marks the TE for
  a resync: its entries are read again from Redis, which holds every batch the TE has
  published (it writes there first). Batches that arrive meanwhile are applied after it
  if they follow, and otherwise lead to the next resync.
- A TE that leaves the view, or stops serving the model, is dropped from the replica.
- When Redis is unreachable the replica keeps what it has and goes on applying batches;
  resyncs are retried.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from services.job_executor.prompt_index import ModelIndex, PromptIndex
from shared.block_hash import adapter_root, chain_hashes
from shared.bus import Bus
from shared.kv_index_store import KvIndexStore
from shared.logging import get_logger
from shared.messages.cluster import ClusterView, TEState
from shared.messages.kv import KvEventBatch
from shared.runner import Lifecycle
from shared.subjects import Subjects

log = get_logger(__name__)

RESYNC_RETRY_S = 1.0
EXPIRE_EVERY_S = 5.0
SERVING = (TEState.READY, TEState.LOADING, TEState.DRAINING)


class IndexFeed:
    def __init__(
        self,
        bus: Bus,
        subjects: Subjects,
        store: KvIndexStore | None,
        *,
        fallback_block_size: int,
    ) -> None:
        self._bus = bus
        self._subjects = subjects
        self._store = store
        self.index = PromptIndex()
        self._fallback_block_size = fallback_block_size
        self._life: Lifecycle | None = None
        self._loaded: set[str] = set()  # models read from the store once
        self._resyncing: set[tuple[str, str]] = set()
        self._evented: dict[str, bool] = {}  # te -> its engine publishes KV events
        self._last_expire = 0.0
        self.resyncs = 0

    async def start(self, life: Lifecycle) -> None:
        self._life = life
        await self._bus.subscribe(self._subjects.all_kv_events(), {KvEventBatch: self._on_batch})

    # -- events ------------------------------------------------------------------------

    async def _on_batch(self, batch: KvEventBatch) -> None:
        if (batch.model, batch.te_id) in self._resyncing:
            return  # the resync reads a state at least this new
        index = self.index.of(batch.model, batch.block_size)
        applied = index.apply(batch)
        if applied.gap:
            self._resync(batch.model, batch.te_id)

    def _resync(self, model: str, te_id: str) -> None:
        key = (model, te_id)
        if self._store is None or self._life is None or key in self._resyncing:
            return
        self._resyncing.add(key)
        self._life.spawn(
            self._resync_from_store(model, te_id), name="prompt index resync", one_shot=True
        )

    async def _resync_from_store(self, model: str, te_id: str) -> None:
        assert self._store is not None
        try:
            while True:
                try:
                    got = await self._store.read(model, te_id)
                except Exception as e:  # Redis is away: keep what we have, try again
                    log.warning("prompt index resync failed", te=te_id, error=str(e))
                    await asyncio.sleep(RESYNC_RETRY_S)
                    continue
                break
            if got is None:
                return  # nothing stored (yet): its next batch starts it, or a snapshot does
            seq, block_size, tiers = got
            self.index.of(model, block_size).load(te_id, seq, tiers)
            self.resyncs += 1
            log.debug("prompt index resynced", model=model, te=te_id, seq=seq)
        finally:
            self._resyncing.discard((model, te_id))

    # -- the cluster view --------------------------------------------------------------

    def on_view(self, view: ClusterView) -> None:
        serving: dict[str, set[str]] = {}
        for te in view.tes:
            if te.model is not None and te.state in SERVING:
                serving.setdefault(te.model, set()).add(te.te_id)
                caps = te.engine_capabilities
                self._evented[te.te_id] = bool(caps is not None and caps.kv_events)
        for model, te_id in self.index.retain(serving):
            log.debug("prompt index dropped a TE", model=model, te=te_id)
        alive = {te.te_id for te in view.tes}
        for te_id in [t for t in self._evented if t not in alive]:
            del self._evented[te_id]
        for model in serving:
            if model not in self._loaded and self._store is not None and self._life is not None:
                self._loaded.add(model)
                self._life.spawn(
                    self._load_model(model, serving[model]), name="prompt index load", one_shot=True
                )

    async def _load_model(self, model: str, te_ids: set[str]) -> None:
        assert self._store is not None
        try:
            stored = await self._store.tes(model)
        except Exception as e:
            log.warning("prompt index load failed", model=model, error=str(e))
            self._loaded.discard(model)  # the next view tries again
            return
        for te_id in stored:
            if te_id in te_ids:
                self._resync(model, te_id)

    # -- reading -----------------------------------------------------------------------

    def block_size(self, model: str) -> int:
        index = self.index.get(model)
        return index.block_size if index is not None else self._fallback_block_size

    def prompt_hashes(self, model: str, token_ids: Sequence[int], adapter: str = "") -> list[int]:
        """The prompt's block hashes as its TEs' caches key them: under a LoRA adapter, a
        chain of its own (``adapter_root``)."""
        return chain_hashes(token_ids, self.block_size(model), root=adapter_root(adapter))

    def cached_tokens(
        self, model: str, hashes: Sequence[int], te_ids: Sequence[str]
    ) -> dict[str, int]:
        """Leading prompt tokens each TE holds (0 for one the index does not know)."""
        index = self.index.get(model)
        if index is None or not hashes:
            return {}
        now = time.time()
        if now - self._last_expire > EXPIRE_EVERY_S:
            self._last_expire = now
            for each in self.index.models.values():
                each.expire(now)
        blocks = index.match(hashes, te_ids)
        return {te: n * index.block_size for te, n in blocks.items() if n}

    def placed(self, model: str, te_id: str, hashes: Sequence[int], *, ttl_s: float) -> None:
        """A prompt went to ``te_id``: if its engine publishes no events, assume it now holds
        the prompt's blocks (a speculative entry, until the TTL or a real event)."""
        if self._evented.get(te_id, True) or not hashes:
            return
        index: ModelIndex = self.index.of(model, self.block_size(model))
        index.speculate(te_id, hashes, now=time.time(), ttl_s=ttl_s)
