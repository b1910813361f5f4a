"""What the cluster manager serves at its ``/metrics``: the members it counts, by kind, the
ones it declared gone (silent past the liveness deadline, or left), and the models in its
registry; whether this replica leads."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

MEMBERS = Gauge("meshserve:cluster_members", "Members in the cluster view, by kind", ["kind"])
MEMBERS_GONE = Counter(
    "meshserve:cluster_members_gone",
    "Members declared gone, by kind and why: silent (no heartbeat within the liveness "
    "deadline) or left (a clean shutdown)",
    ["kind", "why"],
)
MODELS = Gauge("meshserve:registered_models", "Models in the registry (MESHSERVE_MODELS_DIR)")
LEADER = Gauge(
    "meshserve:cluster_manager_leader",
    "1 while this cluster manager replica holds the leader lease (pushes the view, tells "
    "members down), 0 while it follows",
)

KINDS = {"TEHeartbeat": "task_executor", "JEHeartbeat": "job_executor", "FEHeartbeat": "frontend"}


def kind_of(member: object) -> str:
    return KINDS.get(type(member).__name__, "other")
