"""Headroom and the order of a device's turns (LLM-Mesh): several model instances share one
device (the cores a node pool owns, or one GPU), and they run their iterations one at a
time, the next turn going to the instance that holds the request closest to missing its
SLO. Pure.

A request's next token is due at ``arrival + TTFT_SLO + TPOT_SLO × tokens_out`` (its first
at ``arrival + TTFT_SLO``; each later one a TPOT later); its headroom is that deadline less
now, negative once it is late (an SLO miss, counted in the metrics). Ordering turns by the
least headroom is earliest-deadline-first: under the device's capacity it meets every
deadline any order would.

The device's arbiter (which grants turns to the TE processes sharing a device), the job
executor's shadow validation (which plays the device's next turns forward before it admits
a request: ``services/job_executor/shadow.py``) and the simulator all order turns with
``next_turn``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping

from shared.slo import SLO


@dataclasses.dataclass(frozen=True, slots=True)
class RequestView:
    """One request an instance holds (waiting or running), as its deadlines see it. Times
    are seconds on one clock (the caller's: monotonic, or the simulation's)."""

    arrival: float
    prompt_tokens: int
    expected_output: int  # tokens it is expected to generate in all (at least 1)
    ttft_slo: float  # this request's TTFT limit (``SLO.ttft_limit_s`` of its prompt)
    tpot_slo: float
    computed_tokens: int = 0  # prompt tokens prefilled so far
    output_tokens: int = 0  # tokens generated so far
    id: str = ""

    def deadline(self) -> float:
        """When its next token is due."""
        return self.arrival + self.ttft_slo + self.tpot_slo * self.output_tokens

    def headroom(self, now: float) -> float:
        return self.deadline() - now


def request_view(
    slo: SLO,
    *,
    arrival: float,
    prompt_tokens: int,
    expected_output: int,
    computed_tokens: int = 0,
    output_tokens: int = 0,
    id: str = "",
) -> RequestView:
    """A request as ``slo`` sets its deadlines: the TTFT limit of its prompt's length, the
    TPOT, at least one token expected (the TE, its arbiter and the simulator all build
    their views here)."""
    return RequestView(
        arrival=arrival,
        prompt_tokens=prompt_tokens,
        expected_output=max(1, expected_output),
        ttft_slo=slo.ttft_limit_s(prompt_tokens),
        tpot_slo=slo.tpot_s,
        computed_tokens=computed_tokens,
        output_tokens=output_tokens,
        id=id,
    )


def earliest_deadline(requests: Iterable[RequestView]) -> float:
    """The most urgent of an instance's requests' deadlines (inf: it holds none)."""
    return min((r.deadline() for r in requests), default=math.inf)


def next_turn(deadlines: Mapping[str, float]) -> str | None:
    """The instance whose turn is next: the one with the earliest deadline among those with
    work (a finite deadline); ties go to the smaller name, so every reader agrees. None when
    no instance has work."""
    best: tuple[float, str] | None = None
    for instance, deadline in deadlines.items():
        if math.isfinite(deadline) and (best is None or (deadline, instance) < best):
            best = (deadline, instance)
    return None if best is None else best[1]
