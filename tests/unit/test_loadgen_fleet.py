"""The fleet over time (``loadgen/fleet.py``): the scaler's figures held from one tick to
the next and split at bucket edges, a model the scaler stops deciding for holding nothing,
the requests beside them, and a simulation whose buckets add up to its instance-seconds."""

from __future__ import annotations

import dataclasses

import pytest

from loadgen.fleet import FleetTimeline, lines
from loadgen.plan import plan
from loadgen.results import Result
from loadgen.simulator import SimConfig, simulate
from loadgen.traces import TraceRequest
from services.scaler.target import Target
from shared.slo import SLO
from tests.unit.test_loadgen_simulator import profile

BASE = Target(
    model="m",
    current=0,
    ready=0,
    wanted=0,
    stable_load=0.0,
    panic_load=0.0,
    backlog=0,
    slo_attainment=None,
    panicking=False,
    idle=False,
    reason="load",
)


def at(current: int, wanted: int, reason: str = "load", **kw) -> Target:
    return dataclasses.replace(BASE, current=current, ready=current, wanted=wanted,
                               reason=reason, **kw)  # fmt: skip


def result(t: float, ttft: float | None) -> Result:
    return Result(
        index=0,
        model="m",
        scheduled_s=t,
        sent_s=t,
        input_tokens=100,
        output_tokens=1,
        ttft_s=ttft,
        e2e_s=ttft,
        status=200 if ttft is not None else 503,
        error=None if ttft is not None else "refused",
    )


def test_figures_hold_until_the_next_tick_and_split_at_bucket_edges() -> None:
    fleet = FleetTimeline(bucket_s=30)
    fleet.note(0.0, {"m": at(2, 3)})
    fleet.note(45.0, {"m": at(4, 4, "burst", slo_attainment=0.9)})
    fleet.note(60.0, {"m": at(4, 1, peak=3)})  # scale-in not due; the SLO peak keeps 3
    fleet.close(70.0)
    slo = SLO(ttft_s=1.0, ttft_per_input_token_s=0.0)
    rows = fleet.rows([result(1.0, 0.5), result(31.0, 2.0), result(59.0, None)], slo)
    assert [(r["t_s"], r["model"]) for r in rows] == [(0.0, "m"), (30.0, "m"), (60.0, "m")]
    first, second, third = rows
    assert first["instance_s"] == 60.0 and first["instances"] == 2.0
    assert first["wanted"] == 3.0 and first["reasons"] == {"load": 30.0}
    assert (first["arrived"], first["missed"]) == (1, 0)
    # 15 s at 2, then 15 s at 4 (wanted 3, then 4) under each reason.
    assert second["instance_s"] == 90.0 and second["instances"] == 3.0
    assert second["wanted"] == 3.5 and second["max_instances"] == 4
    assert second["reasons"] == {"burst": 15.0, "load": 15.0}
    assert second["slo_attainment_scaler"] == 0.9
    assert (second["arrived"], second["missed"]) == (2, 2)  # late, and refused
    assert first["above_wanted_s"] == second["above_wanted_s"] == 0.0
    # 10 s of 4 instances where 1 was wanted: 30 instance-s beyond it, 20 the peak kept.
    assert third["instance_s"] == 40.0 and third["above_wanted_s"] == 30.0
    assert third["peak_held_s"] == 20.0
    report = lines(rows)
    assert report[0].startswith("fleet: 190 instance-s") and "30 of them beyond" in report[0]
    assert "20 kept by its SLO peak memory" in report[0]
    assert report[2].strip().startswith("30 s m: 2 of 2 missed")


def test_a_model_the_scaler_leaves_out_holds_nothing_and_arrivals_alone_show() -> None:
    fleet = FleetTimeline(bucket_s=10)
    fleet.note(0.0, {"m": at(1, 1), "n": at(2, 2)})
    fleet.note(5.0, {"n": at(2, 2)})  # m is at zero with no demand: not decided
    fleet.close(20.0)
    rows = fleet.rows([result(25.0, 0.1)], SLO(ttft_s=1.0, ttft_per_input_token_s=0.0))
    by = {(r["t_s"], r["model"]): r for r in rows}
    assert by[0.0, "m"]["instance_s"] == 5.0
    assert (10.0, "m") not in by
    assert by[0.0, "n"]["instance_s"] == 20.0 and by[10.0, "n"]["instance_s"] == 20.0
    assert by[20.0, "m"]["instance_s"] == 0.0 and by[20.0, "m"]["arrived"] == 1
    assert len(lines(rows)) == 1  # the totals; nothing missed


def test_bucket_must_be_positive() -> None:
    with pytest.raises(ValueError):
        FleetTimeline(bucket_s=0)


def test_a_simulation_fills_it_from_the_scaler_it_runs() -> None:
    """A burst on a fleet that scales out from zero and back in: the buckets' instances are
    the scaler's (ready and loading, not draining), within a few percent of the simulator's
    own instance-seconds (which count a draining instance too)."""
    reqs = [
        TraceRequest(arrival_s=0.05 * i, input_tokens=400, output_tokens=40) for i in range(600)
    ]
    planned = plan(reqs, model="m")
    fleet = FleetTimeline(bucket_s=10)
    cfg = SimConfig(devices=4, keep_alive_s=20, stable_window_s=10, network_s=0.0)
    results, stats = simulate(planned, {"m": profile()}, cfg, fleet=fleet)
    rows = fleet.rows(results, cfg.slo)
    assert sum(r["arrived"] for r in rows) == 600
    assert max(r["max_instances"] for r in rows) == stats.peak_replicas["m"] > 1
    total = stats.instance_seconds + stats.tail_instance_seconds
    assert sum(r["instance_s"] for r in rows) == pytest.approx(total, rel=0.05)
    assert {"load"} <= {reason for r in rows for reason in r["reasons"]}
    assert all(0 <= r["peak_held_s"] <= r["above_wanted_s"] <= r["instance_s"] for r in rows)
    # After the burst the fleet waits out its scale-in (stable window, then keep-alive).
    assert sum(r["above_wanted_s"] for r in rows) > 0
