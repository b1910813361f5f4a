"""A service's background tasks stop on shutdown even when one outlives its first cancel
(Python 3.11's ``asyncio.wait_for`` returns the result instead of raising when a cancel
meets the awaited value: a loop around it runs on)."""

from __future__ import annotations

import asyncio

from shared.runner import Lifecycle


async def _swallows_one_cancel(cancels: list[int]) -> None:
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancels.append(1)
            if len(cancels) > 1:
                raise


async def test_a_task_that_outlives_its_cancel_is_cancelled_again() -> None:
    life = Lifecycle("test")
    cancels: list[int] = []
    task = life.spawn(_swallows_one_cancel(cancels), name="stubborn")
    plain = life.spawn(asyncio.sleep(3600), name="plain")
    await asyncio.sleep(0)
    await asyncio.wait_for(life.cancel_tasks(), 5)
    assert task.cancelled() and plain.cancelled()
    assert len(cancels) == 2
    life.stopped()  # cancelled tasks are no failure
