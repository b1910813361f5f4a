"""The operator's view of the cluster (services/frontend/status.py): each model's readiness
and the node pools with their TEs, from a cluster view."""

from __future__ import annotations

from services.admin_cli import status_tables
from services.frontend.status import Readiness, model_state, status
from shared.messages.cluster import ClusterView, ModelInfo, TEHeartbeat, TEState


def _te(te_id: str, state: TEState, model: str | None, pool: str = "p1") -> TEHeartbeat:
    return TEHeartbeat(
        te_id=te_id,
        pool_id=pool,
        host=f"host-{pool}",
        pid=1,
        state=state,
        started_at=0,
        model=model,
        sent_at=100.0,
        free_kv_blocks=25,
        total_kv_blocks=100,
    )


VIEW = ClusterView(
    cluster="c",
    version=7,
    generated_at=100.0,
    tes=[
        _te("a", TEState.READY, "m1"),
        _te("b", TEState.READY, "m1"),
        _te("c", TEState.LOADING, "m2", pool="p2"),
        _te("d", TEState.IDLE, None, pool="p2"),
    ],
    models=[
        ModelInfo(id=m, path="/x", architecture="llama", max_context=64, created=0)
        for m in ("m1", "m2", "m3")
    ],
)


def test_each_models_readiness():
    m1, m2, m3 = (model_state(m, VIEW.tes) for m in ("m1", "m2", "m3"))
    assert (m1.state, m1.ready, m1.loading) == (Readiness.READY, 2, 0)
    assert (m2.state, m2.ready, m2.loading) == (Readiness.LOADING, 0, 1)
    assert (m3.state, m3.ready, m3.loading) == (Readiness.AT_ZERO, 0, 0)
    assert m3.fields() == {"state": "at_zero", "ready_instances": 0, "loading_instances": 0}


def test_the_status_body_groups_tes_by_pool(capsys):
    body = status(VIEW, now=101.5)
    assert [m["state"] for m in body["models"]] == ["ready", "loading", "at_zero"]
    assert [(p["id"], p["hosts"], [t["id"] for t in p["tes"]]) for p in body["pools"]] == [
        ("p1", ["host-p1"], ["a", "b"]),
        ("p2", ["host-p2"], ["c", "d"]),
    ]
    a = body["pools"][0]["tes"][0]
    assert (a["kv_used"], a["seen_s_ago"]) == (0.75, 1.5)
    status_tables(body)
    out = capsys.readouterr().out
    assert "pool p2 on host-p2" in out and "at_zero" in out and "75%" in out
