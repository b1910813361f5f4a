"""The simulator: hand-checkable timings, the real policies' effects, and scale."""

from __future__ import annotations

import json
import time

import pytest

from loadgen.costmodel import EngineProfile
from loadgen.plan import plan
from loadgen.report import summarize
from loadgen.simulator import EPOCH, SimConfig, Simulation, simulate
from loadgen.traces import TraceRequest
from shared.messages.cluster import TEState
from shared.perf_model import fit_prefill
from shared.slo import SLO
from tests.shared_traces import azure_slice


def profile(model: str = "m", **kw) -> EngineProfile:
    base = dict(
        model=model,
        load_s=2.0,
        decode_batches=(1, 8),
        decode_s=(0.02, 0.04),
        decode_ctx_s=0.0,
        prefill_s=0.001,
        prefill_s2=0.0,
        max_num_seqs=8,
        max_prefill_tokens=2048,
        kv_blocks=1000,
        block_size=16,
        max_model_len=4096,
    )
    base.update(kw)
    return EngineProfile(**base)


def trace(*reqs: tuple[float, int, int], model: str | None = None) -> list[TraceRequest]:
    return [
        TraceRequest(arrival_s=t, input_tokens=i, output_tokens=o, model=model) for t, i, o in reqs
    ]


NO_NET = dict(network_s=0.0)


def test_cost_model_interpolates_decode_and_adds_prefill() -> None:
    p = profile(decode_ctx_s=1e-5, prefill_s2=1e-7)
    assert p.decode_step_s(1) == pytest.approx(0.02)
    assert p.decode_step_s(8) == pytest.approx(0.04)
    assert p.decode_step_s(4) == pytest.approx(0.02 + 0.02 * 3 / 7)
    assert p.decode_step_s(16) == pytest.approx(0.04 + 0.02 * 8 / 7)  # extrapolated
    assert p.iteration_s(2, 100, [500]) == pytest.approx(
        p.decode_step_s(2) + 1e-5 * 100 + 0.001 * 500 + 1e-7 * 500**2
    )
    # A later chunk of a prompt also attends to the part already cached.
    assert p.prefill_time_s(100, 400) == pytest.approx(0.001 * 100 + 1e-7 * 100 * (100 + 800))
    assert p.iteration_s(0, 0, [100, 50], [400, 0]) == pytest.approx(
        p.prefill_time_s(100, 400) + p.prefill_time_s(50)
    )
    # A prefill-only iteration still costs at least a weight pass.
    assert p.iteration_s(0, 0, [1]) == pytest.approx(0.02)
    assert EngineProfile.from_json(p.to_json()) == p


def test_fit_prefill_recovers_linear_and_quadratic_terms() -> None:
    lengths = [64, 256, 512, 1024]
    a, b = fit_prefill(lengths, [1e-3 * n + 2e-7 * n * n for n in lengths])
    assert a == pytest.approx(1e-3) and b == pytest.approx(2e-7)
    a, b = fit_prefill([100], [0.5])
    assert a * 100 + b * 100**2 == pytest.approx(0.5)


def test_one_request_from_zero_pays_load_then_prefill_then_decodes() -> None:
    planned = plan(trace((0.0, 100, 5)), model="m")
    results, stats = simulate(planned, {"m": profile()}, SimConfig(devices=2, **NO_NET))
    (r,) = results
    assert r.ok and r.completion_tokens == 5
    # Load 2 s, then a prefill-only iteration of 100 tokens (0.1 s) gives the first token.
    assert r.ttft_s == pytest.approx(2.0 + 0.1)
    # Four decode steps of one request follow.
    assert r.gaps_s == pytest.approx([0.02] * 4)
    assert r.e2e_s == pytest.approx(2.1 + 0.08)
    assert stats.loads == 1


def test_chunked_prefill_bounds_the_stall_a_long_prompt_puts_on_decodes() -> None:
    """A 3000-token prompt arrives while another request decodes. Whole, it stalls that
    request for its whole prefill (3 s); in 500-token chunks, for 0.5 s at a time, and its own
    first token comes after its six chunks."""
    planned = plan(trace((0.0, 10, 40), (2.2, 3000, 2)), model="m")
    cfg = SimConfig(devices=1, record_gaps=True, **NO_NET)
    by_mode = {}
    for chunked in (False, True):
        prof = profile(max_prefill_tokens=500, chunked_prefill=chunked)
        results, _ = simulate(planned, {"m": prof}, cfg)
        assert all(r.ok for r in results)
        by_mode[chunked] = results
    whole, chunked = by_mode[False], by_mode[True]
    assert max(whole[0].gaps_s) == pytest.approx(0.02 + 3.0)
    assert max(chunked[0].gaps_s) == pytest.approx(0.02 + 0.5)
    # Six chunks, each beside one decode: 6 x (0.5 + 0.02).
    assert chunked[1].ttft_s == pytest.approx(6 * 0.52, abs=0.03)
    assert whole[1].ttft_s == pytest.approx(3.02, abs=0.03)


def test_warm_instance_and_scale_to_zero_after_keep_alive() -> None:
    planned = plan(trace((0.0, 10, 2), (5.0, 10, 2), (100.0, 10, 2)), model="m")
    # No host weight cache: every load reads the checkpoint (with one, the third request's
    # load maps the weights: test_loadgen_simulator_cache.py).
    cfg = SimConfig(devices=1, keep_alive_s=30.0, host_cache_bytes=0, **NO_NET)
    results, stats = simulate(planned, {"m": profile()}, cfg)
    cold, warm, after = results
    assert cold.ttft_s > 2.0  # loaded first
    assert warm.ttft_s == pytest.approx(0.02)  # already loaded: one short prefill
    assert after.ttft_s > 2.0  # unloaded after 30 s idle, loaded again
    assert stats.loads == 2 and stats.unloads >= 1


def test_instance_seconds_end_with_the_last_request_and_the_keep_alive_is_apart() -> None:
    """Every fleet is measured over the same horizon, until the replay's last request ended:
    an always-on instance runs on past it, uncounted, so the instance an autoscaled fleet
    keeps for its keep-alive after it counts apart (``tail_instance_seconds``)."""
    planned = plan(trace((0.0, 100, 5)), model="m")
    by_fleet = {}
    for fleet, extra in (("autoscaled", {}), ("always-on", {"min_replicas": 1})):
        cfg = SimConfig(devices=1, keep_alive_s=30.0, host_cache_bytes=0, **extra, **NO_NET)
        (r,), stats = simulate(planned, {"m": profile()}, cfg)
        by_fleet[fleet] = (r.sent_s + r.e2e_s, stats)
    end, auto = by_fleet["autoscaled"]
    # Loaded from the first request's arrival to its end (load 2 s, prefill, four decodes).
    assert auto.instance_seconds == pytest.approx(end, abs=0.01)
    assert auto.tail_instance_seconds == pytest.approx(30.0, abs=1.0)  # then its keep-alive
    end_on, on = by_fleet["always-on"]
    # The always-on instance too, though the run went on (its scaler's last ticks).
    assert on.instance_seconds == pytest.approx(end_on, abs=0.01)


def test_requests_batch_together_and_share_decode_steps() -> None:
    # Eight requests arriving at once after the model is up decode as one batch.
    reqs = [(0.0, 10, 2)] + [(10.0, 16, 11)] * 8
    planned = plan(trace(*reqs), model="m")
    results, _ = simulate(planned, {"m": profile()}, SimConfig(devices=1, **NO_NET))
    gaps = [g for r in results[1:] for g in r.gaps_s]
    assert gaps and max(gaps) == pytest.approx(0.04)  # batch-8 steps
    assert all(r.ok for r in results)


def test_models_get_their_own_instances_and_a_full_fleet_times_out() -> None:
    reqs = trace((0.0, 10, 3), model="a") + trace((0.1, 10, 3), model="b")
    planned = plan(reqs)
    profiles = {"a": profile("a"), "b": profile("b")}
    ok, _ = simulate(planned, profiles, SimConfig(devices=2, **NO_NET))
    assert all(r.ok for r in ok)
    # One device, keep-alive longer than the placement timeout: b waits for a TE in vain.
    cfg = SimConfig(devices=1, keep_alive_s=100.0, placement_timeout_s=5.0, **NO_NET)
    results, stats = simulate(planned, profiles, cfg)
    a, b = results
    assert a.ok
    assert not b.ok and b.status == 503 and "no_capacity" in (b.error or "")
    assert stats.timeouts == 1


def test_kv_pressure_preempts_and_still_finishes_everything() -> None:
    # 12 blocks of 16 tokens; four 40-token prompts growing to 80 tokens cannot all fit.
    planned = plan(trace(*[(0.0, 40, 40)] * 4), model="m")
    results, stats = simulate(planned, {"m": profile(kv_blocks=12)}, SimConfig(devices=1, **NO_NET))
    assert all(r.ok and r.completion_tokens == 40 for r in results)
    assert stats.preemptions > 0


def test_summary_of_a_simulated_run_uses_the_replay_report() -> None:
    planned = plan(trace(*[(i * 0.5, 200, 20) for i in range(20)]), model="m")
    results, _ = simulate(planned, {"m": profile()}, SimConfig(devices=1))
    s = summarize(results, SLO())
    assert s["requests"] == 20 and s["failed"] == 0
    assert s["ttft_ms"]["p50"] is not None and 0 <= s["slo_attainment"] <= 1


def test_thousands_of_devices_and_models_run_fast() -> None:
    """2,000 devices, 500 models, 20,000 requests: the policy modules on a fleet this
    machine could never host, in seconds."""
    reqs = [
        TraceRequest(
            arrival_s=i * 0.01,
            input_tokens=100 + i % 400,
            output_tokens=1 + i % 30,
            model=f"m{i % 500}",
        )
        for i in range(20_000)
    ]
    planned = plan(reqs)
    profiles = {f"m{k}": profile(f"m{k}") for k in range(500)}
    t = time.perf_counter()
    # Host weight caches on, pre-loads off: the pre-load decision weighs every recently used
    # model each tick (about 0.1 s a tick at this size; the test then takes 50 s, not 20).
    cfg = SimConfig(devices=2000, pool_size=8, record_gaps=False, preload_window_s=0)
    results, stats = simulate(planned, profiles, cfg)
    elapsed = time.perf_counter() - t
    assert all(r.ok for r in results)
    assert stats.loads >= 500 and stats.max_busy_devices >= 500
    assert elapsed < 120, elapsed
    # What it asked of the control plane: a placement step for every request at least, by
    # second of the trace (100 a second arrive), and a view change for each load at least.
    assert stats.placements >= 20_000 and stats.placement_wall_s > 0
    assert sum(stats.placements_by_s.values()) == stats.placements
    assert max(stats.placements_by_s.values()) >= 100
    assert stats.view_changes >= stats.loads
    assert sum(stats.view_changes_by_s.values()) == stats.view_changes


def test_cli_simulates_a_real_trace_slice_with_a_saved_profile(tmp_path) -> None:
    """`meshserve-loadgen simulate` on the Azure trace: summary, requests and plots, in the
    replay's format."""
    from loadgen.cli import main
    from loadgen.costmodel import save_profiles

    trace_file = azure_slice()
    prof = tmp_path / "p.json"
    save_profiles(prof, [profile("demo")])
    out = tmp_path / "sim"
    with pytest.raises(SystemExit) as e:
        main(
            [
                "simulate",
                str(trace_file),
                "--profile",
                str(prof),
                "--devices",
                "2",
                "--max-requests",
                "300",
                "--out",
                str(out),
            ]
        )
    assert e.value.code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"] == 300 and summary["run"]["simulated"] is True
    # The slice overloads one device: the autoscaler takes the second.
    assert summary["run"]["stats"]["loads"] == 2
    assert summary["run"]["stats"]["peak_replicas"] == {"demo": 2}
    assert summary["clipped_prompts"] > 0  # the trace has prompts beyond 4,096 tokens
    control = summary["run"]["control_plane"]  # loadgen/control_plane.py
    assert control["fleet"]["tes"] == 2 and control["first_limit"]
    assert control["placements_per_s_per_je"] > 0 and control["view_bytes"] > 0
    lines = (out / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 300
    assert (out / "latency_cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The fleet over time (loadgen/fleet.py): every request arrived in one of its buckets,
    # whose misses are the summary's, and the scaler's two instances show in them.
    fleet = [json.loads(x) for x in (out / "fleet.jsonl").read_text().splitlines()]
    assert sum(r["arrived"] for r in fleet) == 300
    assert sum(r["missed"] for r in fleet) == 300 - summary["slo_met"]
    assert max(r["max_instances"] for r in fleet) == 2
    assert (out / "fleet_over_time.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_calibration_recovers_a_known_per_token_cost() -> None:
    """Simulate with emit_s = 0.5 ms as the "replay", then fit emit_s from its TPOT median."""
    from loadgen.simulator import calibrate_emit_s
    from loadgen.stats import percentile

    # Spaced out after the load: one request at a time, so TPOT = decode step + emit_s.
    planned = plan(trace(*[(3.0 + i * 0.5, 50 + 10 * (i % 7), 10) for i in range(40)]), model="m")
    cfg = SimConfig(devices=1, **NO_NET)
    truth, _ = simulate(planned, {"m": profile(emit_s=0.0005)}, cfg)
    target = percentile([t for r in truth if (t := r.tpot_s) is not None], 50)
    fitted = calibrate_emit_s(planned, profile(), cfg, target)
    assert fitted == pytest.approx(0.0005, rel=0.05)
    # An engine already slower than the target needs no serving cost at all.
    assert calibrate_emit_s(planned, profile(), cfg, 0.001) == 0.0


def test_admission_control_refuses_a_burst_beyond_the_queue_bound_at_once() -> None:
    """The JE's ``admission.shed`` in the simulator: one device, one instance (min_replicas
    1, loaded before the burst), 2 slots. A burst of 30 beyond 1 x 2 queued is refused at
    once with 503 (no capacity is coming: the only device serves); the rest complete. With
    admission off none is refused and all queue."""
    warm = [(0.0, 50, 4)]
    burst = [(30.0 + i * 0.001, 50, 200) for i in range(30)]
    planned = plan(trace(*warm, *burst), model="m")
    base = dict(devices=1, pool_size=1, min_replicas=1, **NO_NET)

    results, stats = simulate(planned, {"m": profile(max_num_seqs=2)}, SimConfig(**base))
    refused = [r for r in results if r.status == 503]
    assert stats.shed == len(refused) > 0
    assert all(r.error.startswith("overloaded") and r.sent_s >= 30 for r in refused)
    assert all(r.ok for r in results if r.status != 503)
    assert sum(r.ok for r in results) >= 1 + 2 + 2  # warm-up, the batch, the queue bound

    results, stats = simulate(
        planned, {"m": profile(max_num_seqs=2)}, SimConfig(**base, max_queued_per_slot=0)
    )
    assert stats.shed == 0 and all(r.status != 503 or "no_capacity" in r.error for r in results)


def test_a_heartbeat_during_a_prompts_first_iteration_reports_it() -> None:
    """A prompt the engine admitted is the TE's work from then on: a heartbeat while its
    first (here its only) prefill iteration runs reports it, so the JE's ledger keeps it and
    routing sees the TE busy (a report without it ended its ledger entry, and the next long
    prompt went to a TE whose KV it did not fit)."""
    seen: list[tuple[float, int, int]] = []

    class Watched(Simulation):
        def _report(self, te) -> None:  # a heartbeat reaching the view
            super()._report(te)
            v = self._view[te.te_id]
            if v.state == TEState.READY:
                seen.append((self.now - EPOCH, v.running + v.waiting, v.queued_prompt_tokens))

    # 2,000 prompt tokens at 10 ms each: one 20 s iteration from the load's end (2 s).
    p = profile(prefill_s=0.01, max_prefill_tokens=4096)
    sim = Watched(plan(trace((0.0, 2000, 4)), model="m"), {"m": p}, SimConfig(devices=1, **NO_NET))
    sim.run()
    during = [(n, q) for t, n, q in seen if 3.0 <= t <= 21.0]
    assert during  # a TE reports at the heartbeat after its work changed
    assert set(during) == {(1, 2000)}
