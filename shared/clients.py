"""One small client per peer. Each owns its subjects, encoding and timeouts; transport
failures surface as shared.errors.PeerUnreachable, a peer's refusal as the error it sent."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from shared.bus import Bus
from shared.errors import MeshserveError
from shared.logging import get_logger
from shared.messages.base import Message
from shared.messages.cluster import ClusterView, GetView, Leave
from shared.messages.jobs import ChatJob, JobAccepted
from shared.messages.scaling import ControlAck, OutcomeReport, TrafficReport
from shared.messages.tasks import CancelTask, ChatTask, TaskAccepted, TaskMode
from shared.runner import Lifecycle
from shared.subjects import Subjects

log = get_logger(__name__)


class JobExecutorClient:
    def __init__(self, bus: Bus, subjects: Subjects) -> None:
        self._bus, self._s = bus, subjects

    async def submit(self, job: ChatJob, *, timeout: float) -> JobAccepted:
        return await self._bus.request(
            self._s.job_submit(), job, JobAccepted, timeout=timeout, request_id=job.request_id
        )


class TaskExecutorClient:
    def __init__(self, bus: Bus, subjects: Subjects, *, timeout: float = 2.0) -> None:
        self._bus, self._s, self._timeout = bus, subjects, timeout

    async def place(self, te_id: str, task: ChatTask) -> TaskAccepted:
        return await self._bus.request(
            self._s.te_task(te_id),
            task,
            TaskAccepted,
            timeout=self._timeout,
            request_id=task.request_id,
        )

    async def cancel(
        self, te_id: str, request_id: str, attempt: int, *, mode: TaskMode = TaskMode.COLOCATED
    ) -> None:
        """``mode`` PREFILL: the attempt's prefill task (its KV is freed)."""
        # Fire and forget: a TE that is gone has nothing left to cancel.
        await self._bus.publish(
            self._s.te_task(te_id),
            CancelTask(request_id=request_id, attempt=attempt, mode=mode),
            request_id=request_id,
        )

    async def control(self, te_id: str, cmd: Message) -> ControlAck:
        return await self._bus.request(
            self._s.te_control(te_id), cmd, ControlAck, timeout=self._timeout
        )


class ClusterClient:
    def __init__(self, bus: Bus, subjects: Subjects) -> None:
        self._bus, self._s = bus, subjects

    async def get_view(self, *, timeout: float = 2.0) -> ClusterView:
        return await self._bus.request(self._s.get_view(), GetView(), ClusterView, timeout=timeout)

    async def heartbeat(self, hb: Message) -> None:
        await self._bus.publish(self._s.heartbeat(), hb)

    async def leave(self, member_id: str) -> None:
        with contextlib.suppress(MeshserveError):
            await self._bus.publish(self._s.heartbeat(), Leave(member_id=member_id))
            await self._bus.flush()


class ScalerClient:
    def __init__(self, bus: Bus, subjects: Subjects) -> None:
        self._bus, self._s = bus, subjects

    async def traffic(self, report: TrafficReport) -> None:
        await self._bus.publish(self._s.traffic(), report)

    async def outcomes(self, report: OutcomeReport) -> None:
        await self._bus.publish(self._s.outcomes(), report)


class ViewWatcher:
    """Keeps the newest cluster view: pushed ones, plus one fetched at start-up. Waiters
    wake on every newer view."""

    def __init__(self, bus: Bus, subjects: Subjects) -> None:
        self._bus, self._s = bus, subjects
        self._client = ClusterClient(bus, subjects)
        self.view = ClusterView(cluster=subjects.cluster, version=-1, generated_at=0.0)
        self._changed = asyncio.Condition()
        self.listeners: list[Callable[[ClusterView], None]] = []

    async def start(self, life: Lifecycle) -> None:
        await self._bus.subscribe(self._s.view(), {ClusterView: self._on_view})
        life.spawn(self._initial(), name="initial view", one_shot=True)

    async def _initial(self) -> None:
        while self.view.version < 0:
            try:
                await self._on_view(await self._client.get_view())
            except MeshserveError:
                await asyncio.sleep(0.5)

    async def _on_view(self, view: ClusterView) -> None:
        # A restarted cluster manager counts versions from 0 again; its views are newer.
        if view.version <= self.view.version and view.generated_at <= self.view.generated_at:
            return None
        self.view = view
        for cb in self.listeners:
            cb(view)
        async with self._changed:
            self._changed.notify_all()
        return None

    async def wait_change(self, timeout: float) -> None:
        """Return at the next newer view, or after timeout."""
        with contextlib.suppress(TimeoutError):
            async with self._changed:
                await asyncio.wait_for(self._changed.wait(), timeout)


class Heartbeater:
    """Publishes build() every interval, and at once on beat_now()."""

    def __init__(
        self, client: ClusterClient, build: Callable[[], Message], interval: float
    ) -> None:
        self._client, self._build, self._interval = client, build, interval
        self._now = asyncio.Event()

    def start(self, life: Lifecycle) -> None:
        life.spawn(self._loop(), name="heartbeat")

    def beat_now(self) -> None:
        self._now.set()

    async def _loop(self) -> None:
        while True:
            try:
                await self._client.heartbeat(self._build())
            except MeshserveError as e:
                log.warning("heartbeat failed", error=str(e))
            self._now.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._now.wait(), self._interval)
