"""A task executor dies holding many streams: every one of them moves to another instance
at once, on one notice, within one liveness deadline of the death, and finishes there."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import aiohttp
import pytest

from services.task_executor.worker import TaskExecutor
from shared.bus import Bus
from shared.clients import TaskExecutorClient
from shared.embedded import free_port
from shared.messages.base import decoder_for
from shared.messages.jobs import ChatJob
from shared.messages.scaling import LoadModel
from shared.settings import Settings
from shared.subjects import Subjects
from tests.integration.services import control_plane, te_process, wait_health

pytestmark = [pytest.mark.nats, pytest.mark.redis, pytest.mark.slow]

STREAMS = 8
MAX_TOKENS = 1500


def _ready_on(te_id: str):  # type: ignore[no-untyped-def]
    def ready(body: dict) -> bool:
        return any(t["id"] == te_id and t["state"] == "ready" for t in body["task_executors"])

    return ready


async def _stream(http: aiohttp.ClientSession, base: str, i: int, got: list[list[float]]) -> dict:
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": f"Tell me story number {i}."}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage: dict = {}
    async with http.post(base + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                got[i].append(time.monotonic())
    return usage


async def test_all_streams_of_a_killed_te_move_at_once(
    cluster: str, nats_url: str, redis_url: str, tmp_path: Path, demo_model_dir: Path
) -> None:
    (tmp_path / "demo").symlink_to(demo_model_dir)
    liveness = 1.0
    settings = Settings(
        cluster=cluster,
        nats_url=nats_url,
        models_dir=tmp_path,
        http_port=free_port(),
        heartbeat_interval=timedelta(seconds=0.2),
        liveness_timeout=timedelta(seconds=liveness),
        placement_timeout=timedelta(seconds=20),
        shutdown_grace=timedelta(seconds=1),
        torch_threads=1,
    )
    base = f"http://127.0.0.1:{settings.frontend.http_port}"
    victim = te_process(settings, "te-victim")
    try:
        async with control_plane(settings, nats_url, redis_url) as run:
            await _kill_one_of_two(run, settings, base, demo_model_dir, victim, liveness)
    finally:
        with contextlib.suppress(ProcessLookupError):
            victim.kill()
        victim.wait()


async def _kill_one_of_two(  # type: ignore[no-untyped-def]
    run, settings: Settings, base: str, demo_model_dir: Path, victim, liveness: float
) -> None:
    control = await run.start(lambda bus: _Watcher(settings, bus))
    await wait_health(base, lambda b: any(t["id"] == "te-victim" for t in b["task_executors"]))
    load = LoadModel(model="demo", path=str(demo_model_dir))
    assert (await control.tes.control("te-victim", load)).ok
    await wait_health(base, _ready_on("te-victim"))

    got: list[list[float]] = [[] for _ in range(STREAMS)]
    async with aiohttp.ClientSession() as http:
        streams = [asyncio.create_task(_stream(http, base, i, got)) for i in range(STREAMS)]
        deadline = time.monotonic() + 30
        while not all(got):  # every stream is running on the victim
            assert time.monotonic() < deadline, [len(g) for g in got]
            assert not any(s.done() for s in streams), [s.result() for s in streams if s.done()]
            await asyncio.sleep(0.02)
        # The second instance, only now: none of the 8 was placed on it.
        await run.start(
            lambda bus: TaskExecutor(settings=settings, bus=bus, te_id="te-b", pool_id="p")
        )
        await wait_health(base, lambda b: any(t["id"] == "te-b" for t in b["task_executors"]))
        assert (await control.tes.control("te-b", load)).ok
        await wait_health(base, _ready_on("te-b"))
        assert not any(s.done() for s in streams)

        killed_at = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        usages = await asyncio.wait_for(asyncio.gather(*streams), 120)

    moved = control.resubmitted_at
    assert len(moved) == STREAMS, moved  # each stream moved once
    first, last = min(moved.values()), max(moved.values())
    # All on one notice: the liveness deadline of the victim's last heartbeat (at most one
    # heartbeat interval before the kill), then one resubmission each, together.
    assert first - killed_at <= liveness + 0.5, first - killed_at
    assert first - killed_at >= liveness - 0.3, first - killed_at
    assert last - first < 0.1, sorted(moved.values())
    for usage in usages:
        assert usage["completion_tokens"] == MAX_TOKENS


class _Watcher:
    """Not a service of the platform: the test's eyes on the bus (resubmitted jobs) and its
    hands on the TEs (the scaler's LoadModel)."""

    def __init__(self, settings: Settings, bus: Bus) -> None:
        self._bus, self._subjects = bus, Subjects(settings.cluster)
        self.tes = TaskExecutorClient(bus, self._subjects, timeout=10)
        self.resubmitted_at: dict[str, float] = {}
        self._stop = asyncio.Event()

    async def run(self) -> None:
        dec = decoder_for(ChatJob)

        async def on_job(m) -> None:  # type: ignore[no-untyped-def]
            job = dec.decode(m.data)
            if job.attempt > 0:
                self.resubmitted_at.setdefault(job.request_id, time.monotonic())

        # A plain subscription beside the job executors' queue group: a copy of every job.
        await self._bus.subscribe_raw(self._subjects.job_submit(), on_job)
        await self._stop.wait()

    async def shutdown(self) -> None:
        self._stop.set()
