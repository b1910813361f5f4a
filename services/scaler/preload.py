"""Pre-loading: which models the scaler puts into a node pool's host weight cache ahead of
demand, a pure function over the policy's view (``services/scaler/state.py`` types) that
places as the policy does (``services/scaler/pools.py``).

A model is predicted to load again while it has had a request within ``preload_window_s``
(it scaled to zero after its keep-alive, or has fewer instances than pools, and its traffic
is recent). Its next instance goes where ``placement_order`` puts it: the idle TEs' pool
that loads it fastest. Where that pool's host cache does not hold all of the model, one idle
TE of the pool pre-loads it (``PreloadModel``: the weights made and stored, no engine), so
that the next load maps them, forked from a pool that holds them where one does
(``fork_source``). Within the budget: only where the pool's cache has room for the model's
bytes (S, as any host reports them) without evicting anything, and only on a pool with
another TE idle, so a load never waits for a pre-load. At most one pre-load a tick, none
while another runs (a TE ``preloading``), none for a model no host has ever cached (its
size is unknown until a first load stores it), and one try per model and pool a window
(``tried``: a pre-load that failed is not retried every tick).

``meshserve-loadgen simulate`` runs this decision each scaler tick as the service does, on
simulated node pools' host caches (``loadgen/simulator.py``), and counts the pre-loads and
the loads that then map their weights.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from services.scaler.pools import best_pool, fork_source, placement_order, pool_index
from services.scaler.state import ScalerConfig, ScalerState
from services.views import TEView
from shared.messages.cluster import TEState


@dataclasses.dataclass(frozen=True, slots=True)
class Preload:
    te_id: str
    model: str
    pool_id: str
    reason: str
    weights_from: str | None = None


def preloads(
    state: ScalerState,
    tes: Sequence[TEView],
    *,
    models: Sequence[str],
    now: float,
    cfg: ScalerConfig,
    tried: Mapping[tuple[str, str], float] | None = None,
) -> list[Preload]:
    """At most one pre-load: the first predicted model (most recent demand first) whose
    next instance's pool lacks it, has room and a spare idle TE, and was not tried there
    within the window (``tried``: (model, pool) -> unix seconds of the last pre-load sent)."""
    if cfg.preload_window_s <= 0 or any(te.state == TEState.PRELOADING for te in tes):
        return []
    idle = [te for te in tes if te.state == TEState.IDLE and te.te_id not in state.pending]
    if len(idle) < 2:
        return []
    predicted = sorted(
        (m for m in models if 0 < now - state.memory(m).last_demand <= cfg.preload_window_s),
        key=lambda m: (-state.memory(m).last_demand, m),
    )
    index = pool_index(tes)  # once: the loop weighs every predicted model
    room: dict[str, int] = {}  # pool -> its cache's free bytes, as its idle TEs report them
    idle_in: dict[str, list[TEView]] = {}
    for te in idle:
        room[te.pool_id] = max(room.get(te.pool_id, 0), te.cache_free_bytes)
        idle_in.setdefault(te.pool_id, []).append(te)
    for model in predicted:
        size = index.size.get(model, 0)
        if size == 0:
            continue
        pool = best_pool(model, idle_in, cfg, index)
        held = index.resident.get((model, pool), 0)
        pool_idle = idle_in[pool]
        if held >= size or len(pool_idle) < 2 or room[pool] < size - held:
            continue
        if now - (tried or {}).get((model, pool), -math.inf) < cfg.preload_window_s:
            continue
        # The pool's last TE in the order: the best one stays for a load.
        te = placement_order(model, pool_idle, tes, cfg, index)[-1]
        return [Preload(te.te_id, model, pool, "predicted", fork_source(model, pool, tes))]
    return []
