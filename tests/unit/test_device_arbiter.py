"""One executor per device (``services/task_executor/device_arbiter.py``), over a real Unix
socket: one turn at a time per device, the next to the earliest deadline (the holder's own
next iteration included), a TE that leaves gives its turn back, devices are independent,
late turns are counted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.task_executor.device_arbiter import LATE_TURNS, DeviceArbiter, TurnClient


@pytest.fixture
async def arbiter(tmp_path: Path) -> AsyncIterator[DeviceArbiter]:
    a = DeviceArbiter(tmp_path / "turns")
    await a.start()
    yield a
    await a.stop()


async def _granted(task: asyncio.Task[None]) -> bool:
    await asyncio.sleep(0.05)
    return task.done()


async def test_the_turn_goes_to_the_earliest_deadline(arbiter: DeviceArbiter) -> None:
    a, b, c = (TurnClient(str(arbiter.path), n) for n in "abc")
    await a.acquire(100.0, "cpu")
    wait_b = asyncio.create_task(b.acquire(10.0, "cpu"))
    wait_c = asyncio.create_task(c.acquire(5.0, "cpu"))
    assert not await _granted(wait_b) and not await _granted(wait_c)  # a holds it
    # a asks for its next iteration (20): c (5), then b (10), then a.
    wait_a = asyncio.create_task(a.acquire(20.0, "cpu"))
    assert await _granted(wait_c) and not await _granted(wait_b) and not wait_a.done()
    c.release()
    assert await _granted(wait_b) and not await _granted(wait_a)
    b.release()
    assert await _granted(wait_a)
    for client in (a, b, c):
        client.close()


async def test_the_holder_keeps_the_turn_while_its_deadline_is_earliest(
    arbiter: DeviceArbiter,
) -> None:
    a, b = TurnClient(str(arbiter.path), "a"), TurnClient(str(arbiter.path), "b")
    await a.acquire(1.0, "cpu")
    wait_b = asyncio.create_task(b.acquire(5.0, "cpu"))
    for deadline in (2.0, 3.0, 4.0):  # its next iterations, still the most urgent
        await asyncio.wait_for(a.acquire(deadline, "cpu"), 1)
        assert not await _granted(wait_b)
    a.release()  # nothing left to run
    assert await _granted(wait_b)
    a.close()
    b.close()


async def test_a_te_that_goes_away_gives_its_turn_back(arbiter: DeviceArbiter) -> None:
    a, b = TurnClient(str(arbiter.path), "a"), TurnClient(str(arbiter.path), "b")
    await a.acquire(1.0, "cpu")
    wait_b = asyncio.create_task(b.acquire(5.0, "cpu"))
    assert not await _granted(wait_b)
    a.close()  # its process died: the connection drops
    assert await _granted(wait_b)
    b.close()


async def test_devices_do_not_wait_for_each_other(arbiter: DeviceArbiter) -> None:
    gpu0, gpu1 = TurnClient(str(arbiter.path), "g0"), TurnClient(str(arbiter.path), "g1")
    await gpu0.acquire(1.0, "cuda:0")
    await asyncio.wait_for(gpu1.acquire(1.0, "cuda:1"), 1)
    gpu0.close()
    gpu1.close()


async def test_a_turn_past_its_deadline_is_counted_late(arbiter: DeviceArbiter) -> None:
    late = LATE_TURNS.labels("cpu")
    before = late._value.get()
    a = TurnClient(str(arbiter.path), "a")
    await a.acquire(time.monotonic() + 60, "cpu")
    await a.acquire(time.monotonic() - 1, "cpu")  # its most urgent request is overdue
    assert late._value.get() == before + 1
    a.close()


async def test_without_an_arbiter_turns_are_granted_at_once(tmp_path: Path) -> None:
    none = TurnClient("", "a")
    await asyncio.wait_for(none.acquire(1.0, "cpu"), 1)
    gone = TurnClient(str(tmp_path / "nobody"), "a")  # an arbiter that is not there
    await asyncio.wait_for(gone.acquire(1.0, "cpu"), 1)
    await asyncio.wait_for(gone.acquire(1.0, "cpu"), 1)  # and stays off
