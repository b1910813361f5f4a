"""Services run in the test's event loop, each on its own NATS connection so that one can
die (connection dropped, no goodbye) while the others live; and a task executor run as a
real process, for a SIGKILL."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp

from services.cluster_manager.service import ClusterManager
from services.frontend.service import Frontend
from services.job_executor.service import JobExecutor
from shared.bus import Bus
from shared.settings import Settings, process_environment
from shared.store import Store


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
        """Die like a SIGKILLed process: the task stops, the connection drops, no Leave."""
        for item in self.items:
            if item[0] is svc:
                item[1].cancel()
                with contextlib.suppress(BaseException):
                    await item[1]
                await item[2]._nc.close()
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
    settings: Settings, nats_url: str, redis_url: str
) -> AsyncIterator[Running]:
    """A cluster manager, a frontend and a job executor, each on its own connection. On exit
    they stop, with whatever the test started on the same ``Running``."""
    run = Running(settings, nats_url)
    store = await Store.connect(redis_url)
    try:
        await run.start(lambda bus: ClusterManager(settings=settings, bus=bus, store=store))
        await run.start(lambda bus: Frontend(settings=settings, bus=bus))
        await run.start(lambda bus: JobExecutor(settings=settings, bus=bus))
        yield run
    finally:
        await run.stop()
        await store.close()
