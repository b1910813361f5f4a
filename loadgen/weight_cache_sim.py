"""The simulator's model of a node pool's host weight cache
(``services/task_executor/weight_cache``), one entry per model.

The real cache keys engine tensors by content, so models that share tensors (a fine-tuned
variant and its base) share entries; the simulator's models are independent profiles that
share nothing, so one entry per model holds the same bytes and takes the same decisions. A
model is stored whole or not at all: the real store makes room tensor by tensor and may keep
part of a model, but the simulator's entries are what it evicts, and a model that cannot fit
without evicting an entry in use stays uncached, as a tensor does in ``store._store``.

What it keeps mirrors the store's ``index.json``: each entry's size, first seen, last use and
uses (every load and pre-load through the cache, hit or not, counts one, ``_record``); each
model's manifest (its bytes as the last load stored them: what the heartbeats report as
``total_bytes`` even after the entry is evicted, as ``index.residencies`` does). Eviction is
the real ``eviction.choose_victims`` on the entries' ``EntryView``; an entry is in use while a
TE of the pool has its model loading, ready or draining (a TE maps the files it loaded from
for the engine's life, CPU engines at least).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping

from services.task_executor.weight_cache.eviction import EntryView, EvictionConfig, choose_victims
from shared.messages.cluster import CachedWeights


@dataclasses.dataclass(slots=True)
class _Uses:
    first_seen: float
    last_use: float
    uses: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Stored:
    """What one store did: whether the model is in the cache now, and what it evicted."""

    cached: bool
    evicted: tuple[str, ...] = ()
    evicted_bytes: int = 0


class HostCacheModel:
    def __init__(self, budget_bytes: int, eviction: EvictionConfig) -> None:
        self.budget_bytes = budget_bytes
        self.eviction = eviction
        self._sizes: dict[str, int] = {}  # model -> bytes, the entries present
        self._uses: dict[str, _Uses] = {}  # the index's statistics, by model
        self._manifest: dict[str, int] = {}  # model -> bytes as its last load recorded them
        self._report: Mapping[str, CachedWeights] | None = None  # residencies, until a change

    def __contains__(self, model: object) -> bool:
        return model in self._sizes

    def used_bytes(self) -> int:
        return sum(self._sizes.values())

    def free_bytes(self) -> int:
        return max(self.budget_bytes - self.used_bytes(), 0)

    def residencies(self) -> Mapping[str, CachedWeights]:
        """Tangram's S_resident of S for every model recorded, as a heartbeat reports them
        (the same mapping until the cache changes: views share it)."""
        if self._report is None:
            self._report = {
                m: CachedWeights(resident_bytes=self._sizes.get(m, 0), total_bytes=total)
                for m, total in self._manifest.items()
            }
        return self._report

    def entries(self, now: float, in_use: Collection[str]) -> list[EntryView]:
        out = []
        for model, size in self._sizes.items():
            u = self._uses.get(model)
            out.append(
                EntryView(
                    key=model,
                    size=size,
                    first_seen=u.first_seen if u else now,
                    last_use=u.last_use if u else now,
                    uses=u.uses if u else 1,
                    in_use=model in in_use,
                )
            )
        return out

    def store(self, model: str, size: int, now: float, in_use: Collection[str]) -> Stored:
        """A load or pre-load that built or fetched ``model`` stores it (``store._store``):
        room made by the real eviction policy; not cached where it cannot be made."""
        if model in self._sizes:
            return Stored(True)
        victims = choose_victims(
            self.entries(now, in_use), size, self.budget_bytes, now, self.eviction
        )
        if victims is None:
            return Stored(False)
        freed = 0
        for key in victims:
            freed += self._sizes.pop(key)
            self._uses.pop(key, None)
        self._sizes[model] = size
        self._report = None
        return Stored(True, tuple(victims), freed)

    def record(self, model: str, now: float) -> None:
        """The load's use into the index, and the model's manifest (``_record``)."""
        u = self._uses.setdefault(model, _Uses(first_seen=now, last_use=now))
        u.uses += 1
        u.last_use = now
        self._manifest[model] = self._sizes.get(model, 0)
        self._report = None
