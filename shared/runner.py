"""Running one service process: logging, uvloop, connections, signals, exit code.

Signal handlers only ask the service to stop; run() returns after a full shutdown and
re-raises a fatal error, which becomes a non-zero exit."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Protocol

from shared.bus import Bus
from shared.logging import get_logger, setup_logging
from shared.settings import Settings


class Service(Protocol):
    async def run(self) -> None: ...
    async def shutdown(self) -> None: ...


ServiceFactory = Callable[[Settings, Bus], Awaitable[Service]]


class Lifecycle:
    """running → draining → stopped, with one event a run() loop waits on."""

    def __init__(self) -> None:
        self.state = "running"
        self._stop = asyncio.Event()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def request_stop(self) -> None:
        if self.state == "running":
            self.state = "draining"
        self._stop.set()

    async def wait(self) -> None:
        await self._stop.wait()

    def stopped(self) -> None:
        self.state = "stopped"


async def _main(name: str, factory: ServiceFactory, settings: Settings) -> None:
    log = get_logger(name)
    if not settings.nats_url:
        raise SystemExit(f"{name}: MESHSERVE_NATS_URL is not set (meshserve up sets it)")
    bus = await Bus.connect(
        settings.nats_url, name=f"{settings.cluster}-{name}", cluster=settings.cluster
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
        await service.run()
        log.info("service stopped")
    finally:
        with contextlib.suppress(Exception):
            await bus.close()


def run_service(name: str, factory: ServiceFactory) -> None:
    settings = Settings()
    setup_logging(service=name, fmt=settings.log_format, level=settings.log_level)
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
