"""The health file a service keeps fresh while connected, and `meshserve health` reading it."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from services.cli import main
from shared import health


def test_check_says_missing_stale_or_alive(tmp_path: Path) -> None:
    path = tmp_path / "h"
    ok, why = health.check(path, 5)
    assert not ok and "does not exist" in why
    health.touch(path)
    assert health.check(path, 5)[0]
    old = time.time() - 30
    os.utime(path, (old, old))
    ok, why = health.check(path, 5)
    assert not ok and "old" in why


async def test_touched_only_while_connected_and_removed_at_the_end(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "h"
    connected = False
    task = asyncio.create_task(health.keep_touching(path, lambda: connected, 0.01))
    await asyncio.sleep(0.05)
    assert not path.exists()
    connected = True
    await asyncio.sleep(0.05)
    assert health.check(path, 1)[0]
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert not path.exists()


def test_meshserve_health_exit_codes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "h"
    monkeypatch.delenv("MESHSERVE_HEALTH_FILE", raising=False)
    with pytest.raises(SystemExit) as e:
        main(["health"])
    assert e.value.code == 2
    monkeypatch.setenv("MESHSERVE_HEALTH_FILE", str(path))
    with pytest.raises(SystemExit) as e:
        main(["health"])
    assert e.value.code == 1
    health.touch(path)
    with pytest.raises(SystemExit) as e:
        main(["health"])
    assert e.value.code == 0


def test_meshserve_health_url_unreachable() -> None:
    with pytest.raises(SystemExit) as e:
        main(["health", "--url", "http://127.0.0.1:9/health"])
    assert e.value.code == 1
