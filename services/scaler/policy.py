"""Scaling decisions. Pure: observed state in, actions out.

Scale from zero: a model with fresh demand and no instance (ready or loading) gets an
idle pre-warmed TE, preferring the node pool with the most idle TEs (it has the most
room left); after failed loads, the next try waits an exponential backoff. Scale to zero: a ready TE with nothing running or waiting and no activity
for keep_alive is unloaded."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence

from shared.messages.cluster import TEHeartbeat, TEState


@dataclasses.dataclass(frozen=True, slots=True)
class ScalerConfig:
    keep_alive_s: float
    demand_ttl_s: float = 10.0  # a demand older than this is forgotten
    backoff_base_s: float = 2.0  # wait after a model's first failed load, doubled per failure
    backoff_max_s: float = 60.0


def load_backoff(failures: int, cfg: ScalerConfig) -> float:
    """Seconds to wait before loading a model again after `failures` failed loads in a row."""
    if failures <= 0:
        return 0.0
    return min(cfg.backoff_max_s, cfg.backoff_base_s * 2.0 ** (failures - 1))


@dataclasses.dataclass(frozen=True, slots=True)
class Load:
    te_id: str
    model: str


@dataclasses.dataclass(frozen=True, slots=True)
class Unload:
    te_id: str
    model: str


Action = Load | Unload


def decide(
    tes: Sequence[TEHeartbeat],
    demands: Mapping[str, float],  # model -> unix time of the newest demand
    pending: Mapping[str, str],  # te_id -> model, loads sent but not yet in the view
    *,
    now: float,
    cfg: ScalerConfig,
    failed: Mapping[str, tuple[int, float]] | None = None,  # model -> (failures, last at)
) -> list[Action]:
    actions: list[Action] = []
    serving = {te.model for te in tes if te.state in (TEState.READY, TEState.LOADING)}
    serving |= set(pending.values())
    idle = [te for te in tes if te.state == TEState.IDLE and te.te_id not in pending]
    idle_per_pool = Counter(te.pool_id for te in idle)
    failed = failed or {}
    for model in sorted(m for m, at in demands.items() if now - at <= cfg.demand_ttl_s):
        if model in serving or not idle:
            continue
        count, last = failed.get(model, (0, 0.0))
        if now - last < load_backoff(count, cfg):
            continue
        te = max(idle, key=lambda t: (idle_per_pool[t.pool_id], t.te_id))
        idle.remove(te)
        idle_per_pool[te.pool_id] -= 1
        actions.append(Load(te_id=te.te_id, model=model))
        serving.add(model)
    for te in tes:
        if (
            te.state == TEState.READY
            and te.model is not None
            and te.running + te.waiting == 0
            and now - te.last_active > cfg.keep_alive_s
            and now - demands.get(te.model, 0.0) > cfg.keep_alive_s
        ):
            actions.append(Unload(te_id=te.te_id, model=te.model))
    return actions
