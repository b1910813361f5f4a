"""A disaggregated job whose job executor stalls between its prefill and decode placements
(alive, but silent past the liveness timeout): the frontend places the request again, a job
executor takes the task graph over and continues it from the stalled one's prefill (the KV
arrives: no fallback), and the answer equals the colocated run's. When the stalled one wakes
and places its decode task, its write is refused by the fencing number, and it cancels that
task: nothing of it runs on. A continued graph whose decode task is refused has the dead
job executor's prefill cancelled under the attempt it was placed for."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import openai
import pytest

from services.job_executor.disaggregation import PdDecision
from services.job_executor.placement import Request
from services.job_executor.planner import plan_chat, with_task
from services.job_executor.service import JobExecutor
from services.task_executor.worker import TaskExecutor
from shared.messages.api import SamplingParams
from shared.messages.cluster import TEState
from shared.messages.jobs import ChatJob
from shared.messages.scaling import LoadModel
from shared.messages.tasks import KvSource, TaskMode
from shared.store import Store
from shared.task_graphs import GraphStore, TaskState, prompt_digest
from tests.integration.services import BusClient, control_plane, fast_settings

pytestmark = [pytest.mark.nats, pytest.mark.redis, pytest.mark.slow]

PROMPT = "Tell me the story again. " + " ".join(f"w{(7 * k) % 311}" for k in range(200))


async def _chat(client: openai.AsyncOpenAI) -> tuple[str, str]:
    r = await client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
        timeout=60,
    )
    return r.id, r.choices[0].message.content or ""


def _idle(te: TaskExecutor) -> bool:
    engine = te.engine
    assert engine is not None
    st = engine.stats()
    return st.free_kv_blocks == st.total_kv_blocks and not te.tasks.kv_offers()


async def _until(ok, timeout: float = 15) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


async def test_a_stalled_jes_graph_is_taken_over_and_its_late_placement_undone(
    cluster: str, nats_url: str, redis_url: str, tmp_path: Path, demo_model_dir: Path
) -> None:
    (tmp_path / "demo").symlink_to(demo_model_dir)
    settings = fast_settings(
        cluster,
        nats_url,
        redis_url,
        tmp_path,
        pd="always",
        pd_lease=timedelta(seconds=6),  # the prefill waits out the stall
        max_prefill_tokens=32,
    )
    async with control_plane(settings, nats_url, redis_url, je_store=True) as run:
        bus_client: BusClient = await run.start(lambda bus: BusClient(settings, bus))
        await bus_client.started.wait()
        store = await Store.connect(redis_url)
        await run.start(lambda bus: JobExecutor(settings=settings, bus=bus, store=store))
        jes: list[JobExecutor] = [s for s, *_ in run.items if isinstance(s, JobExecutor)]
        await bus_client.until(lambda v: len(v.jes) == 2)
        tes: dict[str, TaskExecutor] = {}
        path = str(settings.models_dir / "demo")

        async def start(te_id: str, role: TaskMode) -> None:
            tes[te_id] = await run.start(
                lambda bus: TaskExecutor(settings=settings, bus=bus, te_id=te_id, pool_id="p")
            )
            await bus_client.until(lambda v: any(t.te_id == te_id for t in v.tes))
            ack = await bus_client.tes.control(te_id, LoadModel(model="demo", path=path, role=role))
            assert ack.ok, ack
            await bus_client.until(
                lambda v: any(t.te_id == te_id and t.state == TEState.READY for t in v.tes), 60
            )

        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{settings.frontend.http_port}/v1", api_key="none"
        )
        await start("te-c", TaskMode.COLOCATED)
        _, want = await _chat(client)  # colocated: no prefill instance yet
        await start("te-p", TaskMode.PREFILL)

        reached, wake = asyncio.Event(), asyncio.Event()
        cancels: list[tuple[str, str, TaskMode]] = []
        offer, cancel = JobExecutor._offer, JobExecutor._cancel

        async def stall_before_decode(self: JobExecutor, te_id: str, task: Any, *a: Any) -> Any:
            if task.mode == TaskMode.DECODE and not reached.is_set():
                reached.set()
                await wake.wait()  # silent meanwhile: no heartbeat, no liveness key
            return await offer(self, te_id, task, *a)

        async def spy_cancel(self: JobExecutor, te_id: str, job: Any, mode: TaskMode) -> None:
            cancels.append((self.je_id, te_id, mode))
            await cancel(self, te_id, job, mode)

        async def silent(*_: Any, **__: Any) -> None:
            return None

        JobExecutor._offer = stall_before_decode  # type: ignore[method-assign]
        JobExecutor._cancel = spy_cancel  # type: ignore[method-assign]
        try:
            fallbacks = sum(te.tasks.kv_fallbacks for te in tes.values())
            job = asyncio.create_task(_chat(client))
            await asyncio.wait_for(reached.wait(), 30)
            stalled = next(je for je in jes if je._inflight)
            stalled._hb._client.heartbeat = silent  # type: ignore[method-assign]
            stalled._keeper._graphs.alive = silent  # type: ignore[method-assign,union-attr]
            request_id, got = await asyncio.wait_for(job, 60)
            assert got == want
            assert sum(te.tasks.kv_fallbacks for te in tes.values()) == fallbacks
            assert sum(je._keeper.taken_over for je in jes) == 1
            held = await GraphStore(store, cluster, "test").get(request_id)
            assert held is not None and held.epoch == 2 and not held.open
            assert held.graph.task("prefill").attempt == 0
            assert held.graph.task("decode").attempt > 0
            assert not cancels  # the prefill was continued, nothing undone

            # The stalled placement wakes: it offers its decode task, its record is refused,
            # and it cancels that task; the prefill stays the successor's.
            wake.set()
            await _until(lambda: any(mode == TaskMode.DECODE for _, _, mode in cancels))
            assert [(je, mode) for je, _, mode in cancels] == [(stalled.je_id, TaskMode.DECODE)]
            await _until(lambda: all(_idle(te) for te in tes.values()))
            after = await GraphStore(store, cluster, "test").get(request_id)
            assert after is not None and after.epoch == 2 and after.owner == held.owner
        finally:
            JobExecutor._offer = offer  # type: ignore[method-assign]
            JobExecutor._cancel = cancel  # type: ignore[method-assign]

        # A continued graph whose decode task is refused: the dead JE's prefill is cancelled
        # under the attempt it was placed for, and the graph closed.
        survivor = next(je for je in jes if je.je_id == held.owner)
        prompt = list(range(40, 90))
        source = KvSource(te_id="te-p", address="127.0.0.1:9", key="x-0/prefill")
        dead = GraphStore(store, cluster, "je-dead")
        graph = plan_chat(
            graph_id="x",
            model="demo",
            deadline=time.time() + 30,
            prompt=prompt_digest(prompt),
            decode_te="te-c",
            prefill_te="te-p",
        )
        await dead.open(
            with_task(graph, "prefill", state=TaskState.PLACED, kv_source=source, attempt=0)
        )
        resumed = await survivor._keeper.take_over(
            "x", prompt_digest(prompt), lambda: {"te-p", "te-c"}
        )
        assert resumed is not None and resumed.source == source
        undone: list[tuple[str, str, int]] = []

        async def refuse(self: JobExecutor, te_id: str, task: Any, *a: Any) -> Any:
            return None

        async def spy(self: JobExecutor, request_id: str, task: Any) -> None:
            undone.append((task.te_id, task.kind, task.attempt))

        cancel_graph_task = JobExecutor._cancel_graph_task
        JobExecutor._offer = refuse  # type: ignore[method-assign]
        JobExecutor._cancel_graph_task = spy  # type: ignore[method-assign]
        try:
            job = ChatJob(
                request_id="x",
                model="demo",
                prompt_token_ids=prompt,
                sampling=SamplingParams(max_tokens=4, temperature=0),
                reply_to="nobody",
                deadline=time.time() + 30,
                attempt=1,
            )
            pd = PdDecision("te-p", "continued")
            placed = await survivor._place_graph(
                job, "te-c", 0, pd, [], Request(prompt_tokens=len(prompt)), resumed
            )
        finally:
            JobExecutor._offer = offer  # type: ignore[method-assign]
            JobExecutor._cancel_graph_task = cancel_graph_task  # type: ignore[method-assign]
        assert placed.task is None and placed.refused == {"te-c"}
        assert undone == [("te-p", "prefill", 0)]
        closed = await dead.get("x")
        assert closed is not None and not closed.open and closed.epoch == 2
        assert closed.graph.task("prefill").state == TaskState.CANCELLED
