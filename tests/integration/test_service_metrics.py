"""The services without an HTTP API serve ``/metrics`` on ``MESHSERVE_METRICS_PORT``: the job
executor and the cluster manager (this process's registry: what Prometheus' parser reads),
and a node pool, whose ``/metrics`` reports its TEs in vLLM's engine families from the
cluster view: a real TE process it started, idle, then serving the demo model."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.cluster_manager.service import ClusterManager
from services.job_executor.service import JobExecutor
from services.task_executor.pool import NodePool
from services.task_executor.pool_metrics import SPECS
from shared.embedded import free_port
from shared.messages.cluster import TEState
from shared.messages.scaling import LoadModel
from shared.store import Store
from tests.integration.services import BusClient, Running, fast_settings

pytestmark = [pytest.mark.nats, pytest.mark.redis, pytest.mark.slow]


async def _scrape(port: int) -> dict[str, list]:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{port}/metrics") as r:
            assert r.status == 200 and r.content_type == "text/plain"
            text = await r.text()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


async def test_every_service_without_an_api_serves_metrics(
    cluster: str, nats_url: str, redis_url: str, tmp_path: Path, demo_model_dir: Path
) -> None:
    (tmp_path / "demo").symlink_to(demo_model_dir)
    settings = fast_settings(cluster, nats_url, redis_url, tmp_path, pool_size=1)
    ports = {name: free_port() for name in ("cm", "je", "pool")}

    def own(name: str):  # type: ignore[no-untyped-def]
        return settings.with_values(metrics={"port": ports[name], "host": "127.0.0.1"})

    run = Running(settings, nats_url)
    store = await Store.connect(redis_url)
    try:
        await run.start(lambda bus: ClusterManager(settings=own("cm"), bus=bus, store=store))
        await run.start(lambda bus: JobExecutor(settings=own("je"), bus=bus))
        pool: NodePool = await run.start(
            lambda bus: NodePool(settings=own("pool"), pool_id="pool-m", bus=bus)
        )
        client: BusClient = await run.start(lambda bus: BusClient(settings, bus))
        await client.started.wait()
        await client.until(lambda v: len(v.tes) == 1, 60)
        cm, je = await _scrape(ports["cm"]), await _scrape(ports["je"])
        members = {s.labels["kind"]: s.value for s in cm["meshserve:cluster_members"]}
        assert members["task_executor"] == 1 and members["job_executor"] == 1
        assert "meshserve:registered_models" in cm
        assert {"meshserve:jobs", "meshserve:jobs_in_flight"} <= set(je)

        families = await _scrape(ports["pool"])
        assert {name for _, name, _, _ in SPECS.values()} <= set(families)
        states = {s.labels["state"]: s.value for s in families["meshserve:task_executors"]}
        assert states["idle"] == 1 and sum(states.values()) == 1

        te_id = client.view.view.tes[0].te_id
        ack = await client.tes.control(te_id, LoadModel(model="demo", path=str(tmp_path / "demo")))
        assert ack.ok, ack
        await client.until(lambda v: v.tes and v.tes[0].state == TEState.READY, 60)
        deadline = time.monotonic() + 10
        while True:  # the pool's own view catches up
            families = await _scrape(ports["pool"])
            running = families["meshserve:num_requests_running"]
            if running:
                break
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        assert running[0].labels == {"model_name": "demo", "engine": "torch", "te": te_id}
        kv = families["meshserve:kv_cache_usage_perc"][0]
        assert 0 <= kv.value < 1
        assert pool.metrics.port == ports["pool"]
    finally:
        await run.stop()
        await store.close()
