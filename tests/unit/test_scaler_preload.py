"""Pre-loading: a model with recent demand goes into the host cache of the pool its next
instance would take, within the cache's room, never taking the last idle TE of a pool."""

from __future__ import annotations

import dataclasses

from services.scaler.preload import Preload, preloads
from services.scaler.state import ScalerConfig, ScalerState
from services.views import TEView
from shared.messages.cluster import CachedWeights, TEState
from tests.unit.test_scaler_policy import CFG, T0, cached, fresh, idle, te, with_traffic

GB = 1 << 30


def _room(t: TEView, free: int = 4 * GB) -> TEView:
    return dataclasses.replace(t, cache_free_bytes=free)


def _recent(model: str = "m", ago: float = 60.0) -> ScalerState:
    return with_traffic(fresh(), seconds=2, rps=1, model=model, start=T0 - ago - 2)


def test_a_recently_used_model_goes_to_the_pool_its_next_instance_would_take() -> None:
    tes = [
        cached(te("a0", pool="A", model="x"), "10.0.0.1:7", m=(GB, GB)),  # A's cache holds m
        _room(idle("b1", pool="B")),
        _room(idle("b2", pool="B")),
    ]
    out = preloads(_recent(), tes, models=["m", "x"], now=T0, cfg=CFG)
    # B takes m's next instance; its second idle TE pre-loads, forking from A.
    assert out == [Preload("b2", "m", "B", "predicted", "10.0.0.1:7")]
    # Sent once: not again within the window (a failed one is not retried every tick).
    state = _recent()
    recently = {("m", "B"): T0 - 5}
    assert preloads(state, tes, models=["m", "x"], now=T0, cfg=CFG, tried=recently) == []
    long_ago = {("m", "B"): T0 - CFG.preload_window_s - 1}
    assert preloads(state, tes, models=["m", "x"], now=T0, cfg=CFG, tried=long_ago) == out


def test_nothing_where_the_cache_holds_it_or_lacks_room_or_one_te_is_idle() -> None:
    a0 = cached(te("a0", pool="A", model="x"), "10.0.0.1:7", m=(GB, GB))
    b = [_room(idle("b1", pool="B")), _room(idle("b2", pool="B"))]
    state = _recent()
    holds = [a0, *(cached(t, "10.0.0.2:7", m=(GB, GB)) for t in b)]
    assert preloads(state, holds, models=["m"], now=T0, cfg=CFG) == []
    no_room = [a0, *(_room(t, GB // 2) for t in b)]
    assert preloads(state, no_room, models=["m"], now=T0, cfg=CFG) == []
    assert preloads(state, [a0, b[0]], models=["m"], now=T0, cfg=CFG) == []


def test_nothing_for_stale_unknown_or_while_another_preload_runs() -> None:
    a0 = cached(te("a0", pool="A", model="x"), "10.0.0.1:7", m=(GB, GB))
    b = [_room(idle("b1", pool="B")), _room(idle("b2", pool="B"))]
    stale = _recent(ago=CFG.preload_window_s + 10)
    assert preloads(stale, [a0, *b], models=["m"], now=T0, cfg=CFG) == []
    unknown = _recent(model="n")  # no host has ever cached n: its size is unknown
    assert preloads(unknown, [a0, *b], models=["n"], now=T0, cfg=CFG) == []
    busy = [a0, *b, dataclasses.replace(idle("c1", pool="C"), state=TEState.PRELOADING)]
    assert preloads(_recent(), busy, models=["m"], now=T0, cfg=CFG) == []
    off = dataclasses.replace(CFG, preload_window_s=0)
    assert preloads(_recent(), [a0, *b], models=["m"], now=T0, cfg=off) == []


def test_partially_cached_needs_only_the_missing_bytes_of_room() -> None:
    half = CachedWeights(resident_bytes=GB // 2, total_bytes=GB)
    b = [
        dataclasses.replace(_room(idle(f"b{i}", pool="B"), GB // 2), cached_weights={"m": half})
        for i in (1, 2)
    ]
    a0 = cached(te("a0", pool="A", model="x"), "10.0.0.1:7", m=(GB, GB))
    out = preloads(_recent(), [a0, *b], models=["m"], now=T0, cfg=ScalerConfig())
    assert [p.model for p in out] == ["m"]
