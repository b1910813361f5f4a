"""KV sized by demand (``services/task_executor/kv_sizing.py``): the demand formula, the
watermarks' hysteresis, the eviction choice and the order of a device's resizes, loads and
unloads."""

from __future__ import annotations

import math

import pytest

from services.task_executor.kv_sizing import (
    DeviceOp,
    KvSizing,
    demand_tokens,
    evict,
    next_size,
    order_ops,
)
from shared.headroom import RequestView

SIZING = KvSizing(scale=1.0, min_tokens=0, grow_slack=0.25, shrink_slack=0.5, granularity=16)


def test_demand_counts_each_prompt_and_the_longer_of_its_output_and_the_mean():
    # 100 + max(10, 50) + 200 + max(300, 50)
    assert demand_tokens([(100, 10), (200, 300)], 50.0, SIZING) == 650
    s = KvSizing(scale=1.5, min_tokens=1000)
    assert demand_tokens([(100, 10)], 50.0, s) == 1500  # the floor, scaled
    assert demand_tokens([], 50.0, s) == 1500


def test_the_pool_grows_early_and_shrinks_lazily():
    # Slack under w/2 (12.5%): grow at once to demand × 1.25, rounded up to 16 tokens.
    r = next_size(1000, 900.0, now=0.0, over_since=None, sizing=SIZING)
    assert r == type(r)(tokens=1136, over_since=None)  # ceil(1125 / 16) * 16
    # Within the band: as it is.
    assert next_size(1136, 800.0, now=1.0, over_since=None, sizing=SIZING).tokens == 1136
    # Far above demand: only after shrink_after_s of it.
    r = next_size(4000, 800.0, now=10.0, over_since=None, sizing=SIZING)
    assert (r.tokens, r.over_since) == (4000, 10.0)
    r = next_size(4000, 800.0, now=25.0, over_since=r.over_since, sizing=SIZING)
    assert (r.tokens, r.over_since) == (4000, 10.0)
    r = next_size(4000, 800.0, now=40.0, over_since=r.over_since, sizing=SIZING)
    assert (r.tokens, r.over_since) == (1008, None)  # 800 × 1.25 = 1000 → 1008
    # Back inside the band before the timer ran out: the timer restarts.
    r = next_size(4000, 800.0, now=10.0, over_since=None, sizing=SIZING)
    assert (
        next_size(4000, 3000.0, now=20.0, over_since=r.over_since, sizing=SIZING).over_since is None
    )


def test_a_wobbling_demand_never_ping_pongs():
    size, over, changes = 1008, None, 0
    for step in range(200):
        demand = 800.0 * (1 + 0.2 * math.sin(step / 3))  # ±20% around 800
        r = next_size(size, demand, now=float(step), over_since=over, sizing=SIZING)
        changes += r.tokens != size
        size, over = r.tokens, r.over_since
    assert changes <= 1  # one grow to the wobble's peak, then it holds


def _req(rid: str, deadline: float, arrival: float = 0.0) -> RequestView:
    return RequestView(
        id=rid,
        arrival=arrival,
        prompt_tokens=10,
        expected_output=10,
        ttft_slo=deadline - arrival,
        tpot_slo=0.1,
    )


def test_an_under_estimate_evicts_the_request_with_the_most_headroom():
    reqs = [_req("a", 2.0), _req("b", 5.0), _req("c", 3.0)]
    assert evict(reqs, 1.0).id == "b"  # type: ignore[union-attr]
    # Ties: the latest arrival (the least work lost).
    assert evict([_req("old", 5.0, 0.0), _req("new", 5.0, 1.0)], 1.0).id == "new"  # type: ignore[union-attr]
    assert evict([], 0.0) is None


def test_a_grow_never_runs_before_the_shrink_that_makes_its_room():
    ops = [
        DeviceOp("grow", "a", 600, urgency=1.0),
        DeviceOp("shrink", "b", 500),
        DeviceOp("load", "c", 300, urgency=2.0),
        DeviceOp("unload", "d", 100),
    ]
    now, wait = order_ops(ops, free_bytes=200)
    assert [(op.kind, op.instance) for op in now] == [
        ("shrink", "b"),
        ("unload", "d"),
        ("grow", "a"),
    ]  # 200 + 500 + 100 = 800 free: the grow (600) fits, the load (300) no longer
    assert [op.instance for op in wait] == ["c"]


def test_nothing_overtakes_an_op_that_waits():
    ops = [DeviceOp("load", "big", 1000, urgency=1.0), DeviceOp("grow", "small", 10, urgency=2.0)]
    now, wait = order_ops(ops, free_bytes=100)
    assert now == [] and [op.instance for op in wait] == ["big", "small"]
    now, wait = order_ops(ops, free_bytes=2000)
    assert [op.instance for op in now] == ["big", "small"] and wait == []


@pytest.mark.parametrize("free", [0, 50])
def test_releases_always_run(free: int):
    now, wait = order_ops([DeviceOp("unload", "x", 10)], free_bytes=free)
    assert [op.kind for op in now] == ["unload"] and wait == []
