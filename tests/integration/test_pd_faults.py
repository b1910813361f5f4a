"""PD disaggregation under faults, on a real cluster with task executors as real processes
(SIGKILL) and the official ``openai`` client: a prefill TE killed mid-prefill, a decode TE
killed mid-transfer and a job executor killed between the prefill and decode placements each
lose no request, and each answer equals the colocated run's; the prefill TE's KV is freed
once the transfer that held it ends (the decode TE's dropped connection, or its lease). The
killed job executor's task graph survives it in Redis: the job executor the frontend places
the request with again continues it, its decode task pulling the prefill the dead one placed
(the prompt is computed once)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client import REGISTRY

from services.job_executor.service import JobExecutor
from shared.messages.cluster import ClusterView, TEHeartbeat, TEState
from shared.messages.scaling import LoadModel
from shared.messages.tasks import TaskMode
from shared.settings import Settings
from shared.store import Store
from shared.task_graphs import GraphStore
from tests.integration.services import (
    BusClient,
    Running,
    control_plane,
    fast_settings,
    te_process,
)

pytestmark = [pytest.mark.nats, pytest.mark.redis, pytest.mark.slow]

MAX_TOKENS = 24


def _prompt(i: int) -> str:
    """A long prompt (about 2,000 tokens): its prefill runs long enough to be cut."""
    words = [f"w{(7 * k + 13 * i) % 997}" for k in range(900)]
    return f"Request {i}. " + " ".join(words)


async def _chat(client: openai.AsyncOpenAI, i: int) -> str:
    r = await client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": _prompt(i)}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
        timeout=90,
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == MAX_TOKENS
    return r.choices[0].message.content or ""


def _te(view: ClusterView, te_id: str) -> TEHeartbeat | None:
    return next((t for t in view.tes if t.te_id == te_id), None)


def _busy(hb: TEHeartbeat | None) -> bool:
    return hb is not None and any(s.sequences for s in hb.shares.values())


def _kv_free(view: ClusterView, te_id: str) -> bool:
    hb = _te(view, te_id)
    return hb is not None and hb.total_kv_blocks > 0 and hb.free_kv_blocks == hb.total_kv_blocks


async def test_pd_faults_lose_no_request(
    cluster: str, nats_url: str, redis_url: str, tmp_path: Path, demo_model_dir: Path
) -> None:
    (tmp_path / "demo").symlink_to(demo_model_dir)
    settings = fast_settings(
        cluster,
        nats_url,
        redis_url,
        tmp_path,
        pd="always",
        # Past the liveness timeout: a prefill whose job executor died is still there when
        # the job executor that takes its graph over places the decode task.
        pd_lease=timedelta(seconds=4),
        pd_transfer_timeout=timedelta(seconds=30),
        max_prefill_tokens=8,  # a long prompt's prefill takes a while: time to cut it
    )
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        async with control_plane(settings, nats_url, redis_url, je_store=True) as run:
            await _scenario(run, settings, procs, redis_url)
    finally:
        for proc in procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()


async def _scenario(
    run: Running, settings: Settings, procs: dict[str, Any], redis_url: str
) -> None:
    bus_client: BusClient = await run.start(lambda bus: BusClient(settings, bus))
    await bus_client.started.wait()
    path = str(settings.models_dir / "demo")

    async def start(te_id: str, role: TaskMode) -> None:
        procs[te_id] = te_process(settings, te_id)
        await bus_client.until(lambda v: _te(v, te_id) is not None)
        ack = await bus_client.tes.control(te_id, LoadModel(model="demo", path=path, role=role))
        assert ack.ok, ack
        await bus_client.until(
            lambda v: (hb := _te(v, te_id)) is not None and hb.state == TEState.READY, 60
        )

    async def until(ok: Callable[[ClusterView], bool], timeout: float = 30) -> None:
        await bus_client.until(ok, timeout)

    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{settings.frontend.http_port}/v1", api_key="none"
    )
    # The colocated answers, from an instance that is gone before the test's own start (the
    # decode TEs must not hold these prompts already).
    await start("te-ref", TaskMode.COLOCATED)
    expected = [await _chat(client, i) for i in range(3)]
    procs["te-ref"].kill()
    await until(lambda v: _te(v, "te-ref") is None)
    for te_id in ("te-d1", "te-d2"):
        await start(te_id, TaskMode.DECODE)
    await start("te-p1", TaskMode.PREFILL)

    # 1. The prefill TE dies mid-prefill: the decode TE's pull fails, it prefills itself.
    job = asyncio.create_task(_chat(client, 0))
    await until(lambda v: _busy(_te(v, "te-p1")))
    os.kill(procs["te-p1"].pid, signal.SIGKILL)
    assert await asyncio.wait_for(job, 120) == expected[0]

    # 2. A decode TE dies while it waits for the KV: the request moves to the other decode
    # TE (a new prefill); the dead one's transfer ends with its connection, freeing the KV.
    await start("te-p2", TaskMode.PREFILL)
    job = asyncio.create_task(_chat(client, 1))
    await until(
        lambda v: _busy(_te(v, "te-p2")) and any(_busy(_te(v, d)) for d in ("te-d1", "te-d2"))
    )
    view = bus_client.view.view
    victim = next(d for d in ("te-d1", "te-d2") if _busy(_te(view, d)))
    os.kill(procs[victim].pid, signal.SIGKILL)
    assert await asyncio.wait_for(job, 120) == expected[1]
    await until(lambda v: _kv_free(v, "te-p2"), 10)
    # The dead decode TE's lease ended with its connection, and /metrics says so.
    await until(lambda v: bool((hb := _te(v, "te-p2")) and hb.kv_lease_ends))
    await asyncio.sleep(0.5)  # the frontend's view of it
    assert _sample("meshserve_kv_lease_ends_total", reason="disconnected") >= 1

    # 3. A job executor dies between placing the prefill and the decode task: the frontend
    # places the request again with the other one, which takes the dead one's task graph
    # over and continues it: its decode task pulls the prefill already placed.
    jes = [svc for svc, *_ in run.items if isinstance(svc, JobExecutor)]
    store = await Store.connect(redis_url)
    jes.append(await run.start(lambda bus: JobExecutor(settings=settings, bus=bus, store=store)))
    await until(lambda v: len(v.jes) == 2)
    placed = asyncio.Event()
    original = JobExecutor._offer

    async def hang_before_decode(self: JobExecutor, te_id: str, task: Any, *a: Any) -> Any:
        if task.mode == TaskMode.DECODE and not placed.is_set():
            placed.set()
            await asyncio.sleep(3600)  # dies here: its prefill placed, the decode task not
        return await original(self, te_id, task, *a)

    JobExecutor._offer = hang_before_decode  # type: ignore[method-assign]
    try:
        job = asyncio.create_task(_chat(client, 2))
        await asyncio.wait_for(placed.wait(), 30)
        holder = next(je for je in jes if je._inflight)
        survivor = next(je for je in jes if je is not holder)
        fallbacks = _sample("meshserve_pd_fallbacks_total")
        t0 = time.monotonic()
        await run.kill(holder)
        assert await asyncio.wait_for(job, 120) == expected[2]
        await until(lambda v: _kv_free(v, "te-p2"), 10)
        assert time.monotonic() - t0 < 30
    finally:
        JobExecutor._offer = original  # type: ignore[method-assign]
    assert survivor._keeper.taken_over == 1
    assert _sample("meshserve_pd_fallbacks_total") == fallbacks  # the KV came, as placed
    graphs = GraphStore(store, settings.cluster, survivor.je_id)
    kept = [
        held
        async for key in store.redis.scan_iter(match=f"{settings.cluster}:graph:*")
        if (held := await graphs.get(key.decode().rsplit(":", 1)[1])) is not None
        and held.graph.task("decode").attempt > held.graph.task("prefill").attempt
    ]
    assert len(kept) == 1, kept
    held = kept[0]
    assert (held.owner, held.epoch, held.open) == (survivor.je_id, 2, False)
    prefill, decode = held.graph.task("prefill"), held.graph.task("decode")
    assert (prefill.state, prefill.te_id, prefill.attempt) == ("placed", "te-p2", 0)
    assert decode.state == "placed"  # by the survivor, for a later attempt


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"model": "demo", **labels}) or 0.0
