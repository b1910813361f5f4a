"""One scaler decides at a time (``shared/leader.py``): replicas take a leader lease in Redis
in turn, each change of hands raising the epoch; a lapsed leader stops deciding before
another may start; two scaler replicas on one cluster make one load for one decision, the
other takes over when the leader stops, and a TE refuses a command from a deposed epoch; of
two cluster managers only the leader speaks, and the other takes over when it is cut off."""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import timedelta
from pathlib import Path

import pytest

from services.cluster_manager.service import ClusterManager
from services.scaler.service import Scaler
from services.task_executor.worker import TaskExecutor
from shared.leader import SCALER, LeaderLease, stale
from shared.messages.cluster import ClusterView, FEHeartbeat, MemberDown, TEState
from shared.messages.scaling import ControlAck, LoadModel, UnloadModel
from shared.store import Store
from shared.subjects import Keys, Subjects
from tests.integration.services import BusClient, Running, fast_settings

pytestmark = [pytest.mark.nats, pytest.mark.redis]


async def test_replicas_take_the_lease_in_turn_and_a_passed_epoch_is_stale(
    cluster: str, redis_url: str
) -> None:
    store = await Store.connect(redis_url)
    try:
        a = LeaderLease(store, cluster, SCALER, "a", 0.6)
        b = LeaderLease(store, cluster, SCALER, "b", 0.6)
        assert await a.try_take() and a.epoch == 1
        assert not await b.try_take() and not b.leading()
        assert await a.try_take() and a.epoch == 1  # renewed, same epoch
        # a renews no more: it stops counting itself leader before Redis lets b take over.
        await asyncio.sleep(0.5)
        assert not a.leading()
        assert await store.redis.pttl(Keys(cluster).leader(SCALER)) > 0
        assert not await b.try_take()
        await asyncio.sleep(0.2)
        assert await b.try_take() and b.epoch == 2
        assert not await a.try_take()
        assert await stale(store, cluster, SCALER, 1)
        assert not await stale(store, cluster, SCALER, 2)
        assert not await stale(store, cluster, SCALER, 0)  # no leader's: an operator's
        await b.release()  # a clean stop: the next takes over at once
        assert not b.leading()
        assert await a.try_take() and a.epoch == 3
    finally:
        await store.close()


async def test_two_scalers_make_one_load_and_the_second_takes_over(
    cluster: str, nats_url: str, redis_url: str, tmp_path: Path, demo_model_dir: Path
) -> None:
    (tmp_path / "demo").symlink_to(demo_model_dir)
    settings = fast_settings(
        cluster,
        nats_url,
        redis_url,
        tmp_path,
        model_scaling={"demo": {"min_replicas": 1}},
        leader_lease=timedelta(seconds=1),
    )
    run = Running(settings, nats_url)
    stores = [await Store.connect(redis_url) for _ in range(3)]
    try:
        await run.start(lambda bus: ClusterManager(settings=settings, bus=bus, store=stores[0]))
        for i, te in enumerate(("te-a", "te-b")):
            store = stores[1 + i]
            await run.start(
                lambda bus, te=te, store=store: TaskExecutor(
                    settings=settings, bus=bus, te_id=te, pool_id="p", store=store
                )
            )
        client: BusClient = await run.start(lambda bus: BusClient(settings, bus))
        await client.started.wait()
        scalers: list[Scaler] = []
        sent: dict[str, list[LoadModel | UnloadModel]] = {}
        for _ in range(2):
            scaler: Scaler = await run.start(lambda bus: Scaler(settings=settings, bus=bus))
            scalers.append(scaler)
            sent[scaler.replica_id] = _record(scaler)

        def ready() -> list[str]:
            return [
                t.te_id
                for t in client.view.view.tes
                if t.model == "demo" and t.state == TEState.READY
            ]

        await client.until(lambda v: len(ready()) == 1, 60)
        await asyncio.sleep(2.0)  # ten ticks and more: no second load
        assert len(ready()) == 1
        (leader,) = [s for s in scalers if s.lease is not None and s.lease.leading()]
        (other,) = [s for s in scalers if s is not leader]
        loads = [c for c in sent[leader.replica_id] if isinstance(c, LoadModel)]
        assert len(loads) == 1 and loads[0].fence == leader.lease.epoch  # type: ignore[union-attr]
        assert sent[other.replica_id] == []  # the other decided nothing
        # The leader stops: the other takes over (at once: a clean stop lets the lease go)
        # and decides, with a new epoch: the model unloaded by hand is loaded again.
        first_epoch = leader.lease.epoch  # type: ignore[union-attr]
        await leader.shutdown()
        for _ in range(50):
            if other.lease is not None and other.lease.leading():
                break
            await asyncio.sleep(0.1)
        assert other.lease is not None and other.lease.leading()
        assert other.lease.epoch == first_epoch + 1
        (te,) = ready()
        ack = await client.tes.control(te, UnloadModel(reason="test"))
        assert ack.ok, ack
        await client.until(lambda v: not ready(), 30)
        await client.until(lambda v: len(ready()) == 1, 60)
        loads = [c for c in sent[other.replica_id] if isinstance(c, LoadModel)]
        assert loads and all(c.fence == other.lease.epoch for c in loads)
        # A late command from the deposed leader's epoch is refused by the TE.
        (idle,) = [t.te_id for t in client.view.view.tes if t.te_id not in ready()]
        late = LoadModel(model="demo", path=str(tmp_path / "demo"), fence=first_epoch)
        ack = await client.tes.control(idle, late)
        assert not ack.ok and ack.error is not None and "stale" in ack.error
    finally:
        await run.stop()
        for store in stores:
            await store.close()


def _record(scaler: Scaler) -> list[LoadModel | UnloadModel]:
    """The scaling commands ``scaler`` sends, as it sends them."""
    sent: list[LoadModel | UnloadModel] = []
    control = scaler._tes.control

    async def recording(te_id: str, cmd: LoadModel | UnloadModel) -> ControlAck:  # type: ignore[override]
        sent.append(cmd)
        return await control(te_id, cmd)

    scaler._tes.control = recording  # type: ignore[method-assign,assignment]
    return sent


async def test_two_cluster_managers_one_speaks_and_the_other_takes_over(
    cluster: str, nats_url: str, redis_url: str, tmp_path: Path
) -> None:
    """Two cluster managers follow the same heartbeats; only the leader pushes the view and
    tells members down. Killed outright together with a member (one host cut), the other
    takes over within the lease, tells that member down and pushes views of a newer epoch."""
    settings = fast_settings(
        cluster, nats_url, redis_url, tmp_path, leader_lease=timedelta(seconds=1)
    )
    run = Running(settings, nats_url)
    stores = [await Store.connect(redis_url) for _ in range(2)]
    views: list[ClusterView] = []
    downs: list[str] = []
    try:
        cms: list[ClusterManager] = []
        for store in stores:
            cms.append(
                await run.start(
                    lambda bus, store=store: ClusterManager(settings=settings, bus=bus, store=store)
                )
            )
        client: BusClient = await run.start(lambda bus: BusClient(settings, bus))
        await client.started.wait()

        async def on_view(v: ClusterView) -> None:
            views.append(v)

        async def on_down(m: MemberDown) -> None:
            downs.append(m.member_id)

        subjects = Subjects(cluster)
        subs = [
            await client.bus.subscribe(subjects.view(), {ClusterView: on_view}),
            await client.bus.subscribe(subjects.member_down(), {MemberDown: on_down}),
        ]
        beating = True

        async def beat() -> None:  # a frontend that lives on the leader's host
            hb = FEHeartbeat(frontend_id="fe-x", host="h", pid=1, started_at=time.time())
            while beating:
                await client.bus.publish(subjects.heartbeat(), hb)
                await asyncio.sleep(0.1)

        beater = asyncio.create_task(beat())
        for _ in range(50):
            if all(any(f.frontend_id == "fe-x" for f in v.frontends) for v in views[-2:]) and views:
                break
            await asyncio.sleep(0.1)
        (leader,) = [c for c in cms if c.lease.leading()]
        (other,) = [c for c in cms if c is not leader]
        epoch = leader.lease.epoch
        views.clear()
        await asyncio.sleep(0.6)  # three pushes and more
        assert views and all(v.version >> 32 == epoch for v in views)  # the leader's only
        assert any(f.frontend_id == "fe-x" for f in other.view().frontends)  # followed too
        # The leader's host is cut: the leader and the frontend go silent at once.
        beating = False
        await beater
        await run.kill(leader)
        cut = time.monotonic()
        for _ in range(60):
            if "fe-x" in downs and other.lease.leading():
                break
            await asyncio.sleep(0.1)
        assert other.lease.leading() and other.lease.epoch == epoch + 1
        assert "fe-x" in downs, downs
        assert time.monotonic() - cut < 4  # lease 1 s, liveness 1 s
        await asyncio.sleep(0.5)
        newer = [v for v in views if v.version >> 32 == epoch + 1]
        assert newer and not any(f.frontend_id == "fe-x" for f in newer[-1].frontends)
        for sub in subs:
            await sub.close()
    finally:
        await run.stop()
        for store in stores:
            with contextlib.suppress(Exception):
                await store.close()
