"""Failures between services, on real NATS and Redis with the real torch engine: a job
executor dying while it holds a job, and a model whose checkpoint cannot load."""

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
from shared.embedded import free_port
from shared.settings import Settings
from shared.store import Store
from tests.integration.services import Running

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
