"""The scaler service: observes demand and the cluster view, runs the policy, actuates."""

from __future__ import annotations

import asyncio
import time

from services.scaler.policy import Load, ScalerConfig, Unload, decide
from shared.bus import Bus
from shared.clients import TaskExecutorClient, ViewWatcher
from shared.errors import MeshserveError
from shared.logging import get_logger
from shared.messages.cluster import TEState
from shared.messages.scaling import LoadModel, ScaleUp, UnloadModel
from shared.runner import Lifecycle
from shared.settings import Settings
from shared.subjects import Subjects

log = get_logger(__name__)

TICK_S = 0.5
# A load the view does not show after this long is considered lost and may be retried.
PENDING_TTL_S = 10.0


class Scaler:
    def __init__(self, *, settings: Settings, bus: Bus) -> None:
        self._settings = settings
        self._bus = bus
        self._subjects = Subjects(settings.cluster)
        self._life = Lifecycle("scaler")
        self._view = ViewWatcher(bus, self._subjects)
        self._tes = TaskExecutorClient(bus, self._subjects)
        self._cfg = ScalerConfig(keep_alive_s=settings.scaler.keep_alive.total_seconds())
        self._demands: dict[str, float] = {}
        self._pending: dict[str, tuple[str, float]] = {}  # te_id -> (model, sent at)
        self._failed: dict[str, tuple[int, float]] = {}  # model -> (failures in a row, last)
        self._wake = asyncio.Event()

    async def run(self) -> None:
        await self._view.start(self._life)
        await self._bus.subscribe(self._subjects.scale_demand(), {ScaleUp: self._on_demand})
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
            await self._life.cancel_tasks()
            self._life.stopped()

    async def shutdown(self) -> None:
        self._life.request_stop()

    async def _on_demand(self, msg: ScaleUp) -> None:
        self._demands[msg.model] = time.time()
        self._wake.set()

    async def _tick(self) -> None:
        view = self._view.view
        if view.version < 0:
            return
        now = time.time()
        in_view = {te.te_id: te for te in view.tes}
        for te_id, (model, at) in list(self._pending.items()):
            te = in_view.get(te_id)
            if te is not None and te.failed_model == model:
                count = self._failed.get(model, (0, 0.0))[0] + 1
                self._failed[model] = (count, now)
                log.warning(
                    "model load failed", model=model, te=te_id, failures=count, error=te.error
                )
                del self._pending[te_id]
            elif te is None or te.model == model or now - at > PENDING_TTL_S:
                del self._pending[te_id]
        for te in view.tes:
            if te.state == TEState.READY and te.model is not None:
                self._failed.pop(te.model, None)
        actions = decide(
            view.tes,
            self._demands,
            {te: m for te, (m, _) in self._pending.items()},
            now=now,
            cfg=self._cfg,
            failed=self._failed,
        )
        paths = {m.id: m.path for m in view.models}
        for action in actions:
            try:
                if isinstance(action, Load):
                    if action.model not in paths:
                        continue
                    self._pending[action.te_id] = (action.model, now)
                    ack = await self._tes.control(
                        action.te_id, LoadModel(model=action.model, path=paths[action.model])
                    )
                    log.info(
                        "scale up", model=action.model, te=action.te_id, ok=ack.ok, error=ack.error
                    )
                    if not ack.ok:
                        self._pending.pop(action.te_id, None)
                elif isinstance(action, Unload):
                    ack = await self._tes.control(
                        action.te_id, UnloadModel(reason="keep-alive expired")
                    )
                    log.info("scale to zero", model=action.model, te=action.te_id, ok=ack.ok)
            except MeshserveError as e:
                self._pending.pop(action.te_id, None)
                log.warning("scaling action failed", action=repr(action), error=str(e))


async def create(settings: Settings, bus: Bus) -> Scaler:
    return Scaler(settings=settings, bus=bus)
