"""What a job executor serves at its ``/metrics``: the jobs it took, by how each ended here
(placed on a TE, or refused: overloaded (admission control), no capacity within the
placement deadline, an unknown model, another error), those it held while their model
scaled, requests a KV preemption moved, and the jobs it is placing now."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from shared.errors import MeshserveError, NoCapacity, NotFound

JOBS = Counter(
    "meshserve:jobs",
    "Jobs a job executor took, by outcome: placed, overloaded (refused by admission control), "
    "no_capacity (placement deadline passed), not_found, error",
    ["model_name", "outcome"],
)
HELD = Counter(
    "meshserve:jobs_held", "Jobs held while their model scaled up or out", ["model_name"]
)
MOVED = Counter(
    "meshserve:jobs_moved",
    "Requests a KV preemption handed back, placed again: on the TE the preemption validated "
    "them on (validated), or elsewhere where that TE could not take them (rerouted)",
    ["model_name", "outcome"],
)
IN_FLIGHT = Gauge("meshserve:jobs_in_flight", "Jobs a job executor is placing now")


def outcome_of(error: MeshserveError) -> str:
    if error.code == "overloaded":
        return "overloaded"
    if isinstance(error, NoCapacity):
        return "no_capacity"
    if isinstance(error, NotFound):
        return "not_found"
    return "error"
