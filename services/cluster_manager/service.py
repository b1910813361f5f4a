"""The cluster manager service.

Several replicas may run. Each follows every member's heartbeats and leaves, sweeps the
silent ones from its own state and answers ``GetView`` from it (they hold the same view);
only the one holding the cluster manager's leader lease (``shared/leader.py``) speaks for
the cluster: it pushes the view, tells ``MemberDown``, forgets a gone TE's prompt-index
entries and writes the model registry. A replica that takes over tells ``MemberDown`` again
for the members it swept in the last lease and liveness timeout (the deposed leader may
have died with them before it could), and pushes its view at once; its versions carry its
epoch, so they supersede the deposed leader's."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import msgspec

from services.cluster_manager import metrics
from services.cluster_manager.membership import Member, expired, identity, member_id
from services.cluster_manager.registry import scan_models
from shared.bus import Bus
from shared.errors import MeshserveError
from shared.kv_index_store import KvIndexStore
from shared.leader import CLUSTER_MANAGER, LeaderLease
from shared.logging import get_logger
from shared.messages.cluster import (
    ClusterView,
    FEHeartbeat,
    GetView,
    JEHeartbeat,
    Leave,
    MemberDown,
    ModelInfo,
    TEHeartbeat,
)
from shared.metrics_http import MetricsServer
from shared.runner import Lifecycle
from shared.settings import Settings
from shared.store import Store
from shared.subjects import Keys, Subjects

log = get_logger(__name__)

RESCAN_INTERVAL = 5.0
# Past a deadline before the sweeper looks again (a member seen after the sweep began).
SWEEP_SLACK_S = 0.01


class ClusterManager:
    def __init__(self, *, settings: Settings, bus: Bus, store: Store) -> None:
        self._settings = settings
        self._bus = bus
        self._store = store
        self._kv_index = KvIndexStore(store, settings.cluster)
        self._subjects = Subjects(settings.cluster)
        self._keys = Keys(settings.cluster)
        self._life = Lifecycle("cluster_manager")
        self._members: dict[str, Member] = {}
        self._last_seen: dict[str, float] = {}
        self._models: list[ModelInfo] = []
        self._version = 0
        self._dirty = asyncio.Event()
        self.replica_id = f"cm-{uuid.uuid4().hex[:8]}"
        self.lease = LeaderLease(
            store,
            settings.cluster,
            CLUSTER_MANAGER,
            self.replica_id,
            settings.membership.leader_lease.total_seconds(),
            on_change=self._leadership,
        )
        self._stopping = asyncio.Event()
        # Members swept here lately (id -> when, heartbeat): told again on a takeover.
        self._swept: dict[str, tuple[float, Member]] = {}

    async def run(self) -> None:
        await self.lease.try_take()
        self._life.spawn(self.lease.run(self._stopping), name="leader lease")
        await self._rescan()
        await self._bus.subscribe(
            self._subjects.heartbeat(),
            {
                TEHeartbeat: self._on_heartbeat,
                JEHeartbeat: self._on_heartbeat,
                FEHeartbeat: self._on_heartbeat,
                Leave: self._on_leave,
            },
        )
        await self._bus.subscribe(self._subjects.get_view(), {GetView: self._on_get_view})
        self._life.spawn(self._sweeper(), name="sweeper")
        self._life.spawn(self._publisher(), name="view publisher")
        self._life.spawn(self._scanner(), name="model scanner")
        metrics = MetricsServer(self._settings.metrics, "cluster_manager")
        await metrics.start()
        try:
            await self._life.wait()
        finally:
            self._stopping.set()
            await self.lease.release()
            await metrics.stop()
            await self._life.cancel_tasks()
            await self._store.close()
            self._life.stopped()

    async def shutdown(self) -> None:
        self._life.request_stop()

    def view(self) -> ClusterView:
        members = list(self._members.values())
        for kind in metrics.KINDS.values():
            metrics.MEMBERS.labels(kind).set(sum(1 for m in members if metrics.kind_of(m) == kind))
        metrics.MODELS.set(len(self._models))
        return ClusterView(
            cluster=self._settings.cluster,
            # A new leader's views supersede the last one's: the epoch leads the version.
            version=(self.lease.epoch << 32) + self._version,
            generated_at=time.time(),
            tes=sorted((m for m in members if isinstance(m, TEHeartbeat)), key=lambda m: m.te_id),
            jes=sorted((m for m in members if isinstance(m, JEHeartbeat)), key=lambda m: m.je_id),
            frontends=sorted(
                (m for m in members if isinstance(m, FEHeartbeat)), key=lambda m: m.frontend_id
            ),
            models=self._models,
        )

    def _changed(self) -> None:
        self._version += 1
        self._dirty.set()

    def _leadership(self, leading: bool) -> None:
        metrics.LEADER.set(int(leading))
        if leading:
            self._changed()  # pushed at once
            self._life.spawn(self._tell_swept(), name="members swept before", one_shot=True)

    async def _tell_swept(self) -> None:
        """On a takeover: ``MemberDown`` for the members swept within the last lease and
        liveness timeout, which the deposed leader may not have told."""
        ms = self._settings.membership
        since = (
            time.monotonic() - ms.leader_lease.total_seconds() - ms.liveness_timeout.total_seconds()
        )
        for mid, (at, hb) in list(self._swept.items()):
            if at >= since and mid not in self._members:
                await self._member_down(mid, "gone before this cluster manager took over")
                await self._forget_kv(hb)

    async def _on_heartbeat(self, hb: Member) -> None:
        mid = member_id(hb)
        prev = self._members.get(mid)
        self._members[mid] = hb
        self._last_seen[mid] = time.monotonic()
        if prev is None:
            log.info("member joined", member=mid, kind=type(hb).__name__)
        if prev is None or identity(prev) != identity(hb):
            self._changed()

    async def _on_leave(self, msg: Leave) -> None:
        if (hb := self._members.pop(msg.member_id, None)) is not None:
            self._last_seen.pop(msg.member_id, None)
            log.info("member left", member=msg.member_id)
            metrics.MEMBERS_GONE.labels(metrics.kind_of(hb), "left").inc()
            self._changed()
            await self._member_down(msg.member_id, "left")
            await self._forget_kv(hb)

    async def _forget_kv(self, hb: object) -> None:
        """A TE is gone: its prompt-index entries leave the store (its replicas drop it on the
        view). The leader's to do."""
        if isinstance(hb, TEHeartbeat) and hb.model is not None and self.lease.leading():
            try:
                await self._kv_index.forget(hb.model, hb.te_id)
            except Exception as e:  # a replica resyncing it finds nothing: harmless
                log.warning("prompt index forget failed", te=hb.te_id, error=str(e))

    async def _member_down(self, member: str, reason: str) -> None:
        """Tell whoever depends on the member (frontends streaming from it) at once: the
        leader does."""
        if not self.lease.leading():
            return
        try:
            await self._bus.publish(
                self._subjects.member_down(), MemberDown(member_id=member, reason=reason)
            )
        except MeshserveError as e:  # the view's next push says it too, a little later
            log.warning("member-down notice failed", member=member, error=str(e))

    async def _on_get_view(self, _: GetView) -> ClusterView:
        return self.view()

    async def _sweeper(self) -> None:
        """Declare a member dead the moment its liveness deadline passes: sleep until the
        earliest deadline (a new heartbeat only moves deadlines later)."""
        timeout = self._settings.membership.liveness_timeout.total_seconds()
        while True:
            now = time.monotonic()
            dead = expired(self._last_seen, now=now, timeout=timeout)
            gone = [self._members.pop(mid, None) for mid in dead]
            for hb in gone:
                metrics.MEMBERS_GONE.labels(metrics.kind_of(hb), "silent").inc()
            for mid, hb in zip(dead, gone, strict=True):
                self._last_seen.pop(mid, None)
                if hb is not None:
                    self._swept[mid] = (now, hb)
                log.warning("member declared dead", member=mid, silent_for_s=timeout)
            keep = now - 2 * (timeout + self._settings.membership.leader_lease.total_seconds())
            self._swept = {m: v for m, v in self._swept.items() if v[0] >= keep}
            if dead:
                self._changed()
                for mid in dead:
                    await self._member_down(mid, f"no heartbeat for {timeout:g}s")
                for hb in gone:
                    await self._forget_kv(hb)
            earliest = min(self._last_seen.values(), default=now) + timeout
            await asyncio.sleep(max(earliest - time.monotonic(), 0.0) + SWEEP_SLACK_S)

    async def _publisher(self) -> None:
        """Push the view at once on a change, and every heartbeat interval regardless, so
        load figures stay fresh and a subscriber that missed one push catches up."""
        period = self._settings.membership.heartbeat_interval.total_seconds()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._dirty.wait(), period)
            self._dirty.clear()
            if not self.lease.leading():
                continue
            try:
                await self._bus.publish(self._subjects.view(), self.view())
            except MeshserveError as e:  # the bus reconnects by itself; keep pushing
                log.warning("view push failed", error=str(e))

    async def _scanner(self) -> None:
        while True:
            await asyncio.sleep(RESCAN_INTERVAL)
            try:
                await self._rescan()
            except Exception as e:
                log.warning("model rescan failed", error=str(e))

    async def _rescan(self) -> None:
        models = await asyncio.to_thread(scan_models, self._settings.models_dir)
        if not self.lease.leading():  # the leader writes the registry
            if models != self._models:
                self._models = models
                self._changed()
            return
        if models == self._models:
            # Unchanged, but Redis may have restarted without its data: the registry is
            # written again where it is gone, not only when the models change.
            if models and not await self._store.redis.exists(self._keys.models()):
                log.info("model registry written again")
                await self._store.replace_hash(
                    self._keys.models(), {m.id: msgspec.json.encode(m) for m in models}
                )
            return
        self._models = models
        log.info("model registry", models=[m.id for m in models])
        await self._store.replace_hash(
            self._keys.models(), {m.id: msgspec.json.encode(m) for m in models}
        )
        self._changed()


async def create(settings: Settings, bus: Bus) -> ClusterManager:
    if not settings.redis_url:
        raise SystemExit("cluster_manager: MESHSERVE_REDIS_URL is not set (meshserve up sets it)")
    store = await Store.for_settings(settings)
    return ClusterManager(settings=settings, bus=bus, store=store)
