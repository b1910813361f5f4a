"""KV-aware routing on a real cluster (NATS, Redis, torch engines): two job executors and
three TEs of one model. A prompt sharing a long prefix with an earlier one lands on the TE
that holds it, whichever job executor places it (one that started after the prefix was
cached included); with that TE overloaded it does not; a job executor restarted after Redis
lost the index still routes correctly (the TEs rewrite their entries)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import timedelta
from pathlib import Path

import pytest

from services.job_executor.service import JobExecutor
from services.task_executor.worker import TaskExecutor
from shared.embedded import free_port
from shared.kv_index_store import KvIndexStore
from shared.messages.cluster import TEState
from shared.messages.scaling import LoadModel
from shared.settings import Settings
from shared.store import Store
from shared.subjects import Keys
from tests.integration.services import BusClient, Running, control_plane

pytestmark = [pytest.mark.nats, pytest.mark.redis, pytest.mark.slow]

TES = ("te-1", "te-2", "te-3")
BLOCK = 16  # the torch engine's block size
PREFIX = [(7 * i + 3) % 500 + 20 for i in range(40 * BLOCK)]  # 40 blocks shared


async def test_prefix_routing_across_job_executors_restarts_and_load(
    cluster: str, nats_url: str, redis_url: str, tmp_path: Path, demo_model_dir: Path
) -> None:
    (tmp_path / "demo").symlink_to(demo_model_dir)
    settings = Settings(
        cluster=cluster,
        nats_url=nats_url,
        redis_url=redis_url,
        models_dir=tmp_path,
        http_port=free_port(),
        heartbeat_interval=timedelta(seconds=0.2),
        shutdown_grace=timedelta(seconds=1),
        routing_balance_tokens=256,
        torch_threads=1,
    )
    stores: list[Store] = []

    async def store() -> Store:
        stores.append(await Store.connect(redis_url))
        return stores[-1]

    try:
        async with control_plane(settings, nats_url, redis_url) as run:
            await _scenario(run, settings, store, stores)
    finally:
        for s in stores:
            with contextlib.suppress(Exception):
                await s.close()


async def _scenario(run: Running, settings: Settings, store, stores: list[Store]) -> None:  # type: ignore[no-untyped-def]
    # The control plane's own JE has no Redis copy: it is the one killed first.
    client: BusClient = await run.start(lambda bus: BusClient(settings, bus))
    await client.started.wait()
    for te_id in TES:
        te_store = await store()
        await run.start(
            lambda bus, te_id=te_id, s=te_store: TaskExecutor(
                settings=settings, bus=bus, te_id=te_id, pool_id="p", store=s
            )
        )
    await client.until(lambda v: {t.te_id for t in v.tes} >= set(TES))
    path = str(settings.models_dir / "demo")
    for te_id in TES:
        assert (await client.tes.control(te_id, LoadModel(model="demo", path=path))).ok
    await client.until(
        lambda v: sum(t.state == TEState.READY and t.model == "demo" for t in v.tes) == 3
    )

    # The first JE sees the prefix cached on one TE.
    first, _ = await client.complete([*PREFIX, 1, 2, 3])
    holder = first.te_id
    await asyncio.sleep(0.3)  # its KV events reach the index

    # Another JE, started after that, alone: it loads the index from Redis.
    je1 = next(svc for svc, *_ in run.items if isinstance(svc, JobExecutor))
    await run.kill(je1)
    je3_store = await store()
    je3 = await run.start(lambda bus: JobExecutor(settings=settings, bus=bus, store=je3_store))
    await asyncio.sleep(0.5)  # loaded on its first view
    for i in range(3):
        got, cached = await client.complete([*PREFIX, 4, 5, 6 + i])
        assert got.je_id == je3.je_id
        assert got.te_id == holder, (got, holder)
        assert got.routing == "locality"
        assert got.matched_tokens == len(PREFIX)
        assert cached >= len(PREFIX)  # the engine did hold it

    # Overloaded with other work (32 decoding, 16 prompts queued: far more than the prefix
    # and the allowance are worth), the holder no longer gets the prefix.
    busy = await client.busy(holder, 48)
    await client.until(
        lambda v: any(
            t.te_id == holder and t.running + t.waiting >= 40 and t.queued_prompt_tokens
            for t in v.tes
        )
    )
    elsewhere, _ = await client.complete([*PREFIX, 7, 8, 9])
    assert elsewhere.te_id != holder
    assert elsewhere.routing == "load"
    for rid in busy:
        await client.tes.cancel(holder, rid, 0)
    await client.until(
        lambda v: any(t.te_id == holder and t.running + t.waiting == 0 for t in v.tes)
    )

    # Redis loses the index (as a restart would): the TEs write theirs again, and a job
    # executor that starts now routes by it.
    redis = stores[0].redis
    keys = [k async for k in redis.scan_iter(match=f"{Keys(settings.cluster).cluster}:kvidx:*")]
    assert keys
    await redis.delete(*keys)
    kv = KvIndexStore(stores[0], settings.cluster)
    deadline = time.monotonic() + 10
    while holder not in await kv.tes("demo"):  # within the TEs' check period
        assert time.monotonic() < deadline
        await asyncio.sleep(0.2)
    await run.kill(je3)
    je4_store = await store()
    je4 = await run.start(lambda bus: JobExecutor(settings=settings, bus=bus, store=je4_store))
    await asyncio.sleep(0.5)
    got, _ = await client.complete([*PREFIX, 10, 11, 12])
    assert got.je_id == je4.je_id
    # Both TEs that computed the prefix hold it now; either is right, a third is not.
    assert got.te_id in {holder, elsewhere.te_id}
    assert (got.routing, got.matched_tokens) == ("locality", len(PREFIX))
