"""What the scaler serves at its ``/metrics``: each model's replicas as its rule sees them
(current, ready, wanted, peak; prefill instances) and its inputs (the stable window's load in
instances' worth, the SLO attainment it read), and the scale-ups that started from zero (a
cold start: a request waits for the load). Scale events themselves, with their steps, are
counted by every frontend (``frontend/accounting.py``), which hears each one."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import Counter, Gauge

from services.scaler.target import Target

LEADER = Gauge(
    "meshserve:scaler_leader",
    "1 while this scaler replica holds the leader lease and decides, 0 while it watches",
)
REPLICAS = Gauge(
    "meshserve:replicas",
    "A model's instances as the scaler counts them: current (ready and loading, not "
    "draining), ready, wanted (its rule's target), peak (after SLO misses, the most its "
    "panic window asked for within the stable window: scale-in keeps at least these; 0 "
    "otherwise), prefill_current, prefill_wanted",
    ["model_name", "kind"],
)
LOAD = Gauge(
    "meshserve:scaler_load_instances",
    "A model's work over the stable window, in instances' worth (what the rule sizes for)",
    ["model_name"],
)
SLO = Gauge(
    "meshserve:scaler_slo_attainment",
    "A model's SLO attainment over the scaler's window, as the frontends reported it",
    ["model_name"],
)
COLD_STARTS = Counter(
    "meshserve:cold_starts",
    "Scale-ups of a model that had no instance (a request waited for the load)",
    ["model_name"],
)


def observe_targets(targets: Mapping[str, Target]) -> None:
    for model, t in targets.items():
        for kind, value in (
            ("current", t.current),
            ("ready", t.ready),
            ("wanted", t.wanted),
            ("peak", t.peak),
            ("prefill_current", t.prefill_current),
            ("prefill_wanted", t.prefill_wanted),
        ):
            REPLICAS.labels(model, kind).set(value)
        LOAD.labels(model).set(t.stable_load)
        if t.slo_attainment is not None:
            SLO.labels(model).set(t.slo_attainment)
