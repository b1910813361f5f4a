"""The operator's view of the cluster (services/frontend/status.py): each model's readiness
and the node pools with their TEs, from a cluster view."""

from __future__ import annotations

from services.admin_cli import status_tables
from services.frontend.recent import Recent
from services.frontend.status import Readiness, model_state, status
from shared.messages.cluster import ClusterView, ModelInfo, TEHeartbeat, TEState
from shared.messages.scaling import ScaleEvent


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


def test_recent_traffic_per_model_and_minute():
    recent = Recent(window_s=600)
    t0 = 10_000.0
    # 10 requests a minute ago, 20 in the last minute (2 of them missing the SLO, 1 held)
    for k in range(10):
        recent.request("m1", at=t0 - 90 + k, ttft_s=0.1 * (k + 1), met=True, held=False)
    for k in range(20):
        recent.request("m1", at=t0 - 30 + k, ttft_s=0.05, met=k >= 2, held=k == 0)
    recent.request("old", at=t0 - 700, ttft_s=1.0, met=True, held=False)  # past the window
    got = recent.models(t0)
    assert set(got) == {"m1"}
    m1 = got["m1"]
    assert m1["requests"] == 30 and m1["held"] == 1
    assert m1["rate_per_s"] == 20 / 60
    assert m1["ttft_p50_s"] == 0.05 and m1["ttft_p95_s"] == 0.9  # 95th of 30: the 29th
    assert m1["slo_attainment"] == 28 / 30
    minutes = m1["minutes"]
    assert len(minutes) == 10 and minutes[-1]["requests"] == 20
    assert minutes[-1]["slo_attainment"] == 18 / 20 and minutes[0]["slo_attainment"] is None


def test_recent_scale_events_latest_first_and_in_the_status():
    recent = Recent()
    for k, kind in enumerate(("up", "down")):
        recent.scale_event(
            ScaleEvent(
                kind=kind, model="m1", te_id=f"t{k}", pool_id="p", total_s=1.5, steps={"te_load": 1}
            ),
            at=100.0 + k,
        )
    events = recent.scale_events()
    assert [(e["kind"], e["te"]) for e in events] == [("down", "t1"), ("up", "t0")]
    body = status(VIEW, now=101.5, traffic={"m1": {"requests": 1}}, scale_events=events)
    assert body["traffic"] == {"m1": {"requests": 1}} and body["scale_events"] == events
