"""A service's liveness as a file, for health checks that cannot speak NATS (a container's:
compose.yaml runs `meshserve health`).

The service touches the file every heartbeat interval while its NATS connection is up; the
check passes while the file is younger than the liveness timeout, the same rule the cluster
manager applies to heartbeats. A wedged event loop, a lost NATS connection or a dead process
all let the file age."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path


def touch(path: Path) -> None:
    """Mark the service alive now (the file is created if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a"):
        pass
    os.utime(path)


async def keep_touching(path: Path, connected: Callable[[], bool], interval: float) -> None:
    """Touch ``path`` every ``interval`` seconds while ``connected()``; runs until cancelled.
    The file is removed at the end, so a stopped service is unhealthy at once."""
    try:
        while True:
            if connected():
                with contextlib.suppress(OSError):
                    touch(path)
            await asyncio.sleep(interval)
    finally:
        remove(path)


def remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def check(path: Path, max_age: float, now: float | None = None) -> tuple[bool, str]:
    """Whether the service behind ``path`` is alive, with the reason in words."""
    try:
        age = (time.time() if now is None else now) - path.stat().st_mtime
    except FileNotFoundError:
        return False, f"{path} does not exist: the service has not connected yet, or stopped"
    if age > max_age:
        return False, f"{path} is {age:.1f} s old (> {max_age:g} s): no NATS, or the service hangs"
    return True, f"alive ({age:.1f} s ago)"
