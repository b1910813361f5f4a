"""Failures between services, on real NATS and Redis with the real torch engine: a job
executor dying while it holds a job or while it places one, and a model whose checkpoint
cannot load."""

import asyncio
import contextlib
import shutil
import time
from datetime import timedelta
from pathlib import Path

import aiohttp
import pytest

from services.cluster_manager.service import ClusterManager
from services.frontend.service import Frontend
from services.job_executor.service import JobExecutor
from services.scaler.service import Scaler
from services.task_executor.worker import TaskExecutor
from shared.bus import Bus
from shared.clients import ClusterClient
from shared.embedded import free_port
from shared.messages.cluster import Leave, TEHeartbeat, TEState
from shared.messages.tasks import CancelTask, ChatTask
from shared.settings import Settings
from shared.store import Store
from shared.subjects import Subjects
from tests.integration.services import Running, wait_health

pytestmark = [pytest.mark.nats, pytest.mark.redis]


@pytest.fixture
async def cluster_env(
    cluster: str, nats_url: str, redis_url: str, tmp_path: Path, demo_model_dir: Path
):
    (tmp_path / "demo").symlink_to(demo_model_dir)
    settings = Settings(
        cluster=cluster,
        redis_url=redis_url,  # the scaler keeps measured capacities there
        models_dir=tmp_path,
        http_port=free_port(),
        heartbeat_interval=timedelta(seconds=0.2),
        liveness_timeout=timedelta(seconds=1),
        placement_timeout=timedelta(seconds=20),
        shutdown_grace=timedelta(seconds=1),
    )
    run = Running(settings, nats_url)
    store = await Store.connect(redis_url)
    await run.start(lambda bus: ClusterManager(settings=settings, bus=bus, store=store))
    await run.start(lambda bus: Frontend(settings=settings, bus=bus))
    yield settings, run
    await run.stop()


async def wait_port(base: str) -> None:
    async with aiohttp.ClientSession() as http:
        for _ in range(200):
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(base + "/health") as r:
                    if (await r.json())["models"]:
                        return
            await asyncio.sleep(0.05)


async def test_job_survives_the_death_of_the_job_executor_holding_it(cluster_env):
    settings, run = cluster_env
    base = f"http://127.0.0.1:{settings.frontend.http_port}"
    await wait_port(base)
    je1 = await run.start(lambda bus: JobExecutor(settings=settings, bus=bus))
    await asyncio.sleep(0.5)  # je1 is the only JE: it takes the job and holds it (no TE yet)
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "temperature": 0,
    }
    async with aiohttp.ClientSession() as http:
        req = asyncio.create_task(http.post(base + "/v1/chat/completions", json=body))
        await asyncio.sleep(1.0)
        assert not req.done()
        await run.start(lambda bus: JobExecutor(settings=settings, bus=bus))
        await run.kill(je1)
        # Capacity arrives only now: a scaler and one pre-warmed TE.
        await run.start(lambda bus: Scaler(settings=settings, bus=bus))
        await run.start(
            lambda bus: TaskExecutor(settings=settings, bus=bus, te_id="te-r", pool_id="p")
        )
        t0 = time.monotonic()
        resp = await asyncio.wait_for(req, 30)
        data = await resp.json()
    assert resp.status == 200, data
    assert data["usage"]["completion_tokens"] == 5
    assert time.monotonic() - t0 < 15


class SilentTE:
    """A task executor that reports itself ready with the model and never answers a
    placement: a job executor placing a job on it waits there (up to its placement request's
    timeout) before it answers the frontend or says it holds the job."""

    def __init__(self, bus: Bus, settings: Settings, te_id: str) -> None:
        self._bus, self._settings, self.te_id = bus, settings, te_id
        self._subjects = Subjects(settings.cluster)
        self.tasks: asyncio.Queue[ChatTask] = asyncio.Queue()
        self._beat: asyncio.Task[None] | None = None
        self._gone = asyncio.Event()

    async def start(self) -> None:
        await self._bus.subscribe(
            self._subjects.te_task(self.te_id),
            {ChatTask: self._on_task, CancelTask: self._on_cancel},
            concurrent=True,
        )
        self._beat = asyncio.create_task(self._heartbeats())

    async def _on_task(self, task: ChatTask) -> None:
        self.tasks.put_nowait(task)
        await self._gone.wait()  # no answer while it is up

    async def _on_cancel(self, _: CancelTask) -> None:
        return None

    async def _heartbeats(self) -> None:
        client = ClusterClient(self._bus, self._subjects)
        started = time.time()
        while True:
            await client.heartbeat(
                TEHeartbeat(
                    te_id=self.te_id,
                    pool_id="silent",
                    host="silent",
                    pid=0,
                    state=TEState.READY,
                    started_at=started,
                    model="demo",
                    sent_at=time.time(),
                )
            )
            await asyncio.sleep(self._settings.membership.heartbeat_interval.total_seconds())

    async def leave(self) -> None:
        self._gone.set()
        if self._beat is not None:
            self._beat.cancel()
        await self._bus.publish(self._subjects.heartbeat(), Leave(member_id=self.te_id))


async def test_job_survives_the_death_of_the_job_executor_placing_it(cluster_env, nats_url):
    """The JE dies while it places the job (its placement unanswered: before it answers the
    frontend, and before any JobHeld notice). The frontend follows that JE from the moment
    it took the job (JobTaken), so it resubmits within one liveness deadline: not after the
    job's bus request times out (placement timeout + 5 s), which would fail it with 503."""
    settings, run = cluster_env
    base = f"http://127.0.0.1:{settings.frontend.http_port}"
    await wait_port(base)
    bus = await Bus.connect(nats_url, name="pytest-silent-te", cluster=settings.cluster)
    silent = SilentTE(bus, settings, "te-silent")
    try:
        await silent.start()
        je1 = await run.start(lambda bus: JobExecutor(settings=settings, bus=bus))
        await wait_health(base, lambda b: b["job_executors"] == 1 and b["task_executors"])
        body = {
            "model": "demo",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "temperature": 0,
        }
        async with aiohttp.ClientSession() as http:
            req = asyncio.create_task(http.post(base + "/v1/chat/completions", json=body))
            # je1 is placing the job on the silent TE (it waits up to 2 s for the answer).
            task = await asyncio.wait_for(silent.tasks.get(), 10)
            assert task.attempt == 0
            await run.start(lambda bus: JobExecutor(settings=settings, bus=bus))
            await run.kill(je1)
            t0 = time.monotonic()
            await silent.leave()  # (je2 may still try it once: its view can lag the Leave)
            # Capacity for the resubmitted job: a scaler and one pre-warmed TE.
            await run.start(lambda bus: Scaler(settings=settings, bus=bus))
            await run.start(
                lambda bus: TaskExecutor(settings=settings, bus=bus, te_id="te-r", pool_id="p")
            )
            resp = await asyncio.wait_for(req, 30)
            data = await resp.json()
            elapsed = time.monotonic() - t0
            assert resp.status == 200, data
            # The same request undisturbed, on the same cluster: the same greedy output.
            async with http.post(base + "/v1/chat/completions", json=body) as r:
                again = await r.json()
                assert r.status == 200, again
    finally:
        await bus.close()
    assert data["usage"]["completion_tokens"] == 5
    assert data["choices"][0]["message"] == again["choices"][0]["message"]
    # Without JobTaken the frontend waits out its request to je1: 20 s + 5 s, then 503.
    assert elapsed < 15, elapsed


async def test_a_model_that_cannot_load_fails_fast_with_its_error(
    cluster_env, demo_model_dir: Path
):
    settings, run = cluster_env
    broken = settings.models_dir / "broken"
    broken.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(demo_model_dir / f, broken / f)
    (broken / "model.safetensors").write_bytes(b"this is not a safetensors file")
    await run.start(lambda bus: JobExecutor(settings=settings, bus=bus))
    await run.start(lambda bus: Scaler(settings=settings, bus=bus))
    await run.start(lambda bus: TaskExecutor(settings=settings, bus=bus, te_id="te-b", pool_id="p"))
    base = f"http://127.0.0.1:{settings.frontend.http_port}"
    body = {"model": "broken", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    async with aiohttp.ClientSession() as http:
        for _ in range(200):  # the registry rescans every few seconds
            async with http.get(base + "/v1/models") as r:
                if any(m["id"] == "broken" for m in (await r.json())["data"]):
                    break
            await asyncio.sleep(0.1)
        t0 = time.monotonic()
        async with http.post(base + "/v1/chat/completions", json=body) as r:
            status, err = r.status, (await r.json())["error"]
        elapsed = time.monotonic() - t0
        # Meanwhile the healthy model still works on the same TE.
        ok = {**body, "model": "demo"}
        async with http.post(base + "/v1/chat/completions", json=ok) as r:
            assert r.status == 200, await r.text()
    assert status == 500 and "failed to load" in err["message"], err
    assert elapsed < 10  # not the 20 s placement timeout
