"""Which model a TE serves, and its engine: load it (with this TE's part of a multicast of
its weights, its capacity, the prefill pacing that capacity sets), pre-load a model into
the host cache without serving it, unload it after a drain, and lose an engine whose
process died. One command at a time: each starts from the state the previous one left
(``TEState``), and is acknowledged at once while the work runs in the background."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import msgspec

from services.task_executor.capacity import find_or_measure, find_perf_model
from services.task_executor.engine_thread import EngineThread
from services.task_executor.engines.base import Engine, LoadReport
from services.task_executor.engines.capabilities import (
    EngineFeatures,
    bind_features,
    check_role,
)
from services.task_executor.engines.factory import engine_choice, preload
from services.task_executor.host_cache_watch import HostCacheWatch
from services.task_executor.kv_publisher import KvEventPublisher
from services.task_executor.weight_cache import relay
from services.views import remember_model
from shared import heap
from shared.logging import get_logger
from shared.messages.cluster import TEState
from shared.messages.scaling import (
    ControlAck,
    InstanceCapacity,
    LoadModel,
    PreloadModel,
    UnloadModel,
)
from shared.messages.tasks import TaskMode
from shared.perf_model import PerfModel
from shared.runner import Lifecycle
from shared.settings import Settings

if TYPE_CHECKING:
    from services.task_executor.weight_cache.store import Received

log = get_logger(__name__)


class EngineFactory(Protocol):
    def __call__(
        self,
        model: str,
        model_path: Path,
        settings: Settings,
        *,
        report: LoadReport,
        weights_from: str | None = None,
        received: Received | None = None,
    ) -> Engine: ...


class ModelControl:
    def __init__(
        self,
        *,
        settings: Settings,
        te_id: str,
        engine_factory: EngineFactory,
        thread: EngineThread,
        life: Lifecycle,
        kv: KvEventPublisher,
        host_cache: HostCacheWatch,
        step_lock: asyncio.Lock,
        drain: Callable[[float], Awaitable[None]],
        changed: Callable[[], None],
        loaded: Callable[[], None],
        before_load: Callable[[LoadModel], Awaitable[None]] | None = None,
    ) -> None:
        """``step_lock``: held while an engine iteration runs (an unload takes the engine
        only between iterations); ``drain(grace)``: let the running tasks finish, hand the
        rest back; ``changed``: the state moved (heartbeat now); ``loaded``: an engine is
        ready for work; ``before_load``: what a load waits for first (room for its KV on
        the device), failing the load if it raises."""
        self._settings = settings
        self._te_id = te_id
        self._factory = engine_factory
        self._thread = thread
        self._life = life
        self._kv = kv
        self._host_cache = host_cache
        self._step_lock = step_lock
        self._drain = drain
        self._changed = changed
        self._loaded = loaded
        self._before_load = before_load
        self.state = TEState.IDLE
        self.model: str | None = None
        self.engine: Engine | None = None
        self.features = EngineFeatures()  # of the engine loaded: what it can do beyond generating
        self.role = TaskMode.COLOCATED  # what it serves the model loaded as (LoadModel.role)
        self.capacity: InstanceCapacity | None = None  # of the model loaded
        self.perf: PerfModel | None = None  # its performance model, where one is stored
        self.choice = engine_choice(settings)  # for any model; for the model loaded once one is
        self.error: str | None = None
        self.failed_model: str | None = None
        self.recent_models: list[str] = []  # loaded here before, newest first
        self.load_steps: dict[str, float] = {}  # of the last load
        self.ready_at = 0.0
        # Where this TE receives multicasts of a model's weights (with the host cache on).
        self.relay: socket.socket | None = None
        if settings.host_cache.bytes != 0:
            with contextlib.suppress(OSError):
                self.relay = relay.listen(f"{settings.host_cache.serve_host}:0")
        # The load or unload in progress (one at a time: each starts from its own state).
        self._task: asyncio.Task[None] | None = None

    @property
    def relay_address(self) -> str:
        return relay.address_of(self.relay) if self.relay is not None else ""

    # -- commands ------------------------------------------------------------------------

    async def on_load(self, cmd: LoadModel) -> ControlAck:
        if self.state != TEState.IDLE:
            return self._refuse("idle")
        self.state, self.model = TEState.LOADING, cmd.model
        self.error = self.failed_model = None
        self._changed()
        self._task = self._life.spawn(self._load(cmd), name="load", one_shot=True)
        return ControlAck(te_id=self._te_id, ok=True)

    async def on_preload(self, cmd: PreloadModel) -> ControlAck:
        if self.state != TEState.IDLE:
            return self._refuse("idle")
        self.state = TEState.PRELOADING
        self._changed()
        self._task = self._life.spawn(self._preload(cmd), name="preload", one_shot=True)
        return ControlAck(te_id=self._te_id, ok=True)

    async def on_unload(self, cmd: UnloadModel) -> ControlAck:
        """Acknowledged at once, as a load is: draining takes up to the shutdown grace and
        closing an engine seconds (vLLM's), longer than a control request waits. Heartbeats
        show the TE DRAINING, then IDLE."""
        if self.state != TEState.READY:
            return self._refuse("ready")
        self.state = TEState.DRAINING
        self._changed()
        self._task = self._life.spawn(self._unload(cmd), name="unload", one_shot=True)
        return ControlAck(te_id=self._te_id, ok=True)

    def _refuse(self, wanted: str) -> ControlAck:
        return ControlAck(te_id=self._te_id, ok=False, error=f"TE is {self.state}, not {wanted}")

    async def settle(self, timeout: float) -> None:
        """Wait (up to ``timeout``) for the command in progress: an unload closing its
        engine, or a load that would leave one behind."""
        if self._task is not None and not self._task.done():
            await asyncio.wait({self._task}, timeout=timeout)

    async def close(self) -> None:
        """The TE stops: its engine closes, its prompt index entries go."""
        if self.engine is not None:
            self.engine.close()
        if self.model is not None:
            await self._kv.forget(self.model)
        if self.relay is not None:
            self.relay.close()

    # -- the work ------------------------------------------------------------------------

    async def _preload(self, cmd: PreloadModel) -> None:
        t0 = time.monotonic()
        try:
            report = await self._thread.run(
                functools.partial(
                    preload,
                    cmd.model,
                    Path(cmd.path),
                    self._settings,
                    weights_from=cmd.weights_from,
                )
            )
        except Exception:
            log.exception("preload failed", model=cmd.model)
        else:
            log.info(
                "model preloaded into the host cache",
                model=cmd.model,
                seconds=round(time.monotonic() - t0, 2),
                built=report.misses,
                already_there=report.hits,
                fetched=report.fetched,
            )
        self.state = TEState.IDLE
        await self._host_cache.read()  # report what the cache holds now
        self._changed()

    async def _load(self, cmd: LoadModel) -> None:
        t0 = time.monotonic()
        steps: dict[str, float] = {}
        self.load_steps, self.ready_at = steps, 0.0
        try:
            queued = t0
            if self._before_load is not None:
                await self._before_load(cmd)
                queued = time.monotonic()
                steps["te_kv_room"] = queued - t0
            engine, features, self.capacity = await self._thread.run(
                self._build_engine, cmd, queued, steps
            )
        except Exception as e:
            log.exception("model load failed", model=cmd.model)
            self.state, self.model, self.error = TEState.IDLE, None, f"{type(e).__name__}: {e}"
            self.failed_model = cmd.model
        else:
            self.engine, self.features, self.role = engine, features, cmd.role
            try:
                self.perf = find_perf_model(engine, Path(cmd.path), self._settings)[0]
            except Exception:  # no shadow validation for it: it serves all the same
                log.exception("reading the performance model failed", model=cmd.model)
                self.perf = None
            self._kv.block_size = features.kv_events.block_size if features.kv_events else 0
            heap.settle()  # the model lives as long as it is loaded: out of the collector's way
            self.state = TEState.READY
            self.ready_at = time.time()
            self.recent_models = list(remember_model(self.recent_models, cmd.model))
            log.info(
                "model loaded",
                model=cmd.model,
                role=cmd.role,
                seconds=round(time.monotonic() - t0, 2),
                steps={k: round(v, 3) for k, v in steps.items()},
                device=engine.device,
            )
            self._loaded()
        self._changed()

    def _build_engine(
        self, cmd: LoadModel, t0: float, steps: dict[str, float]
    ) -> tuple[Engine, EngineFeatures, InstanceCapacity | None]:
        """The engine; what it declares it can do checked against what it implements (a
        declaration it cannot keep fails the load, and the engine is closed); and its
        capacity, measured here when the scaler has none stored. ``steps``: DeepServe's
        TE-side steps of a scale-up, in seconds."""
        t1 = time.monotonic()
        steps["te_pre_load"] = t1 - t0  # the command's wait for the engine thread
        self.choice = engine_choice(self._settings, cmd.model, Path(cmd.path))
        report = LoadReport()
        received = self._receive_multicast(cmd, steps)
        engine = self._factory(
            cmd.model,
            Path(cmd.path),
            self._settings,
            report=report,
            weights_from=cmd.weights_from,
            received=received,
        )
        t2 = time.monotonic()
        steps["te_load"] = t2 - t1
        steps.update({f"te_load_{name}": s for name, s in report.phases.items()})
        try:
            features = bind_features(engine)
            check_role(engine, cmd.role)
            capacity = cmd.capacity or self._measure_capacity(engine, Path(cmd.path))
            if features.prefill_pacing is not None and capacity is not None:
                slo = self._settings.scaler.slo()
                features.prefill_pacing.pace_prefill(
                    capacity,
                    slo.tpot_s,
                    ttft_s=slo.ttft_s,
                    ttft_per_token_s=slo.ttft_per_input_token_s,
                )
        except Exception:
            engine.close()
            raise
        steps["te_post_load"] = time.monotonic() - t2
        return engine, features, capacity

    def _receive_multicast(self, cmd: LoadModel, steps: dict[str, float]) -> Received | None:
        """This load's part of a multicast of its model's weights (``cmd.multicast``); None
        where there is none, or it failed (logged: the load forks or reads instead)."""
        if cmd.multicast is None or self.relay is None:
            return None
        from services.task_executor.weight_cache.store import receive_multicast

        t = time.monotonic()
        try:
            received = receive_multicast(cmd.model, cmd.multicast, self.relay)
        except Exception as e:
            log.warning("multicast failed; forking instead", model=cmd.model, error=str(e))
            return None
        steps["te_load_multicast"] = time.monotonic() - t
        return received

    def _measure_capacity(self, engine: Engine, path: Path) -> InstanceCapacity | None:
        """The capacity stored with the model or on this host for its architecture and this
        engine, or measured now (and stored): ``capacity.find_or_measure``."""
        try:
            capacity, where = find_or_measure(engine, path, self._settings)
        except Exception:  # the scaler sizes the model by its queue alone until one is stored
            log.exception("measuring the instance's capacity failed")
            return None
        if where == "measured" and capacity is not None:
            log.info(
                "capacity measured on the load's critical path (`meshserve profile` stores it "
                "with the model beforehand)",
                **msgspec.structs.asdict(capacity),
            )
        return capacity

    async def _unload(self, cmd: UnloadModel) -> None:
        grace = self._settings.membership.shutdown_grace.total_seconds()
        await self._drain(grace if cmd.drain_s is None else cmd.drain_s)
        async with self._step_lock:
            engine, self.engine = self.engine, None
        if engine is not None:
            try:
                await self._thread.run(engine.close)
            except Exception:  # gone either way: the TE takes the next model
                log.exception("closing the engine failed", model=self.model)
            self._kv.collect(self.features.kv_events)
            await self._kv.flush()
        if self.model is not None:
            await self._kv.forget(self.model)
        self.features, self.role = EngineFeatures(), TaskMode.COLOCATED
        self.capacity, self.perf = None, None
        self.choice = engine_choice(self._settings)
        heap.unsettle()  # the model's reference cycles, if any, go now
        heap.settle()
        log.info("model unloaded", model=self.model, reason=cmd.reason)
        self.state, self.model = TEState.IDLE, None
        self._changed()

    async def lose(self, engine: Engine, e: Exception) -> None:
        """The engine's process died: this TE serves nothing until the scaler loads a model
        again (the heartbeat reports the failure, as for a failed load)."""
        async with self._step_lock:
            if self.engine is not engine:
                return
            self.engine, self.features = None, EngineFeatures()
            self.role = TaskMode.COLOCATED
        with contextlib.suppress(Exception):
            engine.close()
        log.error("engine process died; model unloaded", model=self.model, error=str(e))
        self.failed_model, self.error = self.model, f"{type(e).__name__}: {e}"
        self.state, self.model = TEState.IDLE, None
        self._changed()
