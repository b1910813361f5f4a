"""Running one service process: logging, uvloop, connections, signals, exit code.

Signal handlers only ask the service to stop; run() returns after a full shutdown and
re-raises a fatal error, which becomes a non-zero exit."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, Protocol

from shared import health, heap, tracing
from shared.access import SERVICE_ROLE
from shared.bus import Bus
from shared.logging import get_logger, setup_logging
from shared.settings import Settings

_log = get_logger(__name__)


class Service(Protocol):
    async def run(self) -> None: ...
    async def shutdown(self) -> None: ...


ServiceFactory = Callable[[Settings, Bus], Awaitable[Service]]


class ServiceFailed(Exception):
    """A background task of the service died; the service stopped because of it."""


async def cancel_until_done(tasks: Callable[[], Iterable[asyncio.Task[Any]]]) -> None:
    """Cancel the tasks ``tasks()`` names and wait for them to end. A task that outlives its
    cancel (Python 3.11's ``asyncio.wait_for`` swallows one that meets the awaited result)
    is cancelled again, as is one started meanwhile, until none is left running."""
    while running := [t for t in tasks() if not t.done()]:
        for t in running:
            t.cancel()
        await asyncio.wait(running, timeout=1.0)


class Lifecycle:
    """running → draining → stopped, with one event a run() loop waits on, and the
    service's background tasks under supervision.

    A background task that dies (raises, or a loop that returns while the service runs) is
    fatal: it is logged with its reason, the service is asked to stop, and ``stopped()``
    raises ``ServiceFailed``, so run() re-raises, the process exits non-zero, and whatever
    runs it (the launcher, the node pool, a container runtime) starts a fresh one. A loop
    that died silently would leave a process that looks alive and does nothing."""

    def __init__(self, name: str = "service") -> None:
        self.name = name
        self.state = "running"
        self._stop = asyncio.Event()
        self._tasks: dict[asyncio.Task[Any], bool] = {}  # task -> may end on its own
        self.failure: BaseException | None = None

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def request_stop(self) -> None:
        if self.state == "running":
            self.state = "draining"
        self._stop.set()

    async def wait(self) -> None:
        await self._stop.wait()

    def spawn(
        self, coro: Coroutine[Any, Any, Any], *, name: str, one_shot: bool = False
    ) -> asyncio.Task[Any]:
        """Run ``coro`` as a supervised background task. ``one_shot``: it may return (a
        start-up fetch); a loop may not."""
        task = asyncio.create_task(coro, name=name)
        self._tasks[task] = one_shot
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        one_shot = self._tasks.pop(task, False)
        if task.cancelled():
            return
        error = task.exception()
        if error is None and (one_shot or self.stopping):
            return
        if self.failure is None:
            self.failure = error or RuntimeError(f"background task {task.get_name()} returned")
            _log.error(
                "background task died; stopping the service",
                service=self.name,
                task=task.get_name(),
                error=f"{type(self.failure).__name__}: {self.failure}",
                exc_info=error,
            )
        self.request_stop()

    async def cancel_tasks(self) -> None:
        """Cancel the background tasks still running and wait for them."""
        await cancel_until_done(lambda: self._tasks)

    def stopped(self) -> None:
        """The service is down; raises ServiceFailed if a background task killed it."""
        self.state = "stopped"
        if self.failure is not None:
            raise ServiceFailed(
                f"{self.name}: a background task died: {type(self.failure).__name__}: "
                f"{self.failure}"
            ) from self.failure


async def _main(name: str, factory: ServiceFactory, settings: Settings) -> None:
    log = get_logger(name)
    if not settings.nats_url:
        raise SystemExit(f"{name}: MESHSERVE_NATS_URL is not set (meshserve up sets it)")
    bus = await Bus.connect(
        settings.nats_url,
        name=f"{settings.cluster}-{name}",
        cluster=settings.cluster,
        role=SERVICE_ROLE.get(name.split(".", 1)[0]),  # a pool's TEs: task_executor.<id>
        ping_interval=settings.membership.nats_ping_interval.total_seconds(),
    )
    try:
        service = await factory(settings, bus)
        loop = asyncio.get_running_loop()
        stopping: list[asyncio.Task[None]] = []

        def on_signal() -> None:
            # The first signal asks for a graceful stop; a second one means "now".
            if stopping:
                log.warning("second signal: exiting without draining")
                os._exit(1)
            stopping.append(asyncio.create_task(service.shutdown()))

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        log.info("service started", cluster=settings.cluster)
        heap.settle()  # what it built to start lives as long as it does
        alive = None
        if path := settings.membership.health_file:
            interval = settings.membership.heartbeat_interval.total_seconds()
            alive = asyncio.create_task(
                health.keep_touching(path, lambda: bus.connected, interval), name="health-file"
            )
        try:
            await service.run()
        finally:
            if alive is not None:
                alive.cancel()
                await asyncio.gather(alive, return_exceptions=True)
        log.info("service stopped")
    finally:
        with contextlib.suppress(Exception):
            await bus.close()


def run_service(name: str, factory: ServiceFactory, settings: Settings | None = None) -> None:
    settings = settings or Settings.load()
    setup_logging(service=name, fmt=settings.log.format, level=settings.log.level)
    tracing.setup(settings.tracing.otlp_endpoint, name)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(_main(name, factory, settings))
    except KeyboardInterrupt:
        pass
    except Exception:
        get_logger(name).exception("service failed")
        sys.exit(1)
