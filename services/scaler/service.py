"""The scaler service: observes traffic, outcomes and the cluster view, runs the policy,
actuates, and measures every scale event."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Sequence

import msgspec

from services.scaler import metrics
from services.scaler.config import scaler_config
from services.scaler.policy import Load, Unload
from services.scaler.state import (
    LoadSettled,
    ScalerState,
    UnloadSettled,
    observe_capacity,
    observe_outcomes,
    observe_traffic,
)
from services.scaler.tick import tick
from services.views import TEView, te_view
from shared.bus import Bus
from shared.clients import TaskExecutorClient, ViewWatcher
from shared.errors import MeshserveError
from shared.leader import SCALER, LeaderLease
from shared.logging import get_logger
from shared.messages.cluster import ClusterView, TEHeartbeat
from shared.messages.scaling import (
    InstanceCapacity,
    LoadModel,
    Multicast,
    OutcomeReport,
    PreloadModel,
    ScaleEvent,
    TrafficReport,
    UnloadModel,
)
from shared.metrics_http import MetricsServer
from shared.runner import Lifecycle
from shared.settings import Settings
from shared.store import Store
from shared.subjects import Keys, Subjects

log = get_logger(__name__)

TICK_S = 0.5
# How often the stored capacities are checked to be still in Redis (a restart without
# persistence loses them, and a scaler started then would measure every model again).
CAPACITY_CHECK_S = 5.0
FIRST_TOKEN_WAIT_S = 10.0  # a scale-up's event waits this long for the first token


@dataclasses.dataclass(slots=True)
class _Sent:
    """A command in flight, for the scale event's step times."""

    at: float  # decided and sent
    acked: float = 0.0
    pool_id: str = ""


class Scaler:
    def __init__(self, *, settings: Settings, bus: Bus, store: Store | None = None) -> None:
        self._settings = settings
        self._bus = bus
        self._store = store
        self._subjects = Subjects(settings.cluster)
        self._keys = Keys(settings.cluster)
        self._life = Lifecycle("scaler")
        self._view = ViewWatcher(bus, self._subjects)
        self._view.listeners.append(lambda _: self._wake.set())
        self._tes = TaskExecutorClient(bus, self._subjects)
        self._cfg = scaler_config(settings)
        self._state = ScalerState()
        self._stored: dict[str, InstanceCapacity] = {}  # model|engine -> capacity in Redis
        self._sent: dict[str, _Sent] = {}  # by TE
        self._preloaded: dict[tuple[str, str], float] = {}  # (model, pool) -> sent at
        # scale-ups done, their events waiting for the instance's first token: TE -> (event,
        # when it turned ready)
        self._awaiting_first: dict[str, tuple[ScaleEvent, float]] = {}
        self._wake = asyncio.Event()
        self._capacities_checked = time.monotonic()
        # Replicas decide one at a time: the one holding the leader lease (shared/leader.py).
        self.replica_id = f"scaler-{uuid.uuid4().hex[:8]}"
        self.lease: LeaderLease | None = None
        self._stopping = asyncio.Event()

    async def run(self) -> None:
        if self._store is None:
            if not self._settings.redis_url:
                raise ValueError("the scaler needs MESHSERVE_REDIS_URL (its stored capacities)")
            self._store = await Store.for_settings(self._settings)
        await self._load_capacities()
        self.lease = LeaderLease(
            self._store,
            self._settings.cluster,
            SCALER,
            self.replica_id,
            self._settings.membership.leader_lease.total_seconds(),
            on_change=self._leadership,
        )
        await self.lease.try_take()
        self._life.spawn(self.lease.run(self._stopping), name="leader lease")
        await self._view.start(self._life)
        await self._bus.subscribe(self._subjects.traffic(), {TrafficReport: self._on_traffic})
        await self._bus.subscribe(self._subjects.outcomes(), {OutcomeReport: self._on_outcomes})
        metrics = MetricsServer(self._settings.metrics, "scaler")
        await metrics.start()
        try:
            while not self._life.stopping:
                await self._tick()
                self._wake.clear()
                waiter = asyncio.ensure_future(self._wake.wait())
                stopper = asyncio.ensure_future(self._life.wait())
                await asyncio.wait({waiter, stopper}, timeout=TICK_S, return_when="FIRST_COMPLETED")
                waiter.cancel()
                stopper.cancel()
        finally:
            self._stopping.set()
            await self.lease.release()  # another replica takes over at once
            await metrics.stop()
            await self._life.cancel_tasks()
            if self._store is not None:
                await self._store.close()
            self._life.stopped()

    async def shutdown(self) -> None:
        self._life.request_stop()

    @property
    def _fence(self) -> int:
        """The epoch the commands of this tick carry."""
        return self.lease.epoch if self.lease is not None else 0

    def _leadership(self, leading: bool) -> None:
        """This replica became the leader (it decides from the view as it is now: what an
        earlier term of its own remembered may be stale) or stopped being one."""
        metrics.LEADER.set(int(leading))
        if leading:
            self._state = ScalerState()
            self._sent.clear()
            self._awaiting_first.clear()
            self._wake.set()

    # -- observation -----------------------------------------------------------------------

    async def _load_capacities(self) -> None:
        assert self._store is not None
        try:
            raw = await self._store.hash_items(self._keys.capacities())
        except Exception as e:  # measured again on the next load
            log.warning("reading stored capacities failed", error=str(e))
            return
        for key, value in raw.items():
            try:
                self._stored[key] = msgspec.msgpack.decode(value, type=InstanceCapacity)
            except msgspec.DecodeError:
                continue

    async def _on_traffic(self, msg: TrafficReport) -> None:
        self._state = observe_traffic(
            self._state, msg.je_id, msg.models, now=time.time(), cfg=self._cfg
        )
        if msg.urgent:
            self._wake.set()

    async def _on_outcomes(self, msg: OutcomeReport) -> None:
        self._state = observe_outcomes(self._state, msg.models, now=time.time(), cfg=self._cfg)

    def _capacity(self, model: str, engine: str | None) -> InstanceCapacity | None:
        return self._stored.get(f"{model}|{engine}")

    async def _remember_capacities(self, view: ClusterView) -> None:
        """Store each model's capacity the first time a TE reports one it measured."""
        for hb in view.tes:
            if hb.capacity is None or hb.model is None:
                continue
            key = f"{hb.model}|{hb.capacity.engine}"
            if key in self._stored:
                continue
            self._stored[key] = hb.capacity
            log.info("capacity measured", model=hb.model, capacity=msgspec.to_builtins(hb.capacity))
            try:
                assert self._store is not None
                await self._store.redis.hset(
                    self._keys.capacities(), key, msgspec.msgpack.encode(hb.capacity)
                )
            except Exception as e:
                log.warning("storing a capacity failed", error=str(e))

    async def _restore_capacities(self) -> None:
        """Write back what Redis lost of the capacities this scaler knows (a restart)."""
        if time.monotonic() - self._capacities_checked < CAPACITY_CHECK_S or not self._stored:
            return
        self._capacities_checked = time.monotonic()
        assert self._store is not None
        key = self._keys.capacities()
        try:
            if await self._store.redis.hlen(key) >= len(self._stored):
                return
            have = set(await self._store.hash_items(key))
            lost = {k: msgspec.msgpack.encode(c) for k, c in self._stored.items() if k not in have}
            if lost:
                log.info("stored capacities written again", capacities=sorted(lost))
                for field, value in lost.items():
                    await self._store.redis.hset(key, field, value)
        except Exception as e:  # Redis away: the next check tries again
            log.warning("checking the stored capacities failed", error=str(e))

    # -- the loop ----------------------------------------------------------------------------

    async def _tick(self) -> None:
        view = self._view.view
        if view.version < 0 or self.lease is None or not self.lease.leading():
            return
        now = time.time()
        await self._remember_capacities(view)
        await self._restore_capacities()
        tes = [te_view(hb) for hb in view.tes]
        for model in {m.id for m in view.models}:
            if self._state.memory(model).capacity is None:
                engine = next((hb.engine for hb in view.tes if hb.engine), None)
                if cap := self._capacity(model, engine):
                    self._state = observe_capacity(self._state, model, cap)
        paths = {m.id: m.path for m in view.models}
        step = tick(
            self._state, tes, models=list(paths), now=now, cfg=self._cfg, tried=self._preloaded
        )
        self._state, decision = step.state, step.decision
        by_id = {hb.te_id: hb for hb in view.tes}
        for s in step.settled:
            await self._scale_event(s, by_id.get(s.te_id), now)
        await self._first_tokens(view.tes, now)
        metrics.observe_targets(decision.targets)
        for model in {a.model for a in decision.actions if isinstance(a, Load)}:
            if decision.targets[model].current == 0:
                metrics.COLD_STARTS.labels(model).inc()
        for action in decision.actions:
            t = decision.targets[action.model]
            log.info(
                "scale decision",
                action=type(action).__name__.lower(),
                model=action.model,
                te=action.te_id,
                reason=action.reason,
                current=t.current,
                wanted=t.wanted,
                stable_load=round(t.stable_load, 3),
                panic_load=round(t.panic_load, 3),
                backlog=t.backlog,
                slo=t.slo_attainment,
            )
        await asyncio.gather(*(self._actuate(a, paths, tes, now) for a in decision.actions))
        for p in step.preloads:
            log.info("preload decision", model=p.model, te=p.te_id, fork=p.weights_from)
            self._preloaded[p.model, p.pool_id] = now
            cmd = PreloadModel(
                model=p.model, path=paths[p.model], weights_from=p.weights_from, fence=self._fence
            )
            try:
                ack = await self._tes.control(p.te_id, cmd)
                if not ack.ok:
                    log.warning("preload refused", te=p.te_id, error=ack.error)
            except MeshserveError as e:
                log.warning("preload failed", te=p.te_id, error=str(e))

    async def _actuate(
        self, action: Load | Unload, paths: dict[str, str], tes: list[TEView], now: float
    ) -> None:
        pool = next((te.pool_id for te in tes if te.te_id == action.te_id), "")
        sent = self._sent[action.te_id] = _Sent(at=now, pool_id=pool)
        try:
            if isinstance(action, Load):
                engine = next(
                    (hb.engine for hb in self._view.view.tes if hb.te_id == action.te_id), None
                )
                cmd: LoadModel | UnloadModel = LoadModel(
                    model=action.model,
                    path=paths[action.model],
                    capacity=self._capacity(action.model, engine),
                    weights_from=action.weights_from,
                    role=action.role,
                    fence=self._fence,
                    multicast=(
                        Multicast(
                            node=m.node,
                            nodes=list(m.nodes),
                            source=m.source,
                            block_bytes=m.block_bytes,
                        )
                        if (m := action.multicast)
                        else None
                    ),
                )
            else:
                cmd = UnloadModel(
                    fence=self._fence,
                    reason=action.reason,
                    drain_s=self._settings.scaler.drain_timeout.total_seconds(),
                )
            ack = await self._tes.control(action.te_id, cmd)
            sent.acked = time.time()
            if not ack.ok:
                log.warning("scaling command refused", te=action.te_id, error=ack.error)
        except MeshserveError as e:
            log.warning("scaling command failed", action=repr(action), error=str(e))
        # A refused or lost command is settled by the next views (observe_view).

    async def _scale_event(
        self, s: LoadSettled | UnloadSettled, hb: TEHeartbeat | None, now: float
    ) -> None:
        sent = self._sent.pop(s.te_id, None)
        if isinstance(s, LoadSettled):
            steps: dict[str, float] = {}
            if sent is not None and sent.acked:
                steps["scaler_pre"] = sent.acked - sent.at
            if hb is not None:
                steps.update(hb.load_steps)
                if s.ok and hb.ready_at:
                    steps["scaler_post"] = max(0.0, now - hb.ready_at)
            event = ScaleEvent(
                kind="up",
                model=s.model,
                te_id=s.te_id,
                pool_id=s.pool_id,
                reason=s.reason,
                ok=s.ok,
                steps={k: round(v, 4) for k, v in steps.items()},
                total_s=round(now - s.sent_at, 4),
            )
            if s.ok:  # published with the new instance's first token (``_first_tokens``)
                self._awaiting_first[s.te_id] = (event, now)
                return
        else:
            event = ScaleEvent(
                kind="down",
                model=s.model,
                te_id=s.te_id,
                pool_id=sent.pool_id if sent else "",
                steps={"drain_and_unload": round(now - sent.at, 4)} if sent else {},
                total_s=round(now - sent.at, 4) if sent else 0.0,
            )
        await self._publish(event, s.error if isinstance(s, LoadSettled) else None)

    async def _first_tokens(self, tes: Sequence[TEHeartbeat], now: float) -> None:
        """A scale-up's event goes out once its instance served a first token (the step
        ``te_first_token``: that request's time in the TE, from accepted to its first
        token, on the freshly loaded engine), or FIRST_TOKEN_WAIT_S after it turned ready
        without one."""
        by_id = {hb.te_id: hb for hb in tes}
        for te_id, (event, since) in list(self._awaiting_first.items()):
            hb = by_id.get(te_id)
            first = hb.load_steps.get("te_first_token") if hb is not None else None
            if first is None and hb is not None and now - since < FIRST_TOKEN_WAIT_S:
                continue
            del self._awaiting_first[te_id]
            if first is not None:
                steps = {**event.steps, "te_first_token": round(first, 4)}
                event = msgspec.structs.replace(event, steps=steps)
            await self._publish(event, None)

    async def _publish(self, event: ScaleEvent, error: str | None) -> None:
        log.info(
            "scale event",
            kind=event.kind,
            model=event.model,
            te=event.te_id,
            ok=event.ok,
            total_s=event.total_s,
            steps=event.steps,
            error=error,
        )
        try:
            await self._bus.publish(self._subjects.scale_events(), event)
        except MeshserveError as e:
            log.warning("scale event not published", error=str(e))


async def create(settings: Settings, bus: Bus) -> Scaler:
    return Scaler(settings=settings, bus=bus)
