"""The job executor service."""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from collections import defaultdict

from services.job_executor.scheduling import pick_te
from shared.bus import Bus
from shared.clients import ClusterClient, Heartbeater, ScalerClient, TaskExecutorClient, ViewWatcher
from shared.errors import MeshserveError, NotFound, Unavailable
from shared.logging import get_logger
from shared.messages.cluster import ClusterView, JEHeartbeat
from shared.messages.jobs import ChatJob, JobAccepted
from shared.messages.scaling import ScaleUp
from shared.messages.tasks import ChatTask
from shared.runner import Lifecycle
from shared.settings import Settings
from shared.subjects import Subjects

log = get_logger(__name__)

# How often a JE repeats a scale-up demand for a model it is still holding jobs for.
DEMAND_REPEAT_S = 1.0


class JobExecutor:
    def __init__(self, *, settings: Settings, bus: Bus) -> None:
        self._settings = settings
        self._bus = bus
        self._subjects = Subjects(settings.cluster)
        self.je_id = f"je-{uuid.uuid4().hex[:8]}"
        self._life = Lifecycle()
        self._view = ViewWatcher(bus, self._subjects)
        self._view.listeners.append(self._on_view)
        self._tes = TaskExecutorClient(bus, self._subjects)
        self._scaler = ScalerClient(bus, self._subjects)
        self._hb = Heartbeater(
            ClusterClient(bus, self._subjects),
            self._heartbeat,
            settings.heartbeat_interval.total_seconds(),
        )
        # te_id -> unix times of placements not yet covered by that TE's load report
        self._placed: dict[str, list[float]] = defaultdict(list)
        self._last_demand: dict[str, float] = {}
        self._inflight = 0
        self._started = time.time()

    def _heartbeat(self) -> JEHeartbeat:
        return JEHeartbeat(
            je_id=self.je_id, host=socket.gethostname(), pid=os.getpid(),
            started_at=self._started, inflight=self._inflight,
        )

    def _on_view(self, view: ClusterView) -> None:
        reported = {te.te_id: te.sent_at for te in view.tes}
        for te_id in list(self._placed):
            at = reported.get(te_id)
            if at is None:
                del self._placed[te_id]
            else:
                self._placed[te_id] = [t for t in self._placed[te_id] if t > at]

    async def run(self) -> None:
        await self._view.start()
        sub = await self._bus.subscribe(
            self._subjects.job_submit(), {ChatJob: self._on_job}, queue="je", concurrent=True
        )
        self._hb.start()
        try:
            await self._life.wait()
            # Stop taking jobs, then let the ones being placed finish.
            await asyncio.wait_for(sub.close(), self._settings.shutdown_grace.total_seconds())
        finally:
            await self._hb.stop()
            await ClusterClient(self._bus, self._subjects).leave(self.je_id)
            await self._view.stop()
            self._life.stopped()

    async def shutdown(self) -> None:
        self._life.request_stop()

    async def _on_job(self, job: ChatJob) -> JobAccepted:
        self._inflight += 1
        try:
            return await self._place(job)
        finally:
            self._inflight -= 1

    async def _place(self, job: ChatJob) -> JobAccepted:
        log.debug("job received", request_id=job.request_id, model=job.model, attempt=job.attempt)
        exclude = set(job.exclude_te_ids)
        while True:
            view = self._view.view
            if view.version >= 0 and not any(m.id == job.model for m in view.models):
                raise NotFound(
                    f"The model `{job.model}` does not exist.", param="model",
                    code="model_not_found",
                )
            placed = {te: len(ts) for te, ts in self._placed.items()}
            decision = pick_te(job.model, view.tes, placed, exclude)
            if decision.te_id is not None:
                try:
                    await self._tes.place(decision.te_id, self._task(job))
                except Unavailable as e:
                    # That TE is gone or not serving the model any more: try another.
                    log.info("placement refused", te=decision.te_id, error=str(e))
                    exclude.add(decision.te_id)
                    continue
                self._placed[decision.te_id].append(time.time())
                log.info("job placed", request_id=job.request_id, te=decision.te_id)
                return JobAccepted(request_id=job.request_id, te_id=decision.te_id, je_id=self.je_id)
            if decision.scale_up or exclude:
                await self._demand(job.model)
            remaining = job.deadline - time.time()
            if remaining <= 0 or self._life.stopping:
                raise Unavailable(
                    f"No instance of model `{job.model}` could take the request in time; "
                    "retry later.",
                    retry_after_s=self._settings.retry_after.total_seconds(),
                    code="no_capacity",
                )
            await self._view.wait_change(min(remaining, 0.5))
            exclude = set(job.exclude_te_ids)  # a new view may have revived them

    async def _demand(self, model: str) -> None:
        now = time.monotonic()
        if now - self._last_demand.get(model, 0.0) < DEMAND_REPEAT_S:
            return
        self._last_demand[model] = now
        try:
            await self._scaler.demand(ScaleUp(model=model, je_id=self.je_id))
        except MeshserveError as e:
            log.warning("scale demand failed", model=model, error=str(e))

    @staticmethod
    def _task(job: ChatJob) -> ChatTask:
        return ChatTask(
            request_id=job.request_id,
            model=job.model,
            prompt_token_ids=job.prompt_token_ids,
            sampling=job.sampling,
            reply_to=job.reply_to,
            deadline=job.deadline,
        )


async def create(settings: Settings, bus: Bus) -> JobExecutor:
    return JobExecutor(settings=settings, bus=bus)
