"""What a job executor does with a job next: place it, hold it, or give up. Pure.

A job is held while no TE of its model can take it (none ready: the model is scaling from
zero or out; or every one refused) and placed as soon as one can, on a new cluster view.
TEs that refused it count until the next view; TEs it already failed on (``exclude``: it
was resubmitted from them) are a last resort, not banned: a TE that handed the job back
while draining may be the model's only instance. The job gives up when its placement
deadline passes. The services and the simulator both call ``next_step``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from services.job_executor.placement import NO_REQUEST, Placement, Request, pick_te
from services.job_executor.routing import DEFAULT_ROUTING, RoutingConfig
from services.views import TEView
from shared.messages.cluster import JobShare


@dataclasses.dataclass(frozen=True, slots=True)
class PendingJob:
    model: str
    deadline: float  # unix seconds
    exclude: frozenset[str] = frozenset()  # TEs it was resubmitted from
    refused: frozenset[str] = frozenset()  # TEs that refused it since the last view


@dataclasses.dataclass(frozen=True, slots=True)
class PlaceOn:
    te_id: str
    branch: str = dataclasses.field(default="", compare=False)  # why (the routing branch)


@dataclasses.dataclass(frozen=True, slots=True)
class Hold:
    urgent: bool  # no instance is ready or coming: tell the scaler now, not at the next report


@dataclasses.dataclass(frozen=True, slots=True)
class GiveUp:
    pass


Step = PlaceOn | Hold | GiveUp


def next_step(
    job: PendingJob,
    tes: Sequence[TEView],
    unreported: Mapping[str, JobShare],  # per TE, this JE's work its report does not show
    *,
    now: float,
    request: Request = NO_REQUEST,
    routing: RoutingConfig = DEFAULT_ROUTING,
) -> Step:
    def pick(exclude: frozenset[str]) -> Placement:
        return pick_te(job.model, tes, unreported, exclude, request, routing)

    decision = pick(job.refused | job.exclude)
    if decision.te_id is None and job.exclude:
        decision = pick(job.refused)
    if decision.te_id is not None:
        return PlaceOn(decision.te_id, decision.branch)
    if now >= job.deadline:
        return GiveUp()
    return Hold(urgent=decision.scale_up or bool(job.refused))
