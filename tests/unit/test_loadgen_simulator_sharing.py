"""The simulator's shared devices (LLM-Mesh): instances on one device take turns (first come
or earliest deadline) or are time-sliced, shadow validation refuses a placement before it
harms the device's requests, GPU devices run their GPU profile; and the trace transform
that spreads a trace over many models."""

from __future__ import annotations

import dataclasses

import pytest

from loadgen.plan import plan
from loadgen.simulator import SimConfig, Simulation, simulate
from loadgen.traces import TraceRequest
from loadgen.transforms import spread_models
from shared.settings import ModelScaling
from shared.slo import SLO
from tests.unit.test_loadgen_simulator import profile


def _trace(*reqs: tuple[float, int, int, str]) -> list[TraceRequest]:
    return [
        TraceRequest(arrival_s=t, input_tokens=i, output_tokens=o, model=m) for t, i, o, m in reqs
    ]


def _run(reqs: list[TraceRequest], cfg: SimConfig, **profiles_kw):  # type: ignore[no-untyped-def]
    """The results by model (each model's last request), and the stats; each model is
    loaded by a one-token request at 0 s first."""
    warm = _trace(*((0.0, 1, 1, m) for m in sorted({r.model or "" for r in reqs})))
    planned = plan(warm + reqs)
    models = sorted({p.model for p in planned})
    results, stats = simulate(
        planned,
        {m: profile(m, **profiles_kw) for m in models},
        cfg,
        {m: profile(m, prefill_s=0.0001, decode_s=(0.002, 0.004)) for m in models},
    )
    return {r.model: r for r in results}, stats


# One instance per model, kept loaded; no network: hand-checkable times.
ONE_DEVICE = dict(devices=1, min_replicas=1, max_replicas=1, network_s=0.0, keep_alive_s=600)


@pytest.mark.parametrize(
    ("sharing", "ttfts"),
    [("headroom", [0.1, 0.2]), ("fifo", [0.1, 0.2]), ("uncoordinated", [0.2, 0.2])],
)
def test_instances_on_one_device_take_turns_or_are_time_sliced(sharing, ttfts) -> None:  # type: ignore[no-untyped-def]
    reqs = _trace((5.0, 100, 1, "a"), (5.0, 100, 1, "b"))
    cfg = SimConfig(slots_per_device=2, sharing=sharing, **ONE_DEVICE)
    results, stats = _run(reqs, cfg)
    assert sorted(r.ttft_s for r in results.values()) == pytest.approx(ttfts)
    assert stats.turns == (0 if sharing == "uncoordinated" else stats.iterations)
    # One instance per device: both prompts at once, each on its own device.
    results, _ = _run(reqs, SimConfig(**ONE_DEVICE | {"devices": 2}))
    assert [r.ttft_s for r in results.values()] == pytest.approx([0.1, 0.1])


def test_the_turn_goes_to_the_earliest_deadline_not_the_first_asker() -> None:
    # c's 1,000-token prompt holds the device from 4.99 s to 5.99 s. Meanwhile a asks (a
    # 1,500-token prompt: due 2.93 s after it came) and then b (100 tokens: due in 2 s).
    reqs = _trace((4.99, 1000, 1, "c"), (5.0, 1500, 1, "a"), (5.01, 100, 1, "b"))
    cfg = SimConfig(slots_per_device=3, sharing="fifo", **ONE_DEVICE)
    fifo, _ = _run(reqs, cfg)
    assert fifo["a"].ttft_s == pytest.approx(0.99 + 1.5)
    assert fifo["b"].ttft_s == pytest.approx(0.98 + 1.5 + 0.1)  # late: an SLO miss
    edf, stats = _run(reqs, dataclasses.replace(cfg, sharing="headroom"))
    assert edf["b"].ttft_s == pytest.approx(0.98 + 0.1)
    assert edf["a"].ttft_s == pytest.approx(0.99 + 0.1 + 1.5)  # still within its 2.93 s
    assert stats.turns == stats.iterations


def test_with_late_yield_the_turn_goes_to_a_prompt_in_time_before_one_already_late() -> None:
    # c's 2,040-token prompt holds the device from 4 s to 6.04 s. a's 100-token prompt (due at
    # 6.01 s) is late by then, b's (due at 6.2 s) is not: earliest deadline first serves a,
    # and b misses too; with late yield b goes first and only a misses.
    reqs = _trace((4.0, 2040, 1, "c"), (4.01, 100, 1, "a"), (4.2, 100, 1, "b"))
    cfg = SimConfig(slots_per_device=3, sharing="headroom", **ONE_DEVICE)
    edf, stats = _run(reqs, cfg)
    assert edf["a"].ttft_s == pytest.approx(2.03 + 0.1)
    assert edf["b"].ttft_s == pytest.approx(1.84 + 0.2)  # late
    late_turns = stats.late_turns
    yielding, stats = _run(reqs, dataclasses.replace(cfg, late_yield_s=3.0))
    assert yielding["b"].ttft_s == pytest.approx(1.84 + 0.1)  # in time
    assert yielding["a"].ttft_s == pytest.approx(2.03 + 0.2)
    assert stats.late_turns == late_turns  # a's turn, late either way


def test_shadow_validation_refuses_what_would_break_a_neighbours_tpot() -> None:
    # b decodes 200 tokens from 5 s, a step 20 ms (22 ms with the margin) under a 30 ms TPOT;
    # a's request at 6 s would add a turn of a's to every round (44 ms).
    slo = SLO(ttft_s=2.0, tpot_s=0.03)
    reqs = _trace((5.0, 10, 200, "b"), (6.0, 10, 5, "a"))
    cfg = SimConfig(slots_per_device=2, slo=slo, shadow=True, **ONE_DEVICE)
    results, stats = _run(reqs, cfg)
    assert stats.shadow_refused == {"tpot": 1}
    # a's only instance refused it and no capacity is coming: a 503 at once, not a hold.
    assert results["a"].status == 503 and "too busy" in (results["a"].error or "")
    assert stats.device_busy == 1 and stats.timeouts == 0
    assert results["b"].ok and results["b"].tpot_s == pytest.approx(0.02)
    # Without it, a is served and b's tokens come a turn of a's later each.
    results, stats = _run(reqs, dataclasses.replace(cfg, shadow=False))
    assert results["a"].ok and stats.shadow_refused == {}
    assert max(results["b"].gaps_s) >= 0.04 > 0.03  # a round of both: past b's TPOT


def test_gpu_devices_run_the_models_gpu_profile() -> None:
    reqs = _trace((5.0, 1000, 1, "a"))
    results, _ = _run(reqs, SimConfig(gpu_devices=1, **ONE_DEVICE))
    assert results["a"].ttft_s == pytest.approx(0.1)  # 0.1 ms a token on the GPU
    results, _ = _run(reqs, SimConfig(**ONE_DEVICE))
    assert results["a"].ttft_s == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no GPU engine profile"):
        simulate(plan(reqs), {"a": profile("a")}, SimConfig(gpu_devices=1, **ONE_DEVICE))


def test_a_profile_as_a_performance_model_keeps_its_times() -> None:
    p = profile(decode_ctx_s=1e-5)
    perf = p.perf_model()
    assert perf.prefill_time_s(512) == pytest.approx(p.iteration_s(0, 0, [512]))
    assert perf.decode_step_s(8, 256) == pytest.approx(p.iteration_s(8, 8 * 256, []))
    assert perf.decode_step_s(4, 100) == pytest.approx(p.iteration_s(4, 400, []), rel=0.05)


def test_spread_models_keeps_conversations_together_with_zipf_popularity() -> None:
    reqs = [
        TraceRequest(arrival_s=i, input_tokens=10, output_tokens=1, session_id=f"s{i % 50}")
        for i in range(2000)
    ] + [TraceRequest(arrival_s=i, input_tokens=10, output_tokens=1) for i in range(2000)]
    out = spread_models(reqs, 8, skew=1.0, seed=3)
    assert out == spread_models(reqs, 8, skew=1.0, seed=3)  # the same for one seed
    by_session: dict[str, set[str]] = {}
    for r in out:
        if r.session_id is not None:
            by_session.setdefault(r.session_id, set()).add(r.model or "")
    assert all(len(m) == 1 for m in by_session.values())
    loose = [r.model for r in out[2000:]]
    assert {m for m in loose} <= {f"model-0{k}" for k in range(1, 9)}
    assert loose.count("model-01") > 2.5 * loose.count("model-08")  # Zipf: 8x in expectation
    even = [r.model for r in spread_models(reqs, 8, skew=0.0)[2000:]]
    assert max(even.count(m) for m in set(even)) < 1.5 * min(even.count(m) for m in set(even))
    with pytest.raises(ValueError):
        spread_models(reqs, 0)


class _Books(Simulation):
    """A simulation that checks its devices' KV books at every change and keeps each
    instance's largest pool."""

    peak: dict[str, int]

    def _make_room(self, device):  # type: ignore[no-untyped-def]
        super()._make_room(device)
        assert sum(device.holds.values()) + sum(device.reserved.values()) <= device.kv_budget
        self.peak = getattr(self, "peak", {})
        for te in device.tes:
            self.peak[te.model or ""] = max(self.peak.get(te.model or "", 0), te.pool_blocks)


def test_kv_sized_by_demand_lets_a_busy_instance_take_its_idle_neighbours_share() -> None:
    # Two models on one device of 1,000 blocks; a burst of eight 1,500-token prompts for a.
    # Split evenly, a has 500 blocks: five of them at a time. Sized by demand, its pool
    # grows past that (b keeps its floor: 1.25 x its 2,048-token context, 160 blocks), the
    # device's books never hold more than the device, and the burst's last first token
    # comes sooner.
    reqs = _trace(
        *((0.0, 1, 1, m) for m in "ab"), *((5.0 + i / 100, 1500, 100, "a") for i in range(8))
    )
    profiles = {m: profile(m, max_model_len=2048, kv_bytes_per_token=100) for m in "ab"}
    last = {}
    for kv in (False, True):
        cfg = SimConfig(slots_per_device=2, kv_sizing=kv, **ONE_DEVICE)
        sim = _Books(plan(reqs), profiles, cfg)
        results = sim.run()
        assert all(r.ok for r in results)
        last[kv] = max(r.ttft_s for r in results if r.model == "a")
    assert sim.peak["a"] > 800 and sim.peak["b"] == 160
    assert sim.stats.kv_squeezes >= 1  # b was told to shrink (to its floor) while a waited
    assert last[True] < last[False] - 2


def test_a_blocked_grow_preempts_a_smaller_neighbour_whose_requests_fit_elsewhere() -> None:
    # Device 0 holds a and one instance of b, device 1 the other instance of b. Two long
    # requests of b (one on each), then a burst of 8 long-output requests of a: a's pool
    # cannot grow past b's on device 0 (400 blocks). With preemption, b's instance there
    # (one request against a's eight) gives way: its request passes shadow validation on
    # device 1 and moves there, recomputed; b's instance unloads and a's pool grows: no
    # request of a is preempted for blocks, and the burst ends sooner.
    reqs = _trace(
        *((0.0, 1, 1, m) for m in "abb"),
        (4.0, 2000, 400, "b"),
        (4.01, 2000, 400, "b"),
        *((6.0 + i / 100, 200, 600, "a") for i in range(8)),
    )
    profiles = {
        m: profile(m, max_model_len=1024, kv_blocks=400, kv_bytes_per_token=100) for m in "ab"
    }
    cfg = SimConfig(
        devices=2,
        slots_per_device=2,
        kv_sizing=True,
        network_s=0.0,
        keep_alive_s=600,
        min_replicas=1,
        max_replicas=2,
        model_scaling={"b": ModelScaling(min_replicas=2)},
        slo=SLO(ttft_s=60, tpot_s=1.0),
    )
    runs = {}
    for preempt in (False, True):
        sim = _Books(plan(reqs), profiles, dataclasses.replace(cfg, kv_preemption=preempt))
        results = sim.run()
        assert all(r.ok for r in results)
        runs[preempt] = (sim.stats, max(r.e2e_s for r in results if r.model == "a"))
        layout = [[t.model for t in d.tes] for d in sim._devices.values()]
        if preempt:  # b, preempted on device 0, loads again where its floor has room
            assert layout == [["a", None], ["b", "b"]], layout
        else:
            assert layout[0] == ["a", "b"] and layout[1][0] == "b", layout
    (before, ended_before), (after, ended_after) = runs[False], runs[True]
    assert before.kv_preemptions == 0 and before.preemptions > 0
    assert after.kv_preemptions == 1 and after.kv_moved == 1 and after.preemptions == 0
    assert ended_after < ended_before - 10
