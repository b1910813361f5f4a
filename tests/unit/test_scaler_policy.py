"""The scaler's policy on hand-built states: scale out on a burst, hysteresis, scale in after
the stable window, min/max, backoff, placement across pools, and no reload after a
keep-alive unload."""

from __future__ import annotations

import dataclasses
import random

import msgspec
import pytest

from services.scaler.policy import Load, Unload, decide, load_backoff
from services.scaler.pools import (
    best_pool,
    fork_source,
    load_time,
    meets_slo,
    placement_order,
    pool_index,
    short_of_room,
)
from services.scaler.state import (
    ModelPolicy,
    ScalerConfig,
    ScalerState,
    observe_capacity,
    observe_outcomes,
    observe_traffic,
    observe_view,
)
from services.scaler.target import target
from services.views import TEView
from shared.messages.cluster import CachedWeights, TEState
from shared.messages.scaling import InstanceCapacity, ModelOutcomes, ModelTraffic
from shared.slo import SLO

T0 = 1_000_000.0
# One instance: 1,000 prompt tokens/s and 100 output tokens/s, 8 sequences at once.
CAP = InstanceCapacity(
    prefill_s=1e-3, prefill_attention_s=0.0, decode_s=0.01, decode_context_s=0.0, max_num_seqs=8
)
CFG = ScalerConfig(
    default=ModelPolicy(min_replicas=0, max_replicas=6, target_utilization=0.5, keep_alive_s=30)
)


def te(
    te_id,
    state=TEState.READY,
    model="m",
    pool="p1",
    running=0,
    waiting=0,
    last_active=T0,
    recent=(),
):
    return TEView(
        te_id=te_id,
        pool_id=pool,
        state=state,
        model=model if state != TEState.IDLE else None,
        running=running,
        waiting=waiting,
        last_active=last_active,
        recent_models=tuple(recent),
    )


def idle(te_id, pool="p1", recent=()):
    return te(te_id, TEState.IDLE, None, pool=pool, recent=recent)


def with_traffic(state, *, seconds, rps, prompt=100, start=T0, model="m", cfg=CFG, output=10):
    """``rps`` requests a second for ``seconds``, reported every half second, each with
    ``output`` tokens once finished."""
    for i in range(round(seconds * 2)):
        now = start + i * 0.5
        n = int(rps * (i + 1) * 0.5) - int(rps * i * 0.5)
        traffic = ModelTraffic(
            model=model, arrivals=n, prompt_tokens=n * prompt, max_output_tokens=n * 64
        )
        state = observe_traffic(state, "je1", [traffic], now=now, cfg=cfg)
        done = ModelOutcomes(model=model, finished=n, slo_met=n, output_tokens=n * output)
        state = observe_outcomes(state, [done], now=now, cfg=cfg)
    return state


def fresh(model="m"):
    return observe_capacity(ScalerState(), model, CAP)


def loads(d):
    return [a for a in d.actions if isinstance(a, Load)]


def unloads(d):
    return [a for a in d.actions if isinstance(a, Unload)]


def test_scale_from_zero_on_the_first_request_even_without_a_profile() -> None:
    s = observe_traffic(
        ScalerState(),
        "je1",
        [ModelTraffic(model="m", arrivals=1, prompt_tokens=10, held=1)],
        now=T0,
        cfg=CFG,
    )
    d = decide(s, [idle("a"), idle("b")], models=["m"], now=T0, cfg=CFG)
    assert loads(d) == [Load("a", "m", "demand")]
    # Sent: the next tick does not load another while it comes.
    d2 = decide(d.state, [idle("a"), idle("b")], models=["m"], now=T0 + 0.5, cfg=CFG)
    assert d2.actions == []


def test_a_burst_scales_out_at_once_from_the_panic_window() -> None:
    # Quiet for a minute at 1 req/s: 100 prompt + 10 output tokens a request is
    # 0.1 + 0.1 = 0.2 instances of work, one instance at 50% target.
    s = with_traffic(fresh(), seconds=60, rps=1)
    tes = [te("r1"), idle("a"), idle("b"), idle("c"), idle("d")]
    now = T0 + 60
    assert decide(s, tes, models=["m"], now=now, cfg=CFG).actions == []
    # Then 10 req/s for 3 s: the panic window sees 2 instances of work, 4 at 50%.
    s = with_traffic(s, seconds=3, rps=10, start=now)
    d = decide(s, tes, models=["m"], now=now + 3, cfg=CFG)
    assert d.targets["m"].panicking and d.targets["m"].reason == "burst"
    assert len(loads(d)) == d.targets["m"].wanted - 1 >= 2


def test_a_queue_scales_out_even_when_the_rates_do_not() -> None:
    s = with_traffic(fresh(), seconds=2, rps=0.5)
    tes = [te("r1", running=8, waiting=12), idle("a"), idle("b"), idle("c")]
    d = decide(s, tes, models=["m"], now=T0 + 2, cfg=CFG)
    # 20 sequences over 8 slots: 3 instances, all of them from the 3 idle TEs.
    assert d.targets["m"].reason == "queue" and d.targets["m"].wanted == 3
    assert len(loads(d)) == 2


def test_a_new_models_stable_load_is_its_rate_not_a_fraction_of_it() -> None:
    """The stable window's rate divides by the seconds the memory has seen the model: ten
    seconds into a new model's traffic, the rate of those ten seconds (never less than the
    panic window's); back from a quiet spell, the whole window."""
    # 5 req/s of 100 prompt + 10 output tokens: 0.5 + 0.5 = 1 instance of work.
    s = with_traffic(fresh(), seconds=10, rps=5)
    t = target("m", s.models["m"], [te("r1")], now=T0 + 10, cfg=CFG)
    assert t.stable_load == pytest.approx(1.0, rel=0.1)  # not a sixth of it
    assert t.wanted == 2  # at 50%
    # The first second: over the panic window (6 s), not over one second.
    s = with_traffic(fresh(), seconds=1, rps=5)
    t = target("m", s.models["m"], [te("r1")], now=T0 + 1, cfg=CFG)
    assert t.stable_load == pytest.approx(t.panic_load, rel=0.01)
    # A model quiet for minutes, then the same ten seconds: a sixth of the window's work.
    s = with_traffic(fresh(), seconds=1, rps=5, start=T0 - 600)
    s = with_traffic(s, seconds=10, rps=5)
    t = target("m", s.models["m"], [te("r1")], now=T0 + 10, cfg=CFG)
    assert t.stable_load == pytest.approx(1.0 / 6, rel=0.15)


def test_steady_load_at_the_threshold_does_not_flap() -> None:
    """A load that asks for exactly two instances, wobbling a little, keeps two: no load
    and no unload for minutes."""
    s = fresh()
    tes = [te("r1"), te("r2"), idle("a")]
    now = T0
    for minute in range(5):
        for k in range(120):
            rps = 5.0 + (0.4 if k % 2 else -0.4)  # ~1 instance of work: 2 at 50%
            s = with_traffic(s, seconds=0.5, rps=rps, start=now)
            now += 0.5
            d = decide(s, tes, models=["m"], now=now, cfg=CFG)
            s = d.state
            assert d.actions == [], (minute, k, d.targets["m"])


def test_scale_in_waits_for_the_stable_window_and_drains_the_least_busy() -> None:
    s = with_traffic(fresh(), seconds=60, rps=1)  # well under one instance
    tes = [te("r1", running=2), te("r2"), te("r3", running=1)]
    now = T0 + 60
    d = decide(s, tes, models=["m"], now=now, cfg=CFG)
    assert d.actions == [] and d.state.models["m"].below_since == now
    s = d.state
    for t in range(1, 60):
        s = with_traffic(s, seconds=1, rps=1, start=now + t - 1)
        d = decide(s, tes, models=["m"], now=now + t, cfg=CFG)
        assert d.actions == [], t
        s = d.state
    s = with_traffic(s, seconds=1, rps=1, start=now + 59)
    d = decide(s, tes, models=["m"], now=now + 60, cfg=CFG)
    assert unloads(d) == [Unload("r2", "m", "load fell"), Unload("r3", "m", "load fell")]
    # Draining TEs are no longer counted: nothing more goes.
    assert decide(d.state, tes, models=["m"], now=now + 61, cfg=CFG).actions == []


@pytest.mark.parametrize("missed", [True, False])
def test_after_slo_misses_scale_in_keeps_the_burst_the_stable_window_saw(missed: bool) -> None:
    """Knative's scale-down delay, after SLO misses: scale-in keeps the most instances the
    panic window asked for within the stable window, so a burst that comes back finds them
    loaded. Where every request met its SLO, the mean's fleet is enough."""
    s = with_traffic(fresh(), seconds=60, rps=1)  # 0.2 instances of work: 1 at 50%
    tes = [te("r1"), te("r2"), te("r3"), te("r4", running=1)]
    now = T0 + 60
    d = decide(s, tes, models=["m"], now=now, cfg=CFG)
    assert d.targets["m"].wanted == 1 and d.targets["m"].peak == 0
    s = d.state
    # A burst: 20 req/s for 6 s, 4 instances of work in the panic window, 8 at 50%; where
    # ``missed``, its first tokens come late.
    for t in range(6):
        s = with_traffic(s, seconds=1, rps=20, start=now + t)
        if missed:
            late = ModelOutcomes(model="m", finished=20, slo_met=0, output_tokens=200)
            s = observe_outcomes(s, [late], now=now + t + 1, cfg=CFG)
        d = decide(s, tes, models=["m"], now=now + t + 1, cfg=CFG)
        assert not unloads(d)
        s = d.state
    now += 6
    assert d.targets["m"].burst == 8 and d.targets["m"].peak == (8 if missed else 0)
    ready, gone = 4, []
    for t in range(1, 200):
        s = with_traffic(s, seconds=1, rps=1, start=now + t - 1)
        d = decide(s, tes, models=["m"], now=now + t, cfg=CFG)
        s = d.state
        tgt = d.targets["m"]
        assert tgt.wanted <= 2  # the burst's arrivals in the stable window, then 1
        if unloads(d):
            ready -= len(unloads(d))
            assert ready >= tgt.peak  # never below the peak
            gone.append((t, sorted(u.te_id for u in unloads(d))))
            tes = [x for x in tes if x.te_id not in gone[-1][1]]
        # The panic window (6 s) keeps an ever smaller part of the burst in sight for 6 s
        # after it; the stable window remembers each of those for 60 s.
        assert len(s.models["m"].peaks) <= 8
    if not missed:  # down to the load's one instance once it stayed low a stable window
        assert gone == [(61, ["r1", "r2", "r3"])], gone
        return
    # The load fell after the burst and stayed low for the stable window, but the burst's
    # asks stay in the peak until 60 s after the panic window saw them: the first instance
    # goes once the peak is under 4 (the least busy first), the rest once the load has
    # stayed low for another stable window (each scale-in restarts it).
    (first, one), (second, two) = gone
    assert 61 <= first <= 67 and second == first + 61, gone
    assert one == ["r1"] and two == ["r2", "r3"]


def test_min_and_max_replicas() -> None:
    cfg = dataclasses.replace(CFG, models={"m": ModelPolicy(min_replicas=2, max_replicas=3)})
    d = decide(fresh(), [idle("a"), idle("b"), idle("c")], models=["m"], now=T0, cfg=cfg)
    assert [a.te_id for a in loads(d)] == ["a", "b"]  # kept warm with no traffic
    s = with_traffic(fresh(), seconds=6, rps=100)  # far more than 3 instances
    tes = [idle(f"i{k}") for k in range(8)]
    d = decide(s, tes, models=["m"], now=T0 + 6, cfg=cfg)
    assert len(loads(d)) == 3 and d.targets["m"].reason == "max_replicas"


def test_keep_alive_unload_is_not_followed_by_a_reload_without_a_request() -> None:
    """The flap this policy replaced: an instance unloaded at keep-alive expiry was loaded
    again at once because the last request's demand was still young."""
    s = with_traffic(fresh(), seconds=1, rps=2)
    last = T0 + 0.5
    tes = [te("r1", last_active=last + 1), idle("a")]
    d = decide(s, tes, models=["m"], now=last + 30.5, cfg=CFG)
    assert d.actions == []  # the request is 30 s old: not idle long enough
    d = decide(d.state, tes, models=["m"], now=last + 31.5, cfg=CFG)
    assert unloads(d) == [Unload("r1", "m", "keep-alive expired")]
    s, settled = observe_view(d.state, [idle("r1"), idle("a")], now=last + 32, cfg=CFG)
    assert [x.te_id for x in settled] == ["r1"]
    for t in range(33, 200):
        d = decide(s, [idle("r1"), idle("a")], models=["m"], now=last + t, cfg=CFG)
        assert d.actions == [], t
        s = d.state
    # A new request brings it back.
    s = observe_traffic(
        s, "je1", [ModelTraffic(model="m", arrivals=1, held=1)], now=last + 200, cfg=CFG
    )
    assert (
        len(loads(decide(s, [idle("r1"), idle("a")], models=["m"], now=last + 200, cfg=CFG))) == 1
    )


def test_an_instance_still_busy_is_not_unloaded_at_keep_alive() -> None:
    s = with_traffic(fresh(), seconds=1, rps=2)
    tes = [te("r1", running=1, last_active=T0 + 100)]
    assert decide(s, tes, models=["m"], now=T0 + 100, cfg=CFG).actions == []


def test_failed_loads_back_off_exponentially() -> None:
    assert [load_backoff(n, CFG) for n in range(5)] == [0, 2, 4, 8, 16]
    assert load_backoff(20, CFG) == 60
    s = observe_traffic(
        fresh(), "je1", [ModelTraffic(model="m", arrivals=1, held=1)], now=T0, cfg=CFG
    )
    d = decide(s, [idle("a")], models=["m"], now=T0, cfg=CFG)
    assert [(a.te_id, a.model) for a in loads(d)] == [("a", "m")]
    failed = dataclasses.replace(idle("a"), failed_model="m", error="boom")
    s, settled = observe_view(d.state, [failed], now=T0 + 1, cfg=CFG)
    assert not settled[0].ok and s.models["m"].failures == 1
    s = observe_traffic(s, "je1", [ModelTraffic(model="m", held=1)], now=T0 + 1.5, cfg=CFG)
    assert decide(s, [failed], models=["m"], now=T0 + 2.5, cfg=CFG).actions == []  # 2 s backoff
    assert len(loads(decide(s, [failed], models=["m"], now=T0 + 3.1, cfg=CFG))) == 1
    # A ready instance of the model ends the backoff.
    s, _ = observe_view(s, [te("r1")], now=T0 + 4, cfg=CFG)
    assert s.models["m"].failures == 0


def test_placement_spreads_across_pools_then_prefers_warm_and_roomy_pools() -> None:
    tes = [
        te("a0", pool="A"),  # an instance of m already in pool A
        idle("a1", pool="A", recent=["m"]),
        idle("b1", pool="B"),
        idle("c1", pool="C", recent=["m"]),
        idle("d1", pool="D"),
        idle("d2", pool="D"),
    ]
    order = [
        t.te_id for t in placement_order("m", [t for t in tes if t.state == TEState.IDLE], tes)
    ]
    # Pools without an instance first; of those, C (files warm), then D (two idle), B; A last.
    assert order == ["c1", "d1", "d2", "b1", "a1"]


def test_placement_tries_devices_with_room_for_the_models_kv_first() -> None:
    """Under a device KV budget: a load where the device's books lack room for the model's
    pool floor (as a loaded instance reported it) would wait for its neighbours to shrink,
    and fail if they cannot; a device with room goes first, whatever else ranks it. Where
    the floor or the device's free memory is not known, nothing changes."""
    full = dataclasses.replace(idle("a1", pool="A"), device_kv_free_bytes=100)
    roomy = dataclasses.replace(idle("b1", pool="B"), device_kv_free_bytes=5_000)
    warm_a = dataclasses.replace(full, recent_models=("m",))  # A would rank first
    serving = dataclasses.replace(te("m1", pool="C"), kv_floor_bytes=1_000)
    assert short_of_room(full, 1_000) and not short_of_room(roomy, 1_000)
    assert not short_of_room(full, 0) and not short_of_room(idle("x"), 1_000)
    order = placement_order("m", [warm_a, roomy], [serving, warm_a, roomy])
    assert [t.te_id for t in order] == ["b1", "a1"]
    unknown = dataclasses.replace(serving, kv_floor_bytes=0)
    order = placement_order("m", [warm_a, roomy], [unknown, warm_a, roomy])
    assert [t.te_id for t in order] == ["a1", "b1"]


def on(t: TEView, device: str, capacity: InstanceCapacity | None = None) -> TEView:
    return dataclasses.replace(t, device=device, capacity=capacity)


def test_placement_tries_cpus_first_where_the_models_cpu_instances_meet_the_slo() -> None:
    # The bench model's CPU profile: 0.52 ms a prompt token, a full batch's step 70 ms.
    fits = InstanceCapacity(
        prefill_s=5.2e-4,
        prefill_attention_s=0.0,
        decode_s=0.07 / 32,
        decode_context_s=0.0,
        max_num_seqs=32,
        decode_step_s=0.07,
    )
    slow = msgspec.structs.replace(fits, decode_step_s=0.3)  # a step past the 250 ms TPOT
    assert meets_slo(fits, SLO()) and not meets_slo(slow, SLO())
    assert not meets_slo(msgspec.structs.replace(fits, prefill_s=2e-3), SLO())  # 1,024 in 2 s
    older = msgspec.structs.replace(slow, decode_step_s=0.0, decode_s=0.3 / 32)  # no step
    assert not meets_slo(older, SLO())
    free = [on(idle("gpu1", pool="G"), "cuda:0"), on(idle("cpu1", pool="C"), "cpu")]

    def first(*serving: TEView) -> str:
        tes = [*serving, *free]
        return placement_order("m", free, tes, CFG)[0].te_id

    # Never run on a CPU: its costs there are unknown, a GPU while one is free.
    assert first() == "gpu1"
    assert first(on(te("g0", pool="G"), "cuda:1", fits)) == "gpu1"  # a GPU's costs say nothing
    # An instance on a CPU meets the SLO: CPUs first, even against spreading across pools.
    assert first(on(te("c0", pool="C"), "cpu", fits)) == "cpu1"
    assert first(on(te("c0", pool="C"), "cpu", slow)) == "gpu1"
    # A stricter SLO (50 ms TPOT) leaves the model on GPUs.
    strict = dataclasses.replace(CFG, slo=SLO(tpot_s=0.05))
    tes = [on(te("c0", pool="C"), "cpu", fits), *free]
    assert placement_order("m", free, tes, strict)[0].te_id == "gpu1"


def cached(t: TEView, server: str = "", **weights: tuple[int, int]) -> TEView:
    """``t`` on a host whose weight cache holds ``model=(resident, total)`` bytes."""
    held = {m: CachedWeights(resident_bytes=r, total_bytes=n) for m, (r, n) in weights.items()}
    return dataclasses.replace(t, weight_server=server, cached_weights=held)


def test_placement_prefers_the_pool_whose_host_cache_loads_the_model_fastest() -> None:
    gb = 1 << 30
    tes = [
        idle("a1", pool="A", recent=["m"]),  # files warm, nothing in its host cache
        cached(idle("b1", pool="B"), m=(gb // 2, gb)),  # half of m cached
        cached(idle("c1", pool="C"), m=(gb, gb)),  # all of m cached: maps, reads nothing
        cached(idle("d1", pool="D"), other=(gb, gb)),
    ]
    order = [t.te_id for t in placement_order("m", tes, tes, CFG)]
    assert order == ["c1", "b1", "a1", "d1"]
    # t_load = (S - S_resident) / B
    assert load_time("m", "B", tes, CFG) == (gb // 2) / CFG.load_bandwidth
    assert load_time("m", "C", tes, CFG) == 0.0
    assert load_time("unseen", "C", tes, CFG) == float("inf")
    # From an index built once: the same figures.
    index = pool_index(tes)
    for model in ("m", "other", "unseen"):
        for pool in "ABCDE":
            assert load_time(model, pool, tes, CFG, index) == load_time(model, pool, tes, CFG)


def test_best_pool_is_the_pool_of_the_first_in_placement_order() -> None:
    """``best_pool`` ranks pools instead of sorting TEs; on random views it picks what the
    full order puts first."""
    rng = random.Random(7)
    gb = 1 << 30
    models = ["m", "n", "o"]
    for _ in range(300):
        tes = []
        for i in range(rng.randint(2, 14)):
            pool = rng.choice("ABCD")
            recent = rng.sample(models, rng.randint(0, 2))
            if rng.random() < 0.5:
                t = idle(f"t{i}", pool=pool, recent=recent)
            else:
                t = te(
                    f"t{i}",
                    rng.choice([TEState.READY, TEState.LOADING]),
                    rng.choice(models),
                    pool=pool,
                    recent=recent,
                )
            weights = {
                m: (rng.choice([0, gb // 2, gb]), gb) for m in rng.sample(models, rng.randint(0, 2))
            }
            tes.append(cached(t, **weights))
        free = [t for t in tes if t.state == TEState.IDLE]
        if not free:
            continue
        index = pool_index(tes)
        for model in models:
            first = placement_order(model, free, tes, CFG)[0]
            by_pool: dict[str, list[TEView]] = {}
            for t in free:
                by_pool.setdefault(t.pool_id, []).append(t)
            assert best_pool(model, by_pool, CFG, index) == first.pool_id
            assert placement_order(model, free, tes, CFG, index) == placement_order(
                model, free, tes, CFG
            )


def test_a_load_on_a_pool_without_the_weights_forks_them_from_a_pool_that_has_them() -> None:
    gb = 1 << 30
    tes = [
        te("a0", pool="A"),  # an instance of m in A, whose host cache holds m
        cached(te("a0", pool="A"), "10.0.0.1:7000", m=(gb, gb)),
        cached(idle("b1", pool="B"), "10.0.0.2:7000"),
        cached(idle("c1", pool="C"), "10.0.0.3:7000", m=(gb // 2, gb)),  # a part only
    ]
    assert fork_source("m", "B", tes) == "10.0.0.1:7000"
    assert fork_source("m", "A", tes) is None  # its own cache holds it
    assert fork_source("other", "B", tes) is None  # nobody holds it: the checkpoint
    # m at zero; A's only TE serves another model: the new instance goes to B and forks.
    busy_a = cached(te("a0", pool="A", model="x"), "10.0.0.1:7000", m=(gb, gb))
    view = [busy_a, tes[2]]
    d = decide(
        with_traffic(fresh(), seconds=2, rps=1), view, models=["m", "x"], now=T0 + 2, cfg=CFG
    )
    assert [(a.te_id, a.weights_from) for a in loads(d)] == [("b1", "10.0.0.1:7000")]


def test_several_loads_at_once_spread_over_pools() -> None:
    s = with_traffic(fresh(), seconds=6, rps=40)
    tes = [idle("a1", pool="A"), idle("a2", pool="A"), idle("b1", pool="B"), idle("b2", pool="B")]
    d = decide(s, tes, models=["m"], now=T0 + 6, cfg=CFG)
    pools = sorted(t.pool_id for a in loads(d) for t in tes if t.te_id == a.te_id)
    assert pools == ["A", "A", "B", "B"]
    d = decide(with_traffic(fresh(), seconds=2, rps=1), tes, models=["m"], now=T0 + 2, cfg=CFG)
    assert len(loads(d)) == 1


def test_slo_misses_with_a_queue_add_an_instance() -> None:
    s = fresh()
    for i in range(20):
        s = observe_outcomes(
            s,
            [ModelOutcomes(model="m", finished=2, slo_met=1, output_tokens=20)],
            now=T0 + i,
            cfg=CFG,
        )
        s = observe_traffic(
            s, "je1", [ModelTraffic(model="m", arrivals=1, prompt_tokens=10)], now=T0 + i, cfg=CFG
        )
    tes = [te("r1", running=1, waiting=1), idle("a")]
    d = decide(s, tes, models=["m"], now=T0 + 20, cfg=CFG)
    assert d.targets["m"].slo_attainment == 0.5
    assert d.targets["m"].reason == "slo" and loads(d) == [Load("a", "m", "slo")]
    # Without a queue, missing the SLO is not something another instance fixes.
    d = decide(s, [te("r1", running=1), idle("a")], models=["m"], now=T0 + 20, cfg=CFG)
    assert d.actions == []


def test_a_starved_model_reclaims_surplus_instances_when_no_te_is_idle() -> None:
    """Every TE holds a model: ``m`` has three instances for a load that needs one (inside
    its stable window, so scale-in has not removed them yet) and ``x`` gets requests with
    none. ``m``'s least busy surplus instance drains for ``x``, the freed TE goes to ``x``
    and not to another model that wants one, and nothing more is taken meanwhile."""
    s = with_traffic(fresh(), seconds=60, rps=1)  # well under one instance
    s = observe_capacity(s, "x", CAP)
    s = observe_capacity(s, "y", CAP)
    now = T0 + 60
    s = observe_traffic(
        s, "je1", [ModelTraffic(model="x", arrivals=3, prompt_tokens=300, held=3)], now=now, cfg=CFG
    )
    tes = [te("r1", running=2), te("r2", running=1), te("r3")]
    d = decide(s, tes, models=["m", "x", "y"], now=now, cfg=CFG)
    assert d.targets["m"].wanted == 1 and d.targets["x"].current == 0
    assert unloads(d) == [Unload("r3", "m", "reclaimed for x")]
    assert d.state.reserved == {"r3": "x"}
    # While r3 drains, x's shortfall is being met: nothing more is taken.
    draining = [te("r1", running=2), te("r2", running=1), te("r3", TEState.DRAINING)]
    d = decide(d.state, draining, models=["m", "x", "y"], now=now + 0.5, cfg=CFG)
    assert d.actions == []
    # r3 is idle; y now wants an instance too, but r3 was freed for x.
    s = observe_traffic(
        d.state,
        "je1",
        [ModelTraffic(model="y", arrivals=1, prompt_tokens=100, held=1)],
        now=now + 1,
        cfg=CFG,
    )
    freed = [te("r1", running=2), te("r2", running=1), idle("r3")]
    d = decide(s, freed, models=["m", "x", "y"], now=now + 1, cfg=CFG)
    assert [a.te_id for a in loads(d) if a.model == "x"] == ["r3"]
    assert not any(a.model == "y" for a in loads(d))
    assert d.state.reserved == {"r2": "y"}  # y takes m's next surplus instance
    assert Unload("r2", "m", "reclaimed for y") in unloads(d)


def test_no_reclaim_from_a_model_that_needs_its_instances() -> None:
    s = observe_traffic(
        fresh(),
        "je1",
        [ModelTraffic(model="x", arrivals=1, prompt_tokens=100, held=1)],
        now=T0,
        cfg=CFG,
    )
    s = observe_traffic(
        s, "je1", [ModelTraffic(model="m", arrivals=1, prompt_tokens=100)], now=T0, cfg=CFG
    )
    d = decide(s, [te("r1")], models=["m", "x"], now=T0, cfg=CFG)
    assert d.actions == [] and d.state.reserved == {}


def test_a_starved_model_takes_one_instance_from_the_richest_when_none_is_surplus() -> None:
    """``m`` bursts and needs all three TEs; ``x`` gets a request with none. ``x`` takes
    ``m``'s least busy instance (one, not more), and a model with one instance is never
    taken from."""
    s = observe_traffic(
        fresh(),
        "je1",
        [ModelTraffic(model="m", arrivals=1, prompt_tokens=100)],
        now=T0,
        cfg=CFG,
    )
    s = observe_capacity(s, "x", CAP)
    s = observe_traffic(
        s, "je1", [ModelTraffic(model="x", arrivals=4, prompt_tokens=400, held=4)], now=T0, cfg=CFG
    )
    busy = [te("r1", running=8, waiting=8), te("r2", running=8, waiting=8), te("r3", running=5)]
    d = decide(s, busy, models=["m", "x"], now=T0, cfg=CFG)
    assert d.targets["m"].wanted >= 3
    assert unloads(d) == [Unload("r3", "m", "reclaimed for x")]
    s = observe_traffic(
        s, "je1", [ModelTraffic(model="y", arrivals=1, prompt_tokens=100)], now=T0, cfg=CFG
    )
    lone = [te("r1", running=8, waiting=8), te("y1", model="y", running=1)]
    d = decide(s, lone, models=["m", "x", "y"], now=T0, cfg=CFG)
    assert unloads(d) == []


def test_loads_of_one_model_forking_from_one_source_get_it_by_multicast() -> None:
    from services.scaler.policy import MulticastPlan, plan_multicasts

    gb = 1 << 30
    src = cached(te("a0", pool="A", model="x"), "10.0.0.1:7000", m=(gb, gb))
    src = dataclasses.replace(src, weight_relay="10.0.0.1:7001")
    tes = [src] + [
        dataclasses.replace(idle(f"{p}1", pool=p), relay_address=f"10.0.1.{i}:9")
        for i, p in enumerate("BCD")
    ]
    loads = [Load(f"{p}1", "m", "load", "10.0.0.1:7000") for p in "BCD"]
    planned = plan_multicasts([*loads, Load("x1", "x", "load")], tes)
    nodes = ("10.0.0.1:7001", "10.0.1.0:9", "10.0.1.1:9", "10.0.1.2:9")
    assert [a.multicast for a in planned[:3]] == [
        MulticastPlan(k, nodes, "10.0.0.1:7000") for k in (1, 2, 3)
    ]
    assert planned[3].multicast is None  # not a fork: unchanged
    # One load alone forks as before; an unknown relay address leaves the forks as they are.
    assert plan_multicasts(loads[:1], tes)[0].multicast is None
    blind = [dataclasses.replace(t, relay_address="") for t in tes]
    assert all(a.multicast is None for a in plan_multicasts(loads, blind))


def test_a_load_sent_a_tick_ago_counts_where_its_heartbeat_does_not_show_it_yet() -> None:
    """The TEs' heartbeats lag the scaler's own loads: the next tick's placement still sees
    the TE the last tick loaded as idle. It counts as the model's instance in its pool all
    the same, so the model's next instance goes to another pool (seen on three hosts: two
    instances of a model on one while another had room)."""
    tes = [idle("a1", pool="A"), idle("a2", pool="A"), idle("b1", pool="B"), idle("b2", pool="B")]
    first = decide(with_traffic(fresh(), seconds=2, rps=1), tes, models=["m"], now=T0 + 2, cfg=CFG)
    (sent,) = loads(first)
    more = with_traffic(first.state, seconds=6, rps=40)
    d = decide(more, tes, models=["m"], now=T0 + 6, cfg=CFG)  # the same heartbeats
    pools = [t.pool_id for a in loads(d) for t in tes if t.te_id == a.te_id]
    assert sent.te_id not in [a.te_id for a in loads(d)]
    here = next(t.pool_id for t in tes if t.te_id == sent.te_id)
    assert pools and pools[0] != here, (sent, pools)
