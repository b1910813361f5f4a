"""Membership, liveness, the model registry and view pushes, on real NATS and Redis."""

import asyncio
import json
import time
from datetime import timedelta
from pathlib import Path

import msgspec
import pytest

from services.cluster_manager.service import ClusterManager
from shared.bus import Bus
from shared.clients import ClusterClient, ViewWatcher
from shared.messages.base import decoder_for
from shared.messages.cluster import ClusterView, MemberDown, TEHeartbeat, TEState
from shared.runner import Lifecycle, ServiceFailed
from shared.settings import Settings
from shared.store import Store
from shared.subjects import Keys, Subjects

pytestmark = [pytest.mark.nats, pytest.mark.redis]


def fake_checkpoint(root: Path, name: str, context: int) -> None:
    d = root / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "max_position_embeddings": context})
    )
    (d / "model.safetensors").write_bytes(b"")
    (d / "tokenizer.json").write_text("{}")


def hb(te_id: str, state: TEState = TEState.IDLE, model: str | None = None) -> TEHeartbeat:
    return TEHeartbeat(
        te_id=te_id,
        pool_id="p",
        host="h",
        pid=1,
        state=state,
        started_at=time.time(),
        model=model,
        sent_at=time.time(),
    )


async def until(pred, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


@pytest.fixture
async def cm(bus: Bus, store: Store, cluster: str, tmp_path: Path):
    fake_checkpoint(tmp_path, "alpha", 4096)
    fake_checkpoint(tmp_path, "beta", 8192)
    (tmp_path / "not-a-model").mkdir()
    settings = Settings(
        cluster=cluster,
        models_dir=tmp_path,
        heartbeat_interval=timedelta(seconds=0.2),
        liveness_timeout=timedelta(seconds=1),
    )
    mgr = ClusterManager(settings=settings, bus=bus, store=store)
    task = asyncio.create_task(mgr.run())
    watcher = ViewWatcher(bus, Subjects(cluster))
    life = Lifecycle("test")
    await watcher.start(life)
    await until(lambda: watcher.view.version >= 0)
    yield mgr, watcher
    await life.cancel_tasks()
    await mgr.shutdown()
    await task


async def test_registry_lists_checkpoints_and_is_stored_in_redis(cm, store: Store, cluster: str):
    _, watcher = cm
    assert [(m.id, m.max_context) for m in watcher.view.models] == [("alpha", 4096), ("beta", 8192)]
    stored = await store.hash_items(Keys(cluster).models())
    assert set(stored) == {"alpha", "beta"}
    assert json.loads(stored["beta"])["architecture"] == "LlamaForCausalLM"


async def test_join_state_change_and_death_are_pushed(cm, bus: Bus, cluster: str):
    _, watcher = cm
    client = ClusterClient(bus, Subjects(cluster))
    await client.heartbeat(hb("te-a"))
    await until(lambda: [t.te_id for t in watcher.view.tes] == ["te-a"])
    v = watcher.view.version
    await client.heartbeat(hb("te-a", TEState.READY, "alpha"))
    await until(lambda: watcher.view.tes[0].state == TEState.READY)
    assert watcher.view.version > v and watcher.view.tes[0].model == "alpha"
    # Silence: after the liveness timeout (1 s) the TE leaves the view.
    t0 = time.monotonic()
    await until(lambda: not watcher.view.tes, timeout=4)
    assert time.monotonic() - t0 >= 0.8


async def test_leave_removes_at_once(cm, bus: Bus, cluster: str):
    _, watcher = cm
    client = ClusterClient(bus, Subjects(cluster))
    await client.heartbeat(hb("te-b"))
    await until(lambda: len(watcher.view.tes) == 1)
    await client.leave("te-b")
    await until(lambda: not watcher.view.tes, timeout=0.8)


async def test_get_view_answers_on_demand(cm, bus: Bus, cluster: str):
    view = await ClusterClient(bus, Subjects(cluster)).get_view()
    assert isinstance(view, ClusterView) and view.cluster == cluster
    assert msgspec.json.encode(view)


async def test_a_silent_member_is_declared_down_at_its_deadline(cm, bus: Bus, cluster: str):
    """One notice, published when the liveness deadline (1 s after the last heartbeat)
    passes: not a sweep period later."""
    downs: list[tuple[float, MemberDown]] = []
    dec = decoder_for(MemberDown)

    async def on_down(m) -> None:  # type: ignore[no-untyped-def]
        downs.append((time.monotonic(), dec.decode(m.data)))

    await bus.subscribe_raw(Subjects(cluster).member_down(), on_down)
    client = ClusterClient(bus, Subjects(cluster))
    for _ in range(3):
        await client.heartbeat(hb("te-q"))
        await bus.flush()
        last = time.monotonic()
        await asyncio.sleep(0.3)
    await until(lambda: bool(downs), timeout=4)
    at, msg = downs[0]
    assert msg.member_id == "te-q" and "heartbeat" in msg.reason
    assert 1.0 <= at - last < 1.15, at - last


async def test_a_dead_background_loop_takes_the_service_down(
    bus: Bus, store: Store, cluster: str, tmp_path, monkeypatch: pytest.MonkeyPatch
):
    """A loop that dies (here the sweeper) must not leave a cluster manager that looks alive
    and declares nobody dead: run() ends with the reason, so the process exits non-zero and
    the launcher starts a fresh one (tests/e2e/test_lifecycle.py)."""

    async def broken_sweeper(self) -> None:  # type: ignore[no-untyped-def]
        await asyncio.sleep(0.2)
        raise RuntimeError("injected fault")

    monkeypatch.setattr(ClusterManager, "_sweeper", broken_sweeper)
    settings = Settings(cluster=cluster, models_dir=tmp_path)
    mgr = ClusterManager(settings=settings, bus=bus, store=store)
    with pytest.raises(ServiceFailed, match="injected fault"):
        await asyncio.wait_for(mgr.run(), 5)
