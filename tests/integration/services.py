"""Services run in the test's event loop, each on its own NATS connection so that one can
die (connection dropped, no goodbye) while the others live; and a task executor run as a
real process, for a SIGKILL."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiohttp

from services.cluster_manager.service import ClusterManager
from services.frontend.service import Frontend
from services.job_executor.service import JobExecutor
from shared.bus import Bus
from shared.clients import JobExecutorClient, TaskExecutorClient, ViewWatcher
from shared.embedded import free_port
from shared.messages.api import SamplingParams
from shared.messages.cluster import TEState
from shared.messages.jobs import ChatJob, JobAccepted
from shared.messages.scaling import LoadModel
from shared.messages.tasks import ChatTask, TokenChunk
from shared.runner import Lifecycle
from shared.settings import Settings, process_environment
from shared.store import Store
from shared.subjects import Subjects


class Running:
    def __init__(self, settings: Settings, nats_url: str) -> None:
        self.settings, self.nats_url = settings, nats_url
        self.items: list[tuple[Any, asyncio.Task[None], Bus]] = []

    async def start(self, make: Callable[[Bus], Any]) -> Any:
        bus = await Bus.connect(self.nats_url, name="pytest-svc", cluster=self.settings.cluster)
        svc = make(bus)
        self.items.append((svc, asyncio.create_task(svc.run()), bus))
        return svc

    async def kill(self, svc: Any) -> None:
        """Die like a SIGKILLed process: the connection drops first (nothing more reaches
        it, no Leave gets out), then the task stops."""
        for item in self.items:
            if item[0] is svc:
                await item[2]._nc.close()
                item[1].cancel()
                with contextlib.suppress(BaseException):
                    await item[1]
                self.items.remove(item)
                return

    async def stop(self) -> None:
        for svc, task, bus in reversed(self.items):
            await svc.shutdown()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 15)
            await bus.close()


def te_process(settings: Settings, te_id: str, pool_id: str = "p") -> subprocess.Popen[bytes]:
    """A task executor in its own process (pre-warmed, no model), as a node pool starts it."""
    return subprocess.Popen(
        [sys.executable, "-m", "services.task_executor.worker", te_id, pool_id],
        env=process_environment(settings.env()),
        stdin=subprocess.DEVNULL,
    )


async def wait_health(
    base: str, ready: Callable[[dict[str, Any]], bool], timeout: float = 30
) -> dict:
    """The frontend's /health body once ``ready(body)`` holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    body: dict[str, Any] = {}
    async with aiohttp.ClientSession() as http:
        while True:
            with contextlib.suppress(aiohttp.ClientError, ValueError):
                async with http.get(base + "/health") as r:
                    body = await r.json()
                    if ready(body):
                        return body
            if loop.time() > deadline:
                raise TimeoutError(
                    f"the cluster did not get ready: {body if 'body' in dir() else None}"
                )
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def control_plane(
    settings: Settings, nats_url: str, redis_url: str, *, je_store: bool = False
) -> AsyncIterator[Running]:
    """A cluster manager, a frontend and a job executor, each on its own connection. On exit
    they stop, with whatever the test started on the same ``Running``. ``je_store``: the job
    executor has its Redis store, as ``create`` gives it (its task graphs are durable)."""
    run = Running(settings, nats_url)
    store = await Store.connect(redis_url)
    je = await Store.connect(redis_url) if je_store else None
    try:
        await run.start(lambda bus: ClusterManager(settings=settings, bus=bus, store=store))
        await run.start(lambda bus: Frontend(settings=settings, bus=bus))
        await run.start(lambda bus: JobExecutor(settings=settings, bus=bus, store=je))
        yield run
    finally:
        await run.stop()
        await store.close()


def fast_settings(
    cluster: str, nats_url: str, redis_url: str, models: Path, **values: Any
) -> Settings:
    """A test cluster that notices a lost member within a second (heartbeats every 0.2 s),
    on one torch thread a TE, with a port of its own; ``values`` on top."""
    return Settings(
        cluster=cluster,
        nats_url=nats_url,
        redis_url=redis_url,
        models_dir=models,
        http_port=free_port(),
        heartbeat_interval=timedelta(seconds=0.2),
        liveness_timeout=timedelta(seconds=1),
        placement_timeout=timedelta(seconds=30),
        shutdown_grace=timedelta(seconds=1),
        torch_threads=1,
    ).with_values(**values)


class BusClient:
    """The test's hands: jobs straight to the job executors (their JobAccepted says where
    each went), tasks straight to a TE, and the cluster view."""

    def __init__(self, settings: Settings, bus: Bus) -> None:
        self.bus, self.subjects = bus, Subjects(settings.cluster)
        self.jobs = JobExecutorClient(bus, self.subjects)
        self.tes = TaskExecutorClient(bus, self.subjects, timeout=10)
        self.view = ViewWatcher(bus, self.subjects)
        self._life = Lifecycle("test client")
        self.started = asyncio.Event()

    async def run(self) -> None:
        await self.view.start(self._life)
        self.started.set()
        await self._life.wait()
        await self._life.cancel_tasks()
        self._life.stopped()

    async def shutdown(self) -> None:
        self._life.request_stop()

    @contextlib.asynccontextmanager
    async def inbox(self) -> AsyncIterator[tuple[str, asyncio.Queue[TokenChunk]]]:
        subject = f"{self.subjects.cluster}.test.inbox.{uuid.uuid4().hex}"
        queue: asyncio.Queue[TokenChunk] = asyncio.Queue()

        async def on_chunk(chunk: TokenChunk) -> None:
            queue.put_nowait(chunk)

        sub = await self.bus.subscribe(subject, {TokenChunk: on_chunk})
        try:
            yield subject, queue
        finally:
            await sub.close()

    async def complete(self, prompt: list[int], max_tokens: int = 2) -> tuple[JobAccepted, int]:
        """Place a job through the job executors and wait for its end: (where it went, the
        prompt tokens the TE found cached)."""
        accepted, _, cached = await self.generate(prompt, max_tokens)
        return accepted, cached

    async def generate(
        self, prompt: list[int], max_tokens: int = 2
    ) -> tuple[JobAccepted, list[int], int]:
        """A greedy generation through the job executors: (where it went, its tokens, the
        prompt tokens the TE found cached)."""
        async with self.inbox() as (subject, queue):
            job = ChatJob(
                request_id=uuid.uuid4().hex,
                model="demo",
                prompt_token_ids=prompt,
                sampling=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                reply_to=subject,
                deadline=time.time() + 20,
            )
            accepted = await self.jobs.submit(job, timeout=25)
            return accepted, *(await self._collect(queue))

    async def run_on(
        self, te_id: str, prompt: list[int], max_tokens: int = 2
    ) -> tuple[list[int], int]:
        """A greedy generation placed on one TE directly, colocated: (its tokens, the prompt
        tokens the TE found cached)."""
        async with self.inbox() as (subject, queue):
            task = ChatTask(
                request_id=uuid.uuid4().hex,
                model="demo",
                prompt_token_ids=prompt,
                sampling=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                reply_to=subject,
                deadline=time.time() + 20,
            )
            await self.tes.place(te_id, task)
            return await self._collect(queue)

    @staticmethod
    async def _collect(queue: asyncio.Queue[TokenChunk]) -> tuple[list[int], int]:
        tokens: list[int] = []
        cached = 0
        while True:
            chunk = await asyncio.wait_for(queue.get(), 30)
            cached = max(cached, chunk.cached_tokens)
            tokens += chunk.token_ids
            if chunk.finish_reason is not None:
                assert chunk.finish_reason != "error", chunk.error
                return tokens, cached

    async def busy(self, te_id: str, n: int) -> list[str]:
        """``n`` long decodes placed on ``te_id`` directly (another JE's work)."""
        ids = []
        for i in range(n):
            task = ChatTask(
                request_id=f"busy-{uuid.uuid4().hex}",
                model="demo",
                prompt_token_ids=[30 + i, *range(31, 230)],  # queued: 200 tokens each
                sampling=SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True),
                reply_to=f"{self.subjects.cluster}.test.sink",
                deadline=time.time() + 60,
            )
            await self.tes.place(te_id, task)
            ids.append(task.request_id)
        return ids

    async def load_everywhere(self, path: Path, model: str = "demo") -> list[str]:
        """``model`` loaded on every TE in the view, and each ready: their ids."""
        tes = [t.te_id for t in self.view.view.tes]
        for te_id in tes:
            ack = await self.tes.control(te_id, LoadModel(model=model, path=str(path)))
            assert ack.ok, ack
        await self.until(lambda v: all(t.state == TEState.READY for t in v.tes), 60)
        return tes

    async def until(self, ok, timeout: float = 30) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while not ok(self.view.view):
            assert time.monotonic() < deadline, self.view.view
            await self.view.wait_change(0.2)
