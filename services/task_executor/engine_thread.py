"""The one thread a TE's engine lives on.

The engine is synchronous. It is loaded, stepped and closed on one dedicated thread;
requests to add or abort are queued and applied by the engine loop between steps
(``task_loop.py``), so the engine is only ever touched by one thread at a time. One thread,
not asyncio's pool: each thread that runs torch ops gets its own OpenMP team, and on a small
host an idle team's spinning threads steal cores from the team doing the forward."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from typing import TypeVar

from shared.logging import get_logger
from shared.settings import Settings

log = get_logger(__name__)

_T = TypeVar("_T")


class EngineThread:
    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="engine"
        )

    def run(self, fn: Callable[..., _T], *args: object) -> asyncio.Future[_T]:
        """``fn(*args)`` on the engine thread, after whatever was queued before it."""
        return asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def prewarm(self, prewarm: Callable[[Settings], None], settings: Settings) -> None:
        """What every load would pay first (imports, kernel compiles), queued now: a load
        asked for meanwhile waits its turn. A failure is logged: the first load pays."""
        self._pool.submit(_prewarm, prewarm, settings)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)


def _prewarm(prewarm: Callable[[Settings], None], settings: Settings) -> None:
    t = time.monotonic()
    try:
        prewarm(settings)
    except Exception:
        log.exception("pre-warming the engine failed")
    else:
        log.info("engine pre-warmed", seconds=round(time.monotonic() - t, 2))
