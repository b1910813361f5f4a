"""A node pool's TEs share its device one iteration at a time (``device_arbiter.py``): two
real TE processes of one pool (torch's default threads: each iteration fills the cores),
each serving the demo model, decode at once; their turns go
through the pool's arbiter (its ``/metrics`` counts them, and the waits of one TE for the
other), and greedy output is what each TE produces alone."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.cluster_manager.service import ClusterManager
from services.task_executor.pool import NodePool
from shared.embedded import free_port
from shared.errors import Refused
from shared.messages.api import SamplingParams
from shared.messages.cluster import TEState
from shared.messages.scaling import LoadModel
from shared.messages.tasks import ChatTask
from shared.store import Store
from tests.integration.services import BusClient, Running, fast_settings

pytestmark = [pytest.mark.nats, pytest.mark.redis, pytest.mark.slow]


async def _turns(port: int) -> dict[str, float]:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{port}/metrics") as r:
            text = await r.text()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("meshserve:device_") and s.labels.get("device") == "cpu":
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def _environ(pid: int) -> list[bytes]:
    return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


async def test_a_pools_tes_take_turns_on_its_device(
    cluster: str, nats_url: str, redis_url: str, tmp_path: Path, demo_model_dir: Path
) -> None:
    (tmp_path / "demo").symlink_to(demo_model_dir)
    port = free_port()
    settings = fast_settings(
        cluster, nats_url, redis_url, tmp_path, pool_size=2, device="cpu", torch_threads=0
    ).with_values(metrics={"port": port, "host": "127.0.0.1"})
    run = Running(settings, nats_url)
    store = await Store.connect(redis_url)
    try:
        quiet = settings.with_values(metrics={"port": 0})  # the pool serves the port
        await run.start(lambda bus: ClusterManager(settings=quiet, bus=bus, store=store))
        pool: NodePool = await run.start(
            lambda bus: NodePool(settings=settings, pool_id="pool-turns", bus=bus)
        )
        assert pool.arbiter is not None
        client: BusClient = await run.start(lambda bus: BusClient(settings, bus))
        await client.started.wait()
        await client.until(lambda v: len(v.tes) == 2, 60)
        # Taking turns, their OpenMP threads stop spinning soon after an iteration.
        if not {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & os.environ.keys():
            for proc in pool._procs.values():
                assert b"GOMP_SPINCOUNT=10000" in _environ(proc.pid)
        # Idle, they say what they run on (the scaler places on CPUs before GPUs by it).
        assert [t.device for t in client.view.view.tes] == ["cpu", "cpu"]
        tes = await client.load_everywhere(tmp_path / "demo")
        prompts = [[(7 * i + k) % 400 + 30 for i in range(40 + 20 * k)] for k in range(4)]
        alone = [(await client.run_on(tes[0], p, 24))[0] for p in prompts]
        before = await _turns(port)
        together = await asyncio.gather(
            *(client.run_on(tes[k % 2], p, 24) for k, p in enumerate(prompts))
        )
        assert [tokens for tokens, _ in together] == alone
        after = await _turns(port)
        turns = after["meshserve:device_turns_total"] - before.get(
            "meshserve:device_turns_total", 0
        )
        assert turns >= 24  # at least one turn per token of the longest request
        waited = after["meshserve:device_turn_wait_seconds_sum"] - before.get(
            "meshserve:device_turn_wait_seconds_sum", 0
        )
        assert waited > 0  # one TE waited while the other's iteration ran
    finally:
        await run.stop()
        await store.close()


async def test_a_te_refuses_a_task_its_device_cannot_serve_in_time(
    cluster: str, nats_url: str, redis_url: str, tmp_path: Path, demo_model_dir: Path
) -> None:
    """Shadow validation on (``MESHSERVE_SHADOW_ADMISSION``): a task the device's next
    iterations serve in time is taken; one whose request arrived most of a TTFT ago (its age)
    and would wait behind the instance's one running request (one slot) past its deadline is
    refused, so that its job executor tries another instance (the job executor's answer
    when every instance refused: ``tests/unit/test_loadgen_simulator_sharing.py`` and the
    admission tests). A request late even alone on its instance (one that waited out a cold
    start) is served on an idle instance, and refused behind the long one."""
    (tmp_path / "demo").symlink_to(demo_model_dir)
    (tmp_path / "other").symlink_to(demo_model_dir)
    port = free_port()
    settings = fast_settings(
        cluster,
        nats_url,
        redis_url,
        tmp_path,
        pool_size=2,
        device="cpu",
        torch_threads=0,
        shadow_admission=True,
        max_num_seqs=1,
        slo_ttft=1.0,
        slo_ttft_per_token=0.0,
    ).with_values(metrics={"port": port, "host": "127.0.0.1"})
    run = Running(settings, nats_url)
    store = await Store.connect(redis_url)
    try:
        quiet = settings.with_values(metrics={"port": 0})
        await run.start(lambda bus: ClusterManager(settings=quiet, bus=bus, store=store))
        await run.start(lambda bus: NodePool(settings=settings, pool_id="pool-shadow", bus=bus))
        client: BusClient = await run.start(lambda bus: BusClient(settings, bus))
        await client.started.wait()
        await client.until(lambda v: len(v.tes) == 2, 60)
        te_id, other = (t.te_id for t in client.view.view.tes)
        for te, model in ((te_id, "demo"), (other, "other")):
            ack = await client.tes.control(te, LoadModel(model=model, path=str(tmp_path / "demo")))
            assert ack.ok, ack
        # Each TE serves a model of its own on the one shared device.
        await client.until(lambda v: all(t.state == TEState.READY for t in v.tes), 60)
        prompt = [(5 * i) % 400 + 30 for i in range(64)]
        tokens, _ = await client.run_on(te_id, prompt, 8)  # fresh, on an idle device: admitted
        assert len(tokens) == 8

        def task(request_id: str, age_s: float, reply_to: str, tokens: int = 8) -> ChatTask:
            return ChatTask(
                request_id=request_id,
                model="demo",
                prompt_token_ids=prompt,
                sampling=SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True),
                reply_to=reply_to,
                deadline=time.time() + 20,
                age_s=age_s,
            )

        # Late alone (it arrived a TTFT ago): nothing else would do better, it is served.
        async with client.inbox() as (subject, queue):
            await client.tes.place(te_id, task("late-anyway", 1.0, subject))
            assert len((await client._collect(queue))[0]) == 8
        # The instance's one slot taken by a long generation (its first token seen: it is
        # in the engine, and the arbiter has its request): a request with 0.4 s of its TTFT
        # left would wait for it, and is refused; so is one already past its deadline, which
        # may wait its turn but not behind a queue (a TTFT from the soonest it could start).
        async with client.inbox() as (busy_to, busy_chunks):
            await client.tes.place(te_id, task("busy", 0.0, busy_to, 6000))
            first = await asyncio.wait_for(busy_chunks.get(), 30)
            for name, age in (("almost-late", 0.6), ("already-late", 1.5)):
                async with client.inbox() as (subject, _):
                    with pytest.raises(Refused, match=r"too busy.*TTFT"):
                        await client.tes.place(te_id, task(name, age, subject))
            rest, _ = await client._collect(busy_chunks)
        assert len(first.token_ids) + len(rest) == 6000  # the refusals came while it ran
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/metrics") as r:
                text = await r.text()
        checks = {
            s.labels["outcome"]: s.value
            for f in text_string_to_metric_families(text)
            if f.name == "meshserve:device_admission_checks"
            for s in f.samples
            if s.name.endswith("_total")
        }
        assert checks["admitted"] >= 2 and checks["late"] == 2
    finally:
        await run.stop()
        await store.close()
