"""Frontend, job executor, cluster manager and scaler in one event loop on real NATS and
Redis, with no task executor at all: a job that cannot be placed in time gets 503 with
Retry-After, and the scaler was asked for an instance."""

import asyncio
import json
from datetime import timedelta
from pathlib import Path

import aiohttp
import pytest

from services.cluster_manager.service import ClusterManager
from services.frontend.service import Frontend
from services.job_executor.service import JobExecutor
from shared.bus import Bus
from shared.embedded import free_port
from shared.messages.scaling import TrafficReport
from shared.settings import Settings
from shared.store import Store
from shared.subjects import Subjects

pytestmark = [pytest.mark.nats, pytest.mark.redis]


@pytest.fixture
async def services(bus: Bus, store: Store, cluster: str, demo_model_dir: Path, tmp_path: Path):
    (tmp_path / "demo").symlink_to(demo_model_dir)
    settings = Settings(
        cluster=cluster,
        models_dir=tmp_path,
        http_port=free_port(),
        placement_timeout=timedelta(seconds=1.5),
        retry_after=timedelta(seconds=7),
        heartbeat_interval=timedelta(seconds=0.2),
    )
    svcs = [
        ClusterManager(settings=settings, bus=bus, store=store),
        JobExecutor(settings=settings, bus=bus),
        Frontend(settings=settings, bus=bus),
    ]
    tasks = [asyncio.create_task(s.run()) for s in svcs]
    base = f"http://127.0.0.1:{settings.frontend.http_port}"
    async with aiohttp.ClientSession() as http:
        for _ in range(100):
            try:
                async with http.get(base + "/health") as r:
                    body = await r.json()
                    if r.status == 200 and body["job_executors"] and body["models"]:
                        break
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
        yield http, base
    for s in reversed(svcs):
        await s.shutdown()
    await asyncio.gather(*tasks)


async def test_unplaceable_job_gets_503_with_retry_after(services, bus: Bus, cluster: str):
    http, base = services
    reports: list[TrafficReport] = []

    async def on_traffic(msg: TrafficReport) -> None:
        reports.append(msg)

    await bus.subscribe(Subjects(cluster).traffic(), {TrafficReport: on_traffic})
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for stream in (False, True):
        async with http.post(base + "/v1/chat/completions", json={**body, "stream": stream}) as r:
            assert r.status == 503
            assert r.headers["Retry-After"] == "7"
            err = json.loads(await r.read())["error"]
            assert "demo" in err["message"] and err["code"] == "no_capacity"
    # The scaler heard at once that jobs wait with no instance, and about every miss.
    assert reports and reports[0].urgent and reports[0].models[0].model == "demo"
    await asyncio.sleep(0.6)  # the next report
    assert sum(m.misses for r in reports for m in r.models if m.model == "demo") == 2


async def test_http_errors_are_openai_shaped(services):
    http, base = services
    async with http.get(base + "/v1/nothing") as r:
        assert r.status == 404 and (await r.json())["error"]["message"]
    async with http.post(base + "/v1/chat/completions", data=b"[1,2") as r:
        assert r.status == 400 and (await r.json())["error"]["type"] == "invalid_request_error"
    async with http.post(
        base + "/v1/completions", json={"model": "demo", "prompt": [1, 99999999]}
    ) as r:
        assert r.status == 400 and (await r.json())["error"]["param"] == "prompt"
