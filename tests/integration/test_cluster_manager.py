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
from shared.messages.cluster import ClusterView, TEHeartbeat, TEState
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
    await watcher.start()
    await until(lambda: watcher.view.version >= 0)
    yield mgr, watcher
    await watcher.stop()
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
