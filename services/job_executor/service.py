"""The job executor service."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import uuid
from collections import defaultdict

from services.job_executor.scheduling import pick_te
from shared.bus import Bus
from shared.clients import ClusterClient, Heartbeater, ScalerClient, TaskExecutorClient, ViewWatcher
from shared.errors import Internal, MeshserveError, NoCapacity, NotFound, PeerUnreachable, Refused
from shared.logging import get_logger
from shared.messages.cluster import ClusterView, JEHeartbeat, TEState
from shared.messages.jobs import ChatJob, JobAccepted, JobHeld
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
        self._life = Lifecycle("job_executor")
        self._view = ViewWatcher(bus, self._subjects)
        self._view.listeners.append(self._on_view)
        self._tes = TaskExecutorClient(bus, self._subjects)
        self._scaler = ScalerClient(bus, self._subjects)
        self._hb = Heartbeater(
            ClusterClient(bus, self._subjects),
            self._heartbeat,
            settings.membership.heartbeat_interval.total_seconds(),
        )
        # te_id -> unix times of placements not yet covered by that TE's load report
        self._placed: dict[str, list[float]] = defaultdict(list)
        self._last_demand: dict[str, float] = {}
        self._inflight = 0
        self._started = time.time()

    def _heartbeat(self) -> JEHeartbeat:
        return JEHeartbeat(
            je_id=self.je_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            started_at=self._started,
            inflight=self._inflight,
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
        await self._view.start(self._life)
        sub = await self._bus.subscribe(
            self._subjects.job_submit(), {ChatJob: self._on_job}, queue="je", concurrent=True
        )
        self._hb.start(self._life)
        try:
            await self._life.wait()
            # Stop taking jobs, then let the ones being placed finish.
            await asyncio.wait_for(
                sub.close(), self._settings.membership.shutdown_grace.total_seconds()
            )
        finally:
            await self._life.cancel_tasks()
            await ClusterClient(self._bus, self._subjects).leave(self.je_id)
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
        log.debug("job received", model=job.model, attempt=job.attempt)
        refused: set[str] = set()  # TEs that refused or did not answer, until the next view
        held = False
        while True:
            view = self._view.view
            if view.version >= 0 and not any(m.id == job.model for m in view.models):
                raise NotFound(
                    f"The model `{job.model}` does not exist.",
                    param="model",
                    code="model_not_found",
                )
            if failure := self._load_failure(job.model, view):
                await self._demand(job.model)  # the scaler retries, with backoff
                raise Internal(f"The model `{job.model}` failed to load: {failure}")
            placed = {te: len(ts) for te, ts in self._placed.items()}
            # TEs this request already failed on are a last resort, not banned: a TE that
            # gave the request back while unloading may be the model's only instance.
            decision = pick_te(job.model, view.tes, placed, refused | set(job.exclude_te_ids))
            if decision.te_id is None and job.exclude_te_ids:
                decision = pick_te(job.model, view.tes, placed, refused)
            if decision.te_id is not None:
                try:
                    await self._tes.place(decision.te_id, self._task(job))
                except Refused as e:
                    log.info("placement refused", te=decision.te_id, error=e.message)
                    refused.add(decision.te_id)
                    continue
                except PeerUnreachable as e:
                    # No answer in time: it may still have taken the task, so cancel it
                    # there before trying elsewhere.
                    log.info("placement unanswered", te=decision.te_id, error=e.message)
                    with contextlib.suppress(MeshserveError):
                        await self._tes.cancel(decision.te_id, job.request_id, job.attempt)
                    refused.add(decision.te_id)
                    continue
                self._placed[decision.te_id].append(time.time())
                log.info("job placed", te=decision.te_id, attempt=job.attempt)
                return JobAccepted(
                    request_id=job.request_id,
                    te_id=decision.te_id,
                    je_id=self.je_id,
                    attempt=job.attempt,
                )
            if not held:
                held = True
                with contextlib.suppress(MeshserveError):
                    await self._bus.publish(
                        job.reply_to,
                        JobHeld(request_id=job.request_id, je_id=self.je_id, attempt=job.attempt),
                        request_id=job.request_id,
                    )
            if decision.scale_up or refused:
                await self._demand(job.model)
            remaining = job.deadline - time.time()
            if remaining <= 0 or self._life.stopping:
                raise NoCapacity(
                    f"No instance of model `{job.model}` could take the request in time; "
                    "retry later.",
                    retry_after_s=self._settings.job_executor.retry_after.total_seconds(),
                )
            await self._view.wait_change(min(remaining, 0.5))
            refused.clear()

    @staticmethod
    def _load_failure(model: str, view: ClusterView) -> str | None:
        """The error of a recent failed load of the model, when no instance is up or coming."""
        if any(
            te.model == model and te.state in (TEState.READY, TEState.LOADING) for te in view.tes
        ):
            return None
        return next((te.error for te in view.tes if te.failed_model == model and te.error), None)

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
            attempt=job.attempt,
        )


async def create(settings: Settings, bus: Bus) -> JobExecutor:
    return JobExecutor(settings=settings, bus=bus)
