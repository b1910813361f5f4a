"""The control plane's needs (loadgen/control_plane.py): rates from what the simulation
counted, utilisations from per-message costs, the first limit, and the fleet size at which
each resource saturates."""

from __future__ import annotations

import pytest

from loadgen import control_plane as cp
from shared.messages import decoder_for, encode
from shared.messages.cluster import ClusterView

COSTS = cp.Costs(
    view_bytes_per_te=1000.0,
    view_encode_s_per_te=5e-6,
    view_decode_s_per_te=6e-6,
    heartbeat_decode_s=4e-6,
    placement_s=2e-4,
)


def _work(peak_place: int, peak_changes: int) -> cp.Work:
    return cp.Work(
        placements=peak_place + 10,
        placements_by_s={0: 10, 1: peak_place},
        view_changes_by_s={0: 1, 1: peak_changes},
        duration_s=2.0,
    )


def test_rates_are_the_busiest_seconds_spread_over_the_job_executors() -> None:
    got = cp.needs(_work(400, 30), cp.Fleet(tes=100, hosts=10, job_executors=4), COSTS)
    assert got.placements_per_s_per_je == 100
    assert got.mean_placements_per_s_per_je == pytest.approx(410 / 2 / 4)
    assert got.view_pushes_per_s == 31  # the changes and the periodic push
    assert got.heartbeats_per_s == 100 + 4 + 2
    assert got.view_bytes == 100_000
    subscribers = 2 + 4 + 2 + 1
    assert got.view_wire_bytes_per_s == pytest.approx(31 * 100_000 * subscribers)


def test_the_first_limit_is_the_most_used_resource_and_sizes_are_where_each_saturates() -> None:
    fleet = cp.Fleet(tes=1000, hosts=100)
    got = cp.needs(_work(400, 30), fleet, COSTS)
    assert [lim.utilisation for lim in got.limits] == sorted(
        (lim.utilisation for lim in got.limits), reverse=True
    )
    assert got.first is got.limits[0]
    payload = next(lim for lim in got.limits if lim.resource.startswith("NATS max_payload"))
    assert payload.utilisation == pytest.approx(1000 * 1000 / (1 << 20))
    assert payload.at_tes == pytest.approx((1 << 20) / 1000)
    # At the size it names, each CPU limit is at 100%: linear parts scale with k, view
    # parts with k² (a rate ∝ n times a view ∝ n).
    je = next(lim for lim in got.limits if lim.resource == "job executor CPU")
    assert je.at_tes is not None
    k = je.at_tes / 1000
    linear = 200 * COSTS.placement_s
    quadratic = 31 * COSTS.view_decode_s_per_te * 1000
    assert linear * k + quadratic * k * k == pytest.approx(1.0)


def test_a_bigger_view_makes_the_payload_the_first_limit() -> None:
    heavy = cp.Costs(2000.0, 1e-9, 1e-9, 1e-9, 1e-9)
    got = cp.needs(_work(10, 1), cp.Fleet(tes=1000, hosts=100), heavy)
    assert got.first.resource.startswith("NATS max_payload")
    assert got.first.utilisation > 1.0  # 2 MB: refused by a server with the default bound


def test_measured_costs_are_those_of_a_real_view_through_the_bus_codec() -> None:
    costs = cp.measure(1e-4, tes=200, repeat=2)
    view = ClusterView(
        cluster="c",
        version=1,
        generated_at=0.0,
        tes=[cp.representative_heartbeat(i) for i in range(200)],
        jes=[],
        frontends=[],
    )
    blob = encode(view)
    assert len(decoder_for(ClusterView).decode(blob).tes) == 200
    assert costs.view_bytes_per_te == pytest.approx(len(blob) / 200, rel=0.01)
    assert costs.view_encode_s_per_te > 0 and costs.view_decode_s_per_te > 0
    assert costs.placement_s == 1e-4
