"""A fine-tuning job survives losing the TE that trains it (SIGKILLed: the stage is placed on
another idle TE and training resumes from the last epoch checkpoint) and losing the job
executor that runs it (another one takes the job's graph over, stops the stage the dead one
placed and resumes it). Either way the job ends ``succeeded`` with each epoch trained once
(no checkpoint repeated, none missing) and exactly one adapter registered."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import openai
import pytest

from services.cluster_manager.service import ClusterManager
from services.frontend.service import Frontend
from services.job_executor.service import JobExecutor
from shared.fine_tuning import FineTuneStore
from shared.messages.cluster import TEState
from shared.settings import Settings
from shared.store import Store
from shared.task_graphs import GraphStore
from tests.integration.services import BusClient, Running, fast_settings, te_process, wait_health
from tests.integration.test_fine_tuning import TRAIN, until_status

pytest.importorskip("peft")

pytestmark = [pytest.mark.nats, pytest.mark.redis, pytest.mark.slow]

EPOCHS = 24


async def _cluster(
    settings: Settings, nats_url: str, redis_url: str, stores: list[Store], jes: int
) -> tuple[Running, BusClient]:
    run = Running(settings, nats_url)
    await run.start(lambda bus: ClusterManager(settings=settings, bus=bus, store=stores[0]))
    await run.start(lambda bus: Frontend(settings=settings, bus=bus, store=stores[1]))
    for k in range(jes):
        store = stores[2 + k]
        await run.start(
            lambda bus, store=store: JobExecutor(settings=settings, bus=bus, store=store)
        )
    client: BusClient = await run.start(lambda bus: BusClient(settings, bus))
    await client.started.wait()
    return run, client


async def _job(settings: Settings) -> tuple[openai.AsyncOpenAI, str]:
    base = f"http://127.0.0.1:{settings.frontend.http_port}"
    await wait_health(base, lambda body: True)
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    train = await client.files.create(file=("train.jsonl", TRAIN), purpose="fine-tune")
    job = await client.fine_tuning.jobs.create(
        model="demo",
        training_file=train.id,
        hyperparameters={"n_epochs": EPOCHS, "batch_size": 4, "learning_rate_multiplier": 50},
    )
    return client, job.id


async def _until(ok: Callable[[], Awaitable[bool]], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not await ok():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)


async def _check_outcome(
    client: openai.AsyncOpenAI, job_id: str, store: Store, cluster: str
) -> None:
    done, seen = await until_status(client, job_id, {"succeeded", "failed", "cancelled"}, 300)
    assert done.status == "succeeded", (done.error, seen)
    checkpoints = (await client.fine_tuning.jobs.checkpoints.list(job_id, limit=100)).data
    epochs = sorted(int(c.fine_tuned_model_checkpoint.rsplit("-", 1)[1]) for c in checkpoints)
    assert epochs == list(range(1, EPOCHS + 1))  # each epoch once: resumed, not redone
    adapters = await FineTuneStore(store, cluster).adapters()
    assert [a.name for a in adapters] == [done.fine_tuned_model]


async def _checkpoints(store: Store, cluster: str, job_id: str) -> int:
    return len(await FineTuneStore(store, cluster).checkpoints(job_id))


def _settings(cluster: str, nats_url: str, redis_url: str, tmp_path: Path, demo: Path) -> Settings:
    (tmp_path / "demo").symlink_to(demo)
    return fast_settings(
        cluster,
        nats_url,
        redis_url,
        tmp_path,
        files_dir=str(tmp_path / "files"),
        fine_tuning_dir=str(tmp_path / "ft"),
        fine_tuning_scan_interval=0.5,
        pool_size=0,
    )


async def test_a_killed_training_te_resumes_from_its_checkpoint(
    cluster: str, nats_url: str, redis_url: str, tmp_path: Path, demo_model_dir: Path
) -> None:
    settings = _settings(cluster, nats_url, redis_url, tmp_path, demo_model_dir)
    stores = [await Store.connect(redis_url) for _ in range(4)]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    run, bus_client = await _cluster(settings, nats_url, redis_url, stores, jes=1)
    try:
        for te_id in ("te-a", "te-b"):
            procs[te_id] = te_process(settings, te_id)
        await bus_client.until(lambda v: len(v.tes) == 2, 60)
        client, job_id = await _job(settings)
        await _until(lambda: _has(stores[3], cluster, job_id, 2))
        training = [te.te_id for te in bus_client.view.view.tes if te.training]
        assert len(training) == 1
        os.kill(procs[training[0]].pid, signal.SIGKILL)
        await _check_outcome(client, job_id, stores[3], cluster)
        events = [e.message async for e in client.fine_tuning.jobs.list_events(job_id, limit=100)]
        assert any("interrupted" in m for m in events), events
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
        await run.stop()
        for s in stores:
            await s.close()


async def _has(store: Store, cluster: str, job_id: str, n: int) -> bool:
    return await _checkpoints(store, cluster, job_id) >= n


async def test_a_killed_job_executor_has_its_job_taken_over(
    cluster: str, nats_url: str, redis_url: str, tmp_path: Path, demo_model_dir: Path
) -> None:
    settings = _settings(cluster, nats_url, redis_url, tmp_path, demo_model_dir)
    stores = [await Store.connect(redis_url) for _ in range(5)]
    procs = [te_process(settings, "te-a")]
    run, bus_client = await _cluster(settings, nats_url, redis_url, stores, jes=2)
    try:
        await bus_client.until(lambda v: len(v.tes) == 1 and len(v.jes) == 2, 60)
        client, job_id = await _job(settings)
        await _until(lambda: _has(stores[4], cluster, job_id, 2))
        jes = [s for s, *_ in run.items if isinstance(s, JobExecutor)]
        owner = next(je for je in jes if je._fine_tuning._running)
        survivor = next(je for je in jes if je is not owner)
        await run.kill(owner)
        await _check_outcome(client, job_id, stores[4], cluster)
        assert survivor._fine_tuning.taken_over == 1
    finally:
        for p in procs:
            p.kill()
            p.wait()
        await run.stop()
        for s in stores:
            await s.close()


async def test_a_job_cancelled_while_its_job_executor_is_dead_is_cleaned_up(
    cluster: str, nats_url: str, redis_url: str, tmp_path: Path, demo_model_dir: Path
) -> None:
    """Nobody runs the cancelled job any more, yet its stage still trains on a TE: another
    job executor takes its graph over, stops the stage, closes the graph and settles the
    job; nothing is served."""
    settings = _settings(cluster, nats_url, redis_url, tmp_path, demo_model_dir)
    stores = [await Store.connect(redis_url) for _ in range(5)]
    procs = [te_process(settings, "te-a")]
    run, bus_client = await _cluster(settings, nats_url, redis_url, stores, jes=2)
    try:
        await bus_client.until(lambda v: len(v.tes) == 1 and len(v.jes) == 2, 60)
        client, job_id = await _job(settings)
        await _until(lambda: _has(stores[4], cluster, job_id, 1))
        jes = [s for s, *_ in run.items if isinstance(s, JobExecutor)]
        owner = next(je for je in jes if je._fine_tuning._running)
        survivor = next(je for je in jes if je is not owner)
        await run.kill(owner)
        assert (await client.fine_tuning.jobs.cancel(job_id)).status == "cancelled"
        jobs = FineTuneStore(stores[4], cluster)

        async def cleaned() -> bool:
            held = await GraphStore(stores[4], cluster, "test").get(job_id)
            return job_id not in await jobs.active() and held is not None and not held.open

        await _until(cleaned, 60)
        await bus_client.until(lambda v: v.tes[0].state == TEState.IDLE, 30)  # not training
        assert survivor._fine_tuning.taken_over == 1
        assert await jobs.adapters() == []
        assert (await client.fine_tuning.jobs.retrieve(job_id)).status == "cancelled"
    finally:
        for p in procs:
            p.kill()
            p.wait()
        await run.stop()
        for s in stores:
            await s.close()
