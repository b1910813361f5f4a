"""The cluster as an operator reads it, from the cluster view: every model's readiness (an
instance ready, one loading, or the model at zero), the node pools and their TEs, the job
executors. Pure functions of the view; served as JSON at ``GET /admin/status`` (what
``meshserve status`` prints, and what a status page reads) and, for readiness, on every model
object of ``GET /v1/models``."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import msgspec

from shared.messages.cluster import ClusterView, TEHeartbeat, TEState


class Readiness(enum.StrEnum):
    READY = "ready"  # an instance serves it now
    LOADING = "loading"  # none serves it yet; one is loading (a request waits for it)
    AT_ZERO = "at_zero"  # no instance: the first request loads one (a cold start)


@dataclasses.dataclass(frozen=True, slots=True)
class ModelState:
    state: Readiness
    ready: int = 0  # instances serving it (ready, or draining their last requests)
    loading: int = 0

    def fields(self) -> dict[str, Any]:
        """As a model object's extra fields."""
        return {
            "state": str(self.state),
            "ready_instances": self.ready,
            "loading_instances": self.loading,
        }


def model_state(model: str, tes: list[TEHeartbeat]) -> ModelState:
    ready = sum(1 for te in tes if te.model == model and te.state == TEState.READY)
    loading = sum(1 for te in tes if te.model == model and te.state == TEState.LOADING)
    state = Readiness.READY if ready else Readiness.LOADING if loading else Readiness.AT_ZERO
    return ModelState(state, ready, loading)


def _te(te: TEHeartbeat, now: float) -> dict[str, Any]:
    kv_used = 1 - te.free_kv_blocks / te.total_kv_blocks if te.total_kv_blocks else None
    return {
        "id": te.te_id,
        "pool": te.pool_id,
        "host": te.host,
        "state": str(te.state),
        "model": te.model,
        "role": str(te.role),
        "engine": te.engine,
        "device": te.device,
        "running": te.running,
        "waiting": te.waiting,
        "kv_used": kv_used,
        # prompt tokens its prefix cache held, of those looked up, since its model loaded
        "cache_hit_rate": (
            te.prefix_cache_hits / te.prefix_cache_queries if te.prefix_cache_queries else None
        ),
        "adapters": list(te.adapters),
        "training": te.training,
        "generated_tokens": te.generated_tokens,
        "seen_s_ago": max(now - te.sent_at, 0.0) if te.sent_at else None,
    }


def status(
    view: ClusterView,
    now: float,
    *,
    traffic: dict[str, dict[str, Any]] | None = None,
    scale_events: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The whole view as a JSON body: models with their readiness, node pools with their
    TEs, job executors and frontends; and, as this frontend saw them lately
    (``recent.Recent``), each model's traffic (fine-tuned models by their own names) and the
    cluster's scale events."""
    pools: dict[str, dict[str, Any]] = {}
    for te in sorted(view.tes, key=lambda t: (t.pool_id, t.te_id)):
        pool = pools.setdefault(
            te.pool_id,
            {"id": te.pool_id, "hosts": [], "weight_server": te.weight_server, "tes": []},
        )
        if te.host not in pool["hosts"]:
            pool["hosts"].append(te.host)
        pool["tes"].append(_te(te, now))
    models = []
    for m in sorted(view.models, key=lambda m: m.id):
        st = model_state(m.id, view.tes)
        models.append({"id": m.id, "max_context": m.max_context, **st.fields()})
    return {
        "cluster": view.cluster,
        "version": view.version,
        "generated_at": view.generated_at,
        "models": models,
        "pools": list(pools.values()),
        "job_executors": [msgspec.to_builtins(je) for je in view.jes],
        "frontends": [msgspec.to_builtins(fe) for fe in view.frontends],
        "traffic": traffic or {},
        "scale_events": scale_events or [],
    }
