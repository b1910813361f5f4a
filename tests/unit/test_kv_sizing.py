"""KV sized by demand (``services/task_executor/kv_sizing.py``): the demand formula, the
watermarks' hysteresis, the order of a device's resizes, loads and
unloads, and the conditions under which a blocked instance preempts a neighbour (the
request a short pool evicts: ``test_torch_engine.py``, ``victim_index``)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from services.job_executor.shadow import InstanceView
from services.task_executor.kv_sizing import (
    DeviceOp,
    Elsewhere,
    KvSizing,
    Neighbour,
    Preemption,
    demand_tokens,
    elsewhere,
    make_room,
    next_size,
    order_ops,
    preemption,
)
from shared.headroom import RequestView
from tests.unit.exact_perf import EXACT_PERF

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


def test_a_grow_that_does_not_fit_takes_what_is_free_and_waits_for_the_rest():
    ops = [DeviceOp("grow", "a", 600, urgency=1.0), DeviceOp("grow", "b", 10, urgency=2.0)]
    now, wait = order_ops(ops, free_bytes=200)
    assert now == [DeviceOp("grow", "a", 200, urgency=1.0)]
    assert wait == [DeviceOp("grow", "a", 400, urgency=1.0), ops[1]]  # b still behind it
    # A load cannot start on part of its memory: it waits whole.
    now, wait = order_ops([DeviceOp("load", "c", 600)], free_bytes=200)
    assert now == [] and wait == [DeviceOp("load", "c", 600)]


def test_the_books_squeeze_every_other_holder_while_a_grow_waits():
    grow = DeviceOp("grow", "a", 600, urgency=1.0)
    room = make_room(
        [grow], used_bytes=900, budget_bytes=1000, holding={"a": False, "b": False, "c": True}
    )
    assert room.grant == [DeviceOp("grow", "a", 100, urgency=1.0)]
    assert room.wait == [DeviceOp("grow", "a", 500, urgency=1.0)]
    assert room.squeeze == ["b"]  # not a (it waits), not c (told already)
    room = make_room([grow], used_bytes=0, budget_bytes=1000, holding={"b": False})
    assert room.grant == [grow] and room.wait == [] and room.squeeze == []
    room = make_room([grow], used_bytes=10**9, budget_bytes=0, holding={"b": False})
    assert room.grant == [grow] and room.squeeze == []  # no budget: no books to keep


@pytest.mark.parametrize("free", [0, 50])
def test_releases_always_run(free: int):
    now, wait = order_ops([DeviceOp("unload", "x", 10)], free_bytes=free)
    assert [op.kind for op in now] == ["unload"] and wait == []


# --- preemption: an instance blocked from growing and a smaller neighbour -------------------


def _r(rid: str, **kw: float) -> RequestView:
    values: dict = {"arrival": 0.0, "prompt_tokens": 100, "expected_output": 50}
    values |= {"ttft_slo": 2.0, "tpot_slo": 0.1} | kw
    return RequestView(id=rid, **values)


def _i(name: str, *requests: RequestView) -> InstanceView:
    return InstanceView(name, EXACT_PERF, requests, max_num_seqs=32, max_prefill_tokens=2048)


def _decoding(rid: str) -> RequestView:
    return _r(rid, computed_tokens=100, output_tokens=10)


BIG = _i("big", _decoding("b1"), _decoding("b2"), _decoding("b3"))


def test_a_blocked_instance_preempts_a_smaller_neighbour_whose_requests_fit_elsewhere():
    small = Neighbour(_i("small", _decoding("s1")), model="m2", bytes=600)
    away = Elsewhere((_i("m2-away"),), target="m2-away", model="m2")
    p = preemption(
        BIG, need_bytes=1000, free_bytes=500, neighbours=[small], elsewhere=[away], now=1.0
    )
    assert p == Preemption(neighbour="small", moves={"s1": "m2-away"})


def test_no_preemption_where_a_condition_fails():
    small = Neighbour(_i("small", _decoding("s1")), model="m2", bytes=600)
    away = Elsewhere((_i("m2-away"),), target="m2-away", model="m2")

    def p(**kw):  # type: ignore[no-untyped-def]
        args = {"need_bytes": 1000, "free_bytes": 500, "neighbours": [small], "elsewhere": [away]}
        return preemption(BIG, now=1.0, **(args | kw))

    assert p(free_bytes=1000) is None  # the grow fits: nothing to preempt
    assert p(need_bytes=1200) is None  # its unload would not free enough (600 < 700)
    assert p(elsewhere=[]) is None  # its requests have nowhere to go
    assert p(elsewhere=[dataclasses.replace(away, model="m3")]) is None  # not its model
    # Not smaller: as many requests as the blocked instance.
    same = Neighbour(_i("same", *(_decoding(f"s{k}") for k in range(3))), model="m2", bytes=600)
    assert p(neighbours=[same]) is None
    # Elsewhere is busy: a 3 s prompt due first there makes the moved request's next token
    # (due at 3 s) late, so it stays.
    busy = _i("m2-away", _r("long", prompt_tokens=3000, ttft_slo=1.0, arrival=1.0))
    assert p(elsewhere=[Elsewhere((busy,), target="m2-away", model="m2")]) is None


def test_the_smallest_neighbour_goes_and_moved_requests_see_each_other():
    one = Neighbour(_i("one", _decoding("o1")), model="m2", bytes=800)
    two = Neighbour(_i("two", _decoding("t1"), _decoding("t2")), model="m2", bytes=800)
    away = Elsewhere((_i("m2-away"),), target="m2-away", model="m2")
    p = preemption(BIG, 1000, 500, [two, one], [away], now=1.0)
    assert p is not None and p.neighbour == "one"
    # Two requests of 1,500 tokens to recompute, due at 3 s: the first fits, the second
    # would come after it (3.3 s): the second target takes it.
    long = [_r(f"l{k}", prompt_tokens=1490, computed_tokens=1490, output_tokens=10) for k in (1, 2)]
    pair = Neighbour(_i("pair", *long), model="m2", bytes=800)
    other = Elsewhere((_i("m2-other"),), target="m2-other", model="m2")
    p = preemption(BIG, 1000, 500, [pair], [away, other], now=1.0)
    assert p == Preemption("pair", {"l1": "m2-away", "l2": "m2-other"})
    assert preemption(BIG, 1000, 500, [pair], [away], now=1.0) is None


def test_elsewhere_is_every_instance_of_a_neighbours_model_that_takes_requests():
    there = (_i("m2-a"), _i("m2-prefill"), _i("m3-a"))
    takes = {"m2-a": "m2", "m3-a": "m3"}  # the prefill instance takes no colocated request
    got = elsewhere([(there, takes), ((_i("m2-b"),), {"m2-b": "m2"})], {"m2"})
    assert got == [Elsewhere(there, "m2-a", "m2"), Elsewhere((_i("m2-b"),), "m2-b", "m2")]
    assert elsewhere([(there, takes)], {"m4"}) == []
