"""Which host-cache entries leave when a new one needs room: Tangram's eviction cost over a
view of the entries, a pure function (the cache and the simulator call it alike).

An entry's cost of eviction is what losing it is expected to cost a later load:

    c = p_miss × size / load_bandwidth × α_model

``size / load_bandwidth`` is the time a load that needs the entry again spends bringing it
back; ``p_miss`` the probability that some load needs it within the horizon, from its uses so
far: a Poisson rate (uses over the entry's life), decayed by how long it has sat unused,
``p_miss = 1 − exp(−rate × e^(−idle/horizon) × horizon)``; ``α_model`` the weight of the
models that use it (1 unless the operator says otherwise; the highest of its models). The
cheapest entries go first (ties: least recently used); an entry that a running TE maps is
never a candidate, and when the entries that may go cannot free enough, nothing is evicted.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True, slots=True)
class EntryView:
    key: str
    size: int  # bytes it occupies
    first_seen: float  # unix seconds it entered the cache
    last_use: float  # unix seconds a load last used it
    uses: int  # loads that used it (the one that stored it included)
    in_use: bool  # mapped by a running TE
    alpha: float = 1.0


@dataclasses.dataclass(frozen=True, slots=True)
class EvictionConfig:
    load_bandwidth: float = 1.0e9  # bytes/s a miss brings an entry back at (disk and packing)
    horizon_s: float = 600.0  # how far ahead p_miss looks


def miss_probability(entry: EntryView, now: float, horizon_s: float) -> float:
    life = max(now - entry.first_seen, horizon_s / 10)
    idle = max(now - entry.last_use, 0.0)
    rate = max(entry.uses, 1) / life * math.exp(-idle / horizon_s)
    return 1.0 - math.exp(-rate * horizon_s)


def eviction_cost(entry: EntryView, now: float, cfg: EvictionConfig) -> float:
    p = miss_probability(entry, now, cfg.horizon_s)
    return p * entry.size / cfg.load_bandwidth * entry.alpha


def choose_victims(
    entries: Sequence[EntryView], need: int, budget: int, now: float, cfg: EvictionConfig
) -> list[str] | None:
    """Keys to evict, cheapest first, so that ``need`` more bytes fit in ``budget``; [] when
    they fit already; None when they cannot fit without evicting an entry in use."""
    free = budget - sum(e.size for e in entries)
    if need <= free:
        return []
    if need > budget:
        return None
    order = sorted(
        (e for e in entries if not e.in_use),
        key=lambda e: (eviction_cost(e, now, cfg), e.last_use, e.key),
    )
    victims = []
    for e in order:
        victims.append(e.key)
        free += e.size
        if need <= free:
            return victims
    return None
