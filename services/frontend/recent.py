"""What this frontend saw in the last minutes, for an operator's status (``status.py``):
per model, its request rate, TTFT p50 and p95, SLO attainment minute by minute, held
requests; and the cluster's recent scale events with their steps. In memory, bounded by
``WINDOW_S``; each frontend reports its own requests (behind a load balancer, ask each)."""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

from shared.messages.scaling import ScaleEvent

WINDOW_S = 600.0  # what a status keeps
RATE_S = 60.0  # the window a request rate is measured over
MINUTE_S = 60.0
MAX_EVENTS = 50
MAX_REQUESTS = 100_000  # per model, within the window


@dataclasses.dataclass(frozen=True, slots=True)
class _Done:
    at: float  # unix seconds it ended
    ttft_s: float | None
    met: bool
    held: bool


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class Recent:
    def __init__(self, window_s: float = WINDOW_S) -> None:
        self._window_s = window_s
        self._requests: dict[str, collections.deque[_Done]] = {}
        self._events: collections.deque[tuple[float, ScaleEvent]] = collections.deque(
            maxlen=MAX_EVENTS
        )

    def request(
        self, model: str, *, at: float, ttft_s: float | None, met: bool, held: bool
    ) -> None:
        done = self._requests.setdefault(model, collections.deque(maxlen=MAX_REQUESTS))
        done.append(_Done(at, ttft_s, met, held))
        self._trim(done, at)

    def scale_event(self, event: ScaleEvent, at: float) -> None:
        self._events.append((at, event))

    def _trim(self, done: collections.deque[_Done], now: float) -> None:
        while done and done[0].at < now - self._window_s:
            done.popleft()

    def models(self, now: float) -> dict[str, dict[str, Any]]:
        """Per model: requests a second over the last minute, TTFT p50/p95 (s) and SLO
        attainment over the window, held requests, attainment per minute (oldest first)."""
        out: dict[str, dict[str, Any]] = {}
        for model, done in self._requests.items():
            self._trim(done, now)
            if not done:
                continue
            ttfts = [d.ttft_s for d in done if d.ttft_s is not None]
            minutes: list[dict[str, Any]] = []
            first = now - self._window_s
            for k in range(int(self._window_s // MINUTE_S)):
                start = first + k * MINUTE_S
                inside = [d for d in done if start <= d.at < start + MINUTE_S]
                minutes.append(
                    {
                        "start": round(start, 3),
                        "requests": len(inside),
                        "slo_attainment": (
                            sum(d.met for d in inside) / len(inside) if inside else None
                        ),
                    }
                )
            out[model] = {
                "requests": len(done),
                "rate_per_s": sum(1 for d in done if d.at >= now - RATE_S) / RATE_S,
                "ttft_p50_s": _quantile(ttfts, 0.5),
                "ttft_p95_s": _quantile(ttfts, 0.95),
                "slo_attainment": sum(d.met for d in done) / len(done),
                "held": sum(d.held for d in done),
                "minutes": minutes,
            }
        return out

    def scale_events(self) -> list[dict[str, Any]]:
        """The latest first."""
        return [
            {
                "at": at,
                "kind": e.kind,
                "model": e.model,
                "te": e.te_id,
                "ok": e.ok,
                "reason": e.reason,
                "total_s": e.total_s,
                "steps": dict(e.steps),
            }
            for at, e in reversed(self._events)
        ]
