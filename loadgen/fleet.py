"""The fleet over time in ``meshserve-loadgen simulate``: for each model and each bucket of
simulated time (``bucket_s``, 30 s by default), the instances it held (loading or serving,
as the scaler counts them), how many were ready, how many the scaler wanted and why (the
seconds under each of ``Target.reason``), the instance-seconds beyond what it wanted (a
scale-in not due yet) and of those the ones its SLO peak memory kept, the scaler's SLO
window at the bucket's end, and beside them the requests that arrived in the bucket and
those of them that missed the SLO. Written as ``fleet.jsonl`` in the run's directory (and
plotted as ``fleet_over_time.png``): where the instance-seconds went and which bursts
missed, without a recorder of one's own.

``FleetTimeline.note`` takes every scaler tick's ``Target``s (the figures of a tick hold
until the next; ``simulate(..., fleet=...)`` calls it); ``rows`` adds the requests. Times
are seconds from the replay's start."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loadgen.report import slo_met
from loadgen.results import Result
from services.scaler.target import Target
from shared.slo import SLO

BUCKET_S = 30.0


@dataclasses.dataclass(slots=True)
class _Bucket:
    instance_s: float = 0.0  # current (ready + loading) x seconds
    above_s: float = 0.0  # of those, beyond what the scaler wanted (scale-in not yet due)
    peak_s: float = 0.0  # of those, what its SLO peak memory kept (``Target.peak``)
    ready_s: float = 0.0
    wanted_s: float = 0.0
    max_instances: int = 0
    reasons: dict[str, float] = dataclasses.field(default_factory=dict)  # seconds under each
    slo_attainment: float | None = None  # the scaler's SLO window at its last tick here


class FleetTimeline:
    """Each model's fleet per bucket of simulated time, from the scaler's ticks."""

    def __init__(self, bucket_s: float = BUCKET_S) -> None:
        if bucket_s <= 0:
            raise ValueError("bucket_s must be positive")
        self.bucket_s = bucket_s
        self._last: dict[str, tuple[float, Target]] = {}  # model -> its last tick's figures
        self._buckets: dict[tuple[str, int], _Bucket] = {}

    def note(self, now: float, targets: Mapping[str, Target]) -> None:
        """A scaler tick at ``now`` (seconds from the start) decided ``targets``: each model's
        previous figures held until now. A model the tick left out (at zero, no demand)
        holds nothing from now on."""
        for model, (since, t) in self._last.items():
            self._spread(model, since, now, t)
        self._last = {model: (now, t) for model, t in targets.items()}
        for model, t in targets.items():
            b = self._bucket(model, now)
            b.max_instances = max(b.max_instances, t.current)
            if t.slo_attainment is not None:
                b.slo_attainment = t.slo_attainment

    def close(self, now: float) -> None:
        """The run ended at ``now``: the last figures hold until then."""
        self.note(now, {})

    def _bucket(self, model: str, at: float) -> _Bucket:
        key = (model, int(at // self.bucket_s))
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = _Bucket()
        return b

    def _spread(self, model: str, since: float, until: float, t: Target) -> None:
        at = since
        while at < until:
            index = int(at // self.bucket_s)
            end = min(until, (index + 1) * self.bucket_s)
            dt = end - at
            if dt <= 0:  # float edge at a boundary: step into the next bucket
                at = (index + 1) * self.bucket_s + 1e-9
                continue
            b = self._bucket(model, at)
            b.instance_s += t.current * dt
            b.above_s += max(t.current - t.wanted, 0) * dt
            b.peak_s += max(min(t.current, t.peak) - t.wanted, 0) * dt
            b.ready_s += t.ready * dt
            b.wanted_s += t.wanted * dt
            b.max_instances = max(b.max_instances, t.current)
            b.reasons[t.reason] = b.reasons.get(t.reason, 0.0) + dt
            at = end

    def rows(self, results: Sequence[Result], slo: SLO) -> list[dict[str, Any]]:
        """One row per (model, bucket) that held instances or had arrivals, in time order:
        mean instances, ready and wanted over the bucket's length, the most instances,
        instance-seconds, seconds under each reason, the scaler's SLO window, and the
        requests that arrived (by their scheduled time) and missed the SLO."""
        arrived: dict[tuple[str, int], list[int]] = {}
        for r, met in zip(results, slo_met(results, slo), strict=True):
            key = (r.model, int(r.scheduled_s // self.bucket_s))
            counts = arrived.setdefault(key, [0, 0])
            counts[0] += 1
            counts[1] += not met
        out = []
        for model, index in sorted(set(self._buckets) | set(arrived), key=lambda k: (k[1], k[0])):
            b = self._buckets.get((model, index), _Bucket())
            n, missed = arrived.get((model, index), (0, 0))
            out.append(
                {
                    "t_s": index * self.bucket_s,
                    "model": model,
                    "instances": round(b.instance_s / self.bucket_s, 2),
                    "ready": round(b.ready_s / self.bucket_s, 2),
                    "wanted": round(b.wanted_s / self.bucket_s, 2),
                    "max_instances": b.max_instances,
                    "instance_s": round(b.instance_s, 1),
                    "above_wanted_s": round(b.above_s, 1),
                    "peak_held_s": round(b.peak_s, 1),
                    "reasons": {k: round(v, 1) for k, v in sorted(b.reasons.items())},
                    "slo_attainment_scaler": b.slo_attainment,
                    "arrived": n,
                    "missed": missed,
                }
            )
        return out


def lines(rows: Sequence[Mapping[str, Any]], worst: int = 5) -> list[str]:
    """For the report: the instance-seconds, those beyond what the scaler wanted and those
    its SLO peak memory kept; the run's buckets with the most misses (all of
    ``fleet.jsonl`` is in the file)."""
    total = sum(r["instance_s"] for r in rows)
    above = sum(r["above_wanted_s"] for r in rows)
    out = [
        f"fleet: {total:.0f} instance-s as the scaler counts them (ready and loading), "
        f"{above:.0f} of them beyond what it wanted (scale-in not due yet), "
        f"{sum(r['peak_held_s'] for r in rows):.0f} kept by its SLO peak memory"
    ]
    hit = sorted((r for r in rows if r["missed"]), key=lambda r: (-r["missed"], r["t_s"]))
    if not hit:
        return out
    out.append(f"buckets with the most SLO misses (of {len(rows)} in fleet.jsonl):")
    for r in hit[:worst]:
        why = max(r["reasons"], key=r["reasons"].get) if r["reasons"] else "-"
        out.append(
            f"  {r['t_s']:7.0f} s {r['model']}: {r['missed']} of {r['arrived']} missed; "
            f"instances {r['instances']:.1f} (at most {r['max_instances']}), wanted "
            f"{r['wanted']:.1f} (mostly by {why})"
        )
    return out


def write_fleet(out: Path, rows: Sequence[Mapping[str, Any]], *, plots: bool) -> list[str]:
    """``fleet.jsonl`` (and ``fleet_over_time.png`` where ``plots``) in ``out``; the report's
    lines about it."""
    with open(Path(out) / "fleet.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    if plots and rows:
        from loadgen.plots import plot_fleet

        plot_fleet(rows, Path(out) / "fleet_over_time.png")
    return lines(rows)
