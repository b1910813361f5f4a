"""Headroom and the order of a device's turns (LLM-Mesh): several model instances share one
device (the cores a node pool owns, or one GPU), and they run their iterations one at a
time, the next turn going to the instance that holds the request closest to missing its
SLO. Pure.

A request's next token is due at ``arrival + TTFT_SLO + TPOT_SLO × tokens_out`` (its first
at ``arrival + TTFT_SLO``; each later one a TPOT later); its headroom is that deadline less
now, negative once it is late (an SLO miss, counted in the metrics). Ordering turns by the
least headroom is earliest-deadline-first: under the device's capacity it meets every
deadline any order would. Except, where the engine lets late prompts yield
(``MESHSERVE_LATE_YIELD``), a prompt late by less than the bound goes behind every request
still in time (``yields``): the instance it waits on claims the turn after every instance
with a request in time (``Urgency``), as its engine serves it after its own in-time prompts.

The device's arbiter (which grants turns to the TE processes sharing a device), the job
executor's shadow validation (which plays the device's next turns forward before it admits
a request: ``services/job_executor/shadow.py``) and the simulator all order turns with
``next_turn``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import NamedTuple

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


def yields(headroom_s: float, late_yield_s: float) -> bool:
    """Whether a prompt with this headroom goes behind every request still in time: it is
    late by less than ``late_yield_s`` (0: none does). One late by more goes first: it waited
    long enough already; by then the bound no longer spares in-time prompts' deadlines."""
    return -late_yield_s < headroom_s <= 0


class Urgency(NamedTuple):
    """An instance's claim on its device's next turn (the lowest first): its most urgent
    request's deadline, behind every instance holding one in time when that request is a
    prompt that ``yields``."""

    yields: bool
    deadline: float


NO_WORK = Urgency(False, math.inf)


def request_claim(deadline: float, output_tokens: int, now: float, late_yield_s: float) -> Urgency:
    """One request's claim at ``now``: a request that has produced tokens never yields (its
    next token is due, and its engine runs it every iteration)."""
    return Urgency(output_tokens == 0 and yields(deadline - now, late_yield_s), deadline)


def claim_changes(deadline: float, output_tokens: int, now: float, late_yield_s: float) -> float:
    """When one request's claim (``request_claim``) next changes while its tokens stay as
    they are: a prompt's starts yielding at its deadline and stops once late by the bound
    (inf: never, as without late yield, or for a request that has produced tokens)."""
    if late_yield_s <= 0 or output_tokens:
        return math.inf
    return next((edge for edge in (deadline, deadline + late_yield_s) if now < edge), math.inf)


def urgency(requests: Iterable[RequestView], now: float, late_yield_s: float = 0.0) -> Urgency:
    """The claim of an instance holding ``requests`` at ``now``, its engine letting prompts
    late by less than ``late_yield_s`` yield: its most urgent request's."""
    return min(
        (request_claim(r.deadline(), r.output_tokens, now, late_yield_s) for r in requests),
        default=NO_WORK,
    )


def next_turn(claims: Mapping[str, Urgency]) -> str | None:
    """The instance whose turn is next: the lowest claim (``Urgency``; without late yield,
    the earliest deadline) among those with work (a finite deadline); ties go to the smaller
    name, so every reader agrees. None when no instance has work."""
    best: tuple[Urgency, str] | None = None
    for instance, claim in claims.items():
        if math.isfinite(claim.deadline) and (best is None or (claim, instance) < best):
            best = (claim, instance)
    return None if best is None else best[1]
