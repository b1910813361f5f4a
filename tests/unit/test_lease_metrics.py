"""The frontend's ``meshserve_kv_lease_ends_total``: the growth of each prefill TE's lease
ends, by how they ended, across cluster views (a restarted TE counts from zero, one missing
from a view from where it was)."""

from __future__ import annotations

from prometheus_client import REGISTRY

from services.frontend.accounting import LeaseEnds
from shared.messages.cluster import ClusterView, TEHeartbeat, TEState

MODEL = "lease-metrics-model"


def _view(version: int, started: float = 0.0, **ends: dict[str, int]) -> ClusterView:
    tes = [
        TEHeartbeat(
            te_id=te_id,
            pool_id="p",
            host="h",
            pid=1,
            state=TEState.READY,
            started_at=started if te_id == "a" else 0.0,
            model=MODEL,
            kv_lease_ends=counts,
        )
        for te_id, counts in ends.items()
    ]
    return ClusterView(cluster="c", version=version, generated_at=0.0, tes=tes)


def _total(reason: str) -> float:
    got = REGISTRY.get_sample_value(
        "meshserve_kv_lease_ends_total", {"model": MODEL, "reason": reason}
    )
    return got or 0.0


def test_lease_ends_count_what_each_te_added() -> None:
    ends = LeaseEnds()
    ends.on_view(_view(1, a={"released": 3}, b={"expired": 1}))
    assert (_total("released"), _total("expired")) == (3, 1)
    ends.on_view(_view(2, a={"released": 5, "expired": 1}, b={"expired": 1}))
    assert (_total("released"), _total("expired")) == (5, 2)
    # te a restarted (a new start time): its counts start again from zero.
    ends.on_view(_view(3, 9.0, a={"released": 1}, b={"expired": 1}))
    ends.on_view(_view(4, 9.0, a={"released": 2}, b={"expired": 1}))
    assert _total("released") == 7
    # Missing from a view and back (the same process): nothing counted twice.
    ends.on_view(_view(5, 9.0, b={"expired": 1}))
    ends.on_view(_view(6, 9.0, a={"released": 3}, b={"expired": 1}))
    assert (_total("released"), _total("expired")) == (8, 2)


def test_a_prefill_te_counts_its_lease_ends_by_kind() -> None:
    """The heartbeat's counts are keyed by the kind of end, never by its free text (the
    metric's labels stay a handful)."""
    from services.task_executor.disaggregation import PrefillSide
    from shared.settings import Settings

    told: list[tuple[str, str]] = []
    side = PrefillSide(Settings(), lambda key, reason: told.append((key, reason)))
    end = side._server._on_end
    for key, reason in [
        ("a", "released"),
        ("b", "rejected: no room for 4096 tokens"),
        ("c", "rejected: shutting down"),
        ("d", "failed: layer 3 lacks tokens [0, 16)"),
        ("e", "cancelled"),
    ]:
        end(key, reason)
    assert side.ends == {"released": 1, "rejected": 2, "failed": 1, "cancelled": 1}
    assert told[1] == ("b", "rejected: no room for 4096 tokens")  # the TE still hears why
