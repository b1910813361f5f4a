"""A TE's KV pool sized by demand (``MESHSERVE_KV_SIZING``, LLM-Mesh): a real TE process with
the torch engine on CPU, its pool shrinking once idle a while (to 1.25 times one request of
the model's whole context) and growing at once for a burst of long requests, as its
heartbeats report it; greedy output the same at every size. Two TEs of one pool under a
device KV budget (``MESHSERVE_DEVICE_KV_BYTES``): one grows only after the other shrank to
make room, a load waits for room for its pool's floor the same way, and together they never
hold more than the budget."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from services.cluster_manager.service import ClusterManager
from services.task_executor.device_arbiter import KV_SQUEEZES
from services.task_executor.engines.factory import kv_floor_bytes
from services.task_executor.engines.torch_engine.config import load_model_config
from services.task_executor.engines.torch_engine.kv_cache import PagedKVCache
from services.task_executor.pool import NodePool
from services.views import te_view
from shared.messages.cluster import ClusterView, TEHeartbeat, TEState
from shared.messages.scaling import LoadModel, UnloadModel
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
        (te_id,) = await client.load_everywhere(tmp_path / "demo")
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


async def test_a_grow_waits_for_the_shrink_that_makes_its_room(
    cluster: str, nats_url: str, redis_url: str, tmp_path: Path, demo_model_dir: Path
) -> None:
    """Two TEs of one pool (they take turns on the CPU, so the pool serves an arbiter) under a
    KV budget of both floors plus one burst. A burst on the first grows its pool; a burst on
    the second then waits for room until the first, told to, shrank back to its floor (its
    own lazy shrink is a minute away). The arbiter's books never exceed the budget, and
    every request's tokens are what they were alone."""
    (tmp_path / "demo").symlink_to(demo_model_dir)
    cfg = load_model_config(demo_model_dir)
    block_bytes = PagedKVCache.bytes_per_block(
        num_layers=cfg.num_layers,
        block_size=16,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=torch.float32,
    )
    floor = -(-int(cfg.max_position_embeddings * 1.25) // 16)  # blocks: 1.25 contexts
    # 24 requests of 48 + 400 tokens: 10,752 tokens x 1.25 = 840 blocks of 16.
    burst_blocks = 840
    budget = (floor + burst_blocks + 20) * block_bytes
    settings = fast_settings(
        cluster,
        nats_url,
        redis_url,
        tmp_path,
        pool_size=2,
        device="cpu",
        dtype="float32",
        torch_threads=0,
        kv_sizing=True,
        kv_shrink_after=timedelta(seconds=60),
        kv_cache_bytes=64 * 1024**2,
        device_kv_bytes=budget,
    )
    run = Running(settings, nats_url)
    store = await Store.connect(redis_url)
    try:
        await run.start(lambda bus: ClusterManager(settings=settings, bus=bus, store=store))
        pool: NodePool = await run.start(
            lambda bus: NodePool(settings=settings, pool_id="pool-kv-room", bus=bus)
        )
        assert pool.arbiter is not None and pool.arbiter.kv_budget_bytes == budget
        client: BusClient = await run.start(lambda bus: BusClient(settings, bus))
        await client.started.wait()
        await client.until(lambda v: len(v.tes) == 2, 60)
        tes = await client.load_everywhere(tmp_path / "demo")
        prompt = [(7 * i) % 400 + 30 for i in range(48)]
        alone = [(await client.run_on(te_id, prompt, 400))[0] for te_id in tes]
        assert alone[0] == alone[1]

        def books() -> dict[str, int]:
            device = pool.arbiter._devices.get("cpu") if pool.arbiter else None
            clients = device.clients.values() if device else ()
            return {c.name: (c.holds + c.reserved) // block_bytes for c in clients}

        # Each pool, as it first sizes itself, says what it holds and shrinks to its floor.
        for _ in range(200):
            if len(held := books()) == 2 and all(b <= floor + 1 for b in held.values()):
                break
            await asyncio.sleep(0.05)
        assert len(held) == 2 and all(b <= floor + 1 for b in held.values()), held
        # Each TE reports, beside its pool's free blocks, what the pool could still grow into
        # (the budget less both pools): a router sees the room a pool at its floor can take.
        left = budget // block_bytes - sum(held.values())

        def room_reported(view: ClusterView) -> bool:
            mine = [te_view(t) for t in view.tes if t.te_id in tes]
            free = [t.kv_free_tokens for t in mine]
            # and, for the scaler's placement of a load, the books' free memory and the floor
            books = [(t.device_kv_free_bytes, t.kv_floor_bytes) for t in mine]
            return (
                len(free) == 2
                and all(
                    f is not None and floor + left - 4 <= f // 16 <= floor + 1 + left for f in free
                )
                and all(
                    d is not None
                    and left - 4 <= d // block_bytes <= left
                    and k == floor * block_bytes
                    for d, k in books
                )
            )

        await client.until(room_reported, 10)
        squeezes = KV_SQUEEZES.labels("cpu")._value.get()
        peak: dict[str, int] = {}
        most = 0
        watching = True

        async def watch() -> None:
            nonlocal most
            while watching:
                held = books()
                most = max(most, sum(held.values()))
                for name, b in held.items():
                    peak[name] = max(peak.get(name, 0), b)
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        first = await asyncio.gather(*(client.run_on(tes[0], prompt, 400) for _ in range(24)))
        grown_first = dict(peak)
        started = time.monotonic()
        second = await asyncio.gather(*(client.run_on(tes[1], prompt, 400) for _ in range(24)))
        watching = False
        await watcher
        assert max(grown_first.values()) > floor + 1, (floor, grown_first)  # the first grew
        assert max(peak.values()) > floor + 1 and len(peak) == 2
        assert min(peak.values()) > floor + 1, peak  # and the second grew too, later
        assert most * block_bytes <= budget, (most, budget // block_bytes)
        assert KV_SQUEEZES.labels("cpu")._value.get() > squeezes  # the first was told
        assert time.monotonic() - started < 60  # not for the lazy shrink
        assert all(tokens == alone[0] for tokens, _ in [*first, *second])

        # An unload gives the TE's KV back to the device's books at once (not when the TE
        # next looks at its pool, seconds later); a load enters them at its floor as soon as
        # it is ready (before any request), never at the size its engine allocated. Meanwhile
        # a larger burst grows the second TE's pool past what leaves room for that floor
        # (its lazy shrink is a minute away), so the load first waits for room: the second
        # is told to shrink, and the books stay within the budget throughout.
        assert kv_floor_bytes("demo", tmp_path / "demo", settings) == floor * block_bytes
        ack = await client.tes.control(tes[0], UnloadModel(reason="test"))
        assert ack.ok, ack
        unloaded = time.monotonic()
        while books().get(tes[0]) != 0:
            assert time.monotonic() - unloaded < 3, books()
            await asyncio.sleep(0.02)

        def idle_reports_room(view: ClusterView) -> bool:  # an idle TE too, for a load
            t = next(te_view(t) for t in view.tes if t.te_id == tes[0])
            free = t.device_kv_free_bytes
            return t.state == TEState.IDLE and free is not None and free >= floor * block_bytes

        await client.until(idle_reports_room, 10)
        third = await asyncio.gather(*(client.run_on(tes[1], prompt, 400) for _ in range(32)))
        assert all(tokens == alone[0] for tokens, _ in third)
        assert books()[tes[1]] * block_bytes > budget - floor * block_bytes, books()
        unloaded = time.monotonic()
        seen: list[int] = []
        totals: list[int] = []
        squeezes = KV_SQUEEZES.labels("cpu")._value.get()
        watching = True

        async def watch_load() -> None:
            while watching:
                held = books()
                seen.append(held.get(tes[0], 0))
                totals.append(sum(held.values()))
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch_load())
        ack = await client.tes.control(tes[0], LoadModel(model="demo", path=str(tmp_path / "demo")))
        assert ack.ok, ack
        await client.until(lambda v: all(t.state == TEState.READY for t in v.tes), 60)
        ready = time.monotonic()
        while books().get(tes[0], 0) == 0:
            assert time.monotonic() - ready < 3, books()
            await asyncio.sleep(0.02)
        watching = False
        await watcher
        assert max(seen) <= floor + 1 and 0 < books()[tes[0]] <= floor + 1, (max(seen), books())
        assert max(totals) * block_bytes <= budget, (max(totals), budget // block_bytes)
        assert KV_SQUEEZES.labels("cpu")._value.get() > squeezes  # the second was told
        assert books()[tes[1]] <= floor + 1, books()  # and shrank: the room the load took
        assert time.monotonic() - unloaded < 45  # within the load's wait, not the lazy shrink
        assert (await client.run_on(tes[0], prompt, 400))[0] == alone[0]
    finally:
        await run.stop()
        await store.close()
