"""A TE's KV pool sized by demand (``MESHSERVE_KV_SIZING``, LLM-Mesh): a real TE process with
the torch engine on CPU, its pool shrinking once idle a while (to 1.25 times one request of
the model's whole context) and growing at once for a burst of long requests, as its
heartbeats report it; greedy output the same at every size."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

import pytest

from services.cluster_manager.service import ClusterManager
from services.task_executor.pool import NodePool
from shared.messages.cluster import TEHeartbeat, TEState
from shared.messages.scaling import LoadModel
from shared.store import Store
from tests.integration.services import BusClient, Running, fast_settings

pytestmark = [pytest.mark.nats, pytest.mark.redis, pytest.mark.slow]


async def test_a_tes_kv_pool_follows_its_demand(
    cluster: str, nats_url: str, redis_url: str, tmp_path: Path, demo_model_dir: Path
) -> None:
    (tmp_path / "demo").symlink_to(demo_model_dir)
    settings = fast_settings(
        cluster,
        nats_url,
        redis_url,
        tmp_path,
        pool_size=1,
        device="cpu",
        kv_sizing=True,
        kv_shrink_after=timedelta(seconds=1),
        kv_cache_bytes=64 * 1024**2,
    )
    run = Running(settings, nats_url)
    store = await Store.connect(redis_url)
    sizes: list[tuple[int, int]] = []  # (total, free) blocks, heartbeat by heartbeat
    heard = asyncio.Event()

    async def on_heartbeat(hb: TEHeartbeat) -> None:
        if hb.model is not None and hb.total_kv_blocks:
            sizes.append((hb.total_kv_blocks, hb.free_kv_blocks))
            heard.set()

    try:
        await run.start(lambda bus: ClusterManager(settings=settings, bus=bus, store=store))
        await run.start(lambda bus: NodePool(settings=settings, pool_id="pool-kv", bus=bus))
        client: BusClient = await run.start(lambda bus: BusClient(settings, bus))
        await client.started.wait()
        sub = await client.bus.subscribe(client.subjects.heartbeat(), {TEHeartbeat: on_heartbeat})
        await client.until(lambda v: len(v.tes) == 1, 60)
        te_id = client.view.view.tes[0].te_id
        ack = await client.tes.control(te_id, LoadModel(model="demo", path=str(tmp_path / "demo")))
        assert ack.ok, ack
        await client.until(lambda v: all(t.state == TEState.READY for t in v.tes), 60)
        prompt = [(7 * i) % 400 + 30 for i in range(48)]
        first, _ = await client.run_on(te_id, prompt, 16)
        await asyncio.wait_for(heard.wait(), 10)
        full = sizes[0][0]  # what 64 MiB holds: 32k tokens or more
        # Idle a second and more: shrunk to its floor (8k tokens of context, × 1.25).
        for _ in range(100):
            if sizes[-1][0] < full // 2:
                break
            await asyncio.sleep(0.1)
        small = sizes[-1][0]
        assert small < full // 2, (full, sizes[-5:])
        # A burst of long generations (12 × 1,048 tokens asked for): grown at once past the
        # floor, and each request's first tokens are what they were.
        mark = len(sizes)
        outs = await asyncio.gather(*(client.run_on(te_id, prompt, 1000) for _ in range(12)))
        grown = [total for total, _ in sizes[mark:]]
        assert max(grown) > small, (small, grown)
        assert all(len(tokens) == 1000 and tokens[:16] == first for tokens, _ in outs)
        await sub.close()
    finally:
        await run.stop()
        await store.close()
