"""One task executor (TE): a pre-warmed, model-agnostic process that wraps one engine once
the scaler assigns it a model, takes tasks, and streams tokens straight to the frontend.

A coordinator over its parts: ``model_control`` (which model and engine it serves: load,
pre-load, unload), ``task_loop`` (task intake and the engine loop), ``kv_publisher`` (the
prompt index's KV events) and ``host_cache_watch`` (what this host's weight cache holds, for
the heartbeats); the engine lives on one thread (``engine_thread``). Here: the bus
subscriptions, the heartbeat, and starting and stopping the parts in order."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from services.task_executor.engine_thread import EngineThread
from services.task_executor.engines.base import Engine
from services.task_executor.engines.factory import create_engine, prewarm
from services.task_executor.host_cache_watch import HostCacheWatch
from services.task_executor.kv_publisher import KvEventPublisher
from services.task_executor.model_control import EngineFactory, ModelControl
from services.task_executor.task_loop import TaskLoop
from services.task_executor.training.runner import TrainingRunner
from services.views import queued_import_tokens, queued_prompt_tokens
from shared.bus import Bus
from shared.clients import ClusterClient, Heartbeater
from shared.errors import Unavailable
from shared.leader import SCALER, stale
from shared.logging import get_logger
from shared.messages.cluster import MemberDown, TEHeartbeat, TEState
from shared.messages.scaling import ControlAck, Drain, LoadModel, PreloadModel, UnloadModel
from shared.messages.tasks import CancelTask, ChatTask, TaskMode
from shared.messages.training import CancelTraining, TrainTask
from shared.runner import Lifecycle, run_service
from shared.settings import Settings
from shared.store import Store
from shared.subjects import Subjects

log = get_logger(__name__)

C = TypeVar("C", LoadModel, PreloadModel, UnloadModel)

# Longest a stopping TE waits for the engine step in flight.
STEP_STOP_TIMEOUT_S = 30.0


class TaskExecutor:
    def __init__(
        self,
        *,
        settings: Settings,
        bus: Bus,
        te_id: str,
        pool_id: str,
        engine_factory: EngineFactory = create_engine,
        prewarm: Callable[[Settings], None] | None = prewarm,
        store: Store | None = None,
    ) -> None:
        """``prewarm``: what every load of this TE's engine would pay first (imports, kernel
        compiles), run on the engine thread as the TE starts; None: nothing. ``store``:
        where the KV events' prompt index entries persist."""
        self._settings = settings
        self._bus = bus
        self._store = store
        self._subjects = Subjects(settings.cluster)
        self.te_id = te_id
        self.pool_id = pool_id
        self._prewarm = prewarm
        self._thread = EngineThread()
        self._life = Lifecycle(f"task_executor {te_id}")
        self._started = time.time()
        self._hb = Heartbeater(
            ClusterClient(bus, self._subjects),
            self._heartbeat,
            settings.membership.heartbeat_interval.total_seconds(),
        )
        self._host_cache = HostCacheWatch(settings)
        self._kv = KvEventPublisher(
            te_id=te_id,
            bus=bus,
            subjects=self._subjects,
            store=store,
            cluster=settings.cluster,
            model=lambda: self.control.model,
        )
        # Held while an engine iteration runs: an unload (and a test) waits for it.
        self.step_lock = step_lock = asyncio.Lock()
        self.control = ModelControl(
            settings=settings,
            te_id=te_id,
            engine_factory=engine_factory,
            thread=self._thread,
            life=self._life,
            kv=self._kv,
            host_cache=self._host_cache,
            step_lock=step_lock,
            drain=lambda grace: self.tasks.drain(grace),
            changed=self._control_changed,
            loaded=lambda: self.tasks.wake(),
            before_load=lambda cmd: self.tasks.reserve_kv(cmd),
        )
        self.tasks = TaskLoop(
            te_id=te_id,
            bus=bus,
            subjects=self._subjects,
            control=self.control,
            thread=self._thread,
            kv=self._kv,
            step_lock=step_lock,
            settings=settings,
        )
        self.training = TrainingRunner(
            te_id=te_id,
            bus=bus,
            control=self.control,
            thread=self._thread,
            life=self._life,
            changed=self._hb.beat_now,
            settings=settings.fine_tuning,
        )
        self.ready = asyncio.Event()  # set once the TE listens for tasks and commands

    def _control_changed(self) -> None:
        """The model control's state moved: a heartbeat now, and the task loop looks at its
        engine (one gone gives its KV back to the device)."""
        self._hb.beat_now()
        self.tasks.engine_changed()

    @property
    def state(self) -> TEState:
        return self.control.state

    @property
    def model(self) -> str | None:
        return self.control.model

    @property
    def engine(self) -> Engine | None:
        return self.control.engine

    def _heartbeat(self) -> TEHeartbeat:
        control, tasks, cache = self.control, self.tasks, self._host_cache.state
        hb = TEHeartbeat(
            te_id=self.te_id,
            pool_id=self.pool_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            state=control.state,
            started_at=self._started,
            model=control.model,
            last_active=tasks.last_active,
            error=control.error,
            sent_at=time.time(),
            failed_model=control.failed_model,
            generated_tokens=tasks.generated_tokens,
            engine=control.choice.engine,
            engine_reason=control.choice.reason,
            # what its engine would run on: placement weighs CPUs before GPUs while idle
            device=control.choice.device or None,
            recent_models=list(control.recent_models),
            load_steps=control.load_steps,
            ready_at=control.ready_at,
            weight_server=self._settings.host_cache.server,
            cached_weights=cache.models,
            cache_free_bytes=cache.free_bytes,
            weight_relay=self._settings.host_cache.relay,
            relay_address=control.relay_address,
            role=control.role,
            kv_address=tasks.prefill.address if control.role == TaskMode.PREFILL else "",
            kv_lease_ends=dict(tasks.prefill.ends),
            training=self.training.current,
            device_kv_free_bytes=tasks.device_kv_free(),
        )
        if (engine := control.engine) is not None:
            st = engine.stats()
            hb.device = engine.device
            hb.engine = engine.name
            hb.max_model_len = engine.max_model_len
            hb.engine_capabilities = engine.capabilities
            hb.running = st.running
            hb.waiting = st.waiting + tasks.queued
            hb.free_kv_blocks = st.free_kv_blocks
            hb.total_kv_blocks = st.total_kv_blocks
            hb.kv_block_size = st.kv_block_size
            hb.growable_kv_blocks = tasks.kv_growable_blocks()
            hb.kv_floor_bytes = tasks.kv_floor_bytes
            hb.prefix_cache_queries = st.prefix_cache_queries
            hb.prefix_cache_hits = st.prefix_cache_hit_tokens
            hb.capacity = control.capacity
            shares = tasks.shares()
            hb.queued_prompt_tokens = queued_prompt_tokens(shares)
            hb.queued_import_tokens = queued_import_tokens(shares)
            hb.shares = {je: share for je, share in shares.items() if je}
            hb.placements = tasks.placements
            if (lora := control.features.lora) is not None:
                hb.adapters = lora.adapters()
        return hb

    async def run(self) -> None:
        tasks, control = self.tasks, self.control
        await tasks.prefill.start()  # where decode TEs pull, should it serve as prefill
        await self._bus.subscribe(
            self._subjects.te_task(self.te_id),
            {ChatTask: tasks.on_task, CancelTask: tasks.on_cancel},
        )
        await self._bus.subscribe(
            self._subjects.te_control(self.te_id),
            {
                LoadModel: self._fenced(control.on_load),
                PreloadModel: self._fenced(control.on_preload),
                UnloadModel: self._fenced(control.on_unload),
                Drain: self._on_drain,
            },
        )
        await self._bus.subscribe(
            self._subjects.te_train(self.te_id),
            {TrainTask: self.training.on_task, CancelTraining: self.training.on_cancel},
        )
        await self._bus.subscribe(self._subjects.member_down(), {MemberDown: tasks.on_member_down})
        if self._prewarm is not None:  # a load queued meanwhile waits its turn
            self._thread.prewarm(self._prewarm, self._settings)
        self._hb.start(self._life)
        loop_task = self._life.spawn(tasks.run(), name="engine loop")
        self._life.spawn(self._kv.run(), name="kv event publisher")
        self._life.spawn(tasks.run_progress(), name="task progress publisher")
        if self._settings.host_cache.bytes != 0:
            self._life.spawn(self._host_cache.run(), name="host cache watch")
        self.ready.set()
        try:
            await self._life.wait()
            control.state = TEState.DRAINING
            self._hb.beat_now()
            await tasks.drain(self._settings.membership.shutdown_grace.total_seconds())
        finally:
            # Let a step in flight finish (a thread cannot be interrupted) before the
            # engine is closed under it.
            tasks.stop()
            _, pending = await asyncio.wait({loop_task}, timeout=STEP_STOP_TIMEOUT_S)
            if pending:
                log.error("engine step did not finish; closing anyway")
            await control.settle(STEP_STOP_TIMEOUT_S)
            await self._life.cancel_tasks()
            await ClusterClient(self._bus, self._subjects).leave(self.te_id)
            await control.close()
            await tasks.prefill.close()
            if self._store is not None:
                await self._store.close()
            self._thread.shutdown()
            self._life.stopped()

    async def shutdown(self) -> None:
        self._life.request_stop()

    async def _on_drain(self, _: Drain) -> ControlAck:
        self._life.request_stop()
        return ControlAck(te_id=self.te_id, ok=True)

    def _fenced(
        self, handler: Callable[[C], Awaitable[ControlAck]]
    ) -> Callable[[C], Awaitable[ControlAck]]:
        """``handler`` for the scaler's commands, refusing one a deposed scaler leader sent
        (``shared.leader.stale``: its epoch passed by a newer leader's)."""

        async def fenced(cmd: C) -> ControlAck:
            if self._store is not None and await stale(
                self._store, self._settings.cluster, SCALER, cmd.fence
            ):
                log.warning(
                    "command from a deposed scaler refused",
                    command=type(cmd).__name__,
                    fence=cmd.fence,
                )
                return ControlAck(
                    te_id=self.te_id, ok=False, error=f"stale: epoch {cmd.fence} was deposed"
                )
            return await handler(cmd)

        return fenced


def main() -> None:
    te_id, pool_id = sys.argv[1], sys.argv[2]
    settings = Settings.load()

    async def factory(settings: Settings, bus: Bus) -> TaskExecutor:
        try:
            store = await Store.for_settings(settings) if settings.redis_url else None
        except Unavailable as e:  # it serves; routing learns its cache from its events alone
            log.warning("prompt index entries not stored", error=e.message)
            store = None
        return TaskExecutor(settings=settings, bus=bus, te_id=te_id, pool_id=pool_id, store=store)

    run_service(f"task_executor.{te_id}", factory, settings)


if __name__ == "__main__":
    main()
