"""KV preemption across devices (``MESHSERVE_KV_PREEMPTION``, LLM-Mesh), with real processes:
two node pools (pool A a device of two TEs under a KV budget, pool B one TE, whose arbiter
only observes: no turns, no books), a cluster manager, a job executor and a frontend,
called with the official ``openai`` client.

On pool A, ``big`` and ``small`` share the device; pool B serves another instance of
``small``. A long greedy generation runs on pool A's ``small``; a burst on ``big`` then wants
more KV than the device has, and ``small`` (at its floor) cannot shrink. A second on, pool
A's arbiter finds that ``small``'s one request validates on pool B's device (which pool B
told it), and preempts it: pool A's ``small`` hands the request back and unloads, its
frontend resubmits it from the tokens it had, the job executor places it on the TE the
preemption validated it on, pool B finishes it, and the text is what it was alone; ``big``'s pool grows into the room, and its burst completes."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import openai
import pytest

from services.job_executor.metrics import MOVED
from services.task_executor.device_arbiter import KV_PREEMPTIONS
from services.task_executor.pool import NodePool
from shared.messages.cluster import ClusterView, TEState
from shared.messages.scaling import LoadModel
from tests.integration.services import BusClient, control_plane, fast_settings

pytestmark = [pytest.mark.nats, pytest.mark.redis, pytest.mark.slow]

BLOCK_BYTES = 4 * 2 * 2 * 32 * 16 * 4  # the demo model's KV block of 16 tokens, float32
FLOOR = 640  # blocks: 1.25 of the demo model's 8,192-token context


async def test_a_blocked_grow_preempts_a_neighbour_whose_request_resumes_on_another_device(
    cluster: str, nats_url: str, redis_url: str, tmp_path: Path, demo_model_dir: Path
) -> None:
    for model in ("big", "small"):
        (tmp_path / model).symlink_to(demo_model_dir)
    settings = fast_settings(
        cluster,
        nats_url,
        redis_url,
        tmp_path,
        pool_size=2,
        device="cpu",
        dtype="float32",
        torch_threads=0,  # the pool's TEs outnumber the cores: each pool serves an arbiter
        kv_sizing=True,
        kv_cache_bytes=64 * 1024**2,
        # Both floors and 20 blocks: big's burst (24 x about 530 tokens, grown to some 1,000
        # blocks) does not fit beside small's floor.
        device_kv_bytes=(2 * FLOOR + 20) * BLOCK_BYTES,
        kv_preemption=True,
    )
    async with control_plane(settings, nats_url, redis_url) as run:
        # Pool B's one TE takes no turns: its arbiter only observes what it holds, and
        # publishes that (the place small's request may go).
        single = settings.with_values(pool_size=1)
        pools = [
            await run.start(lambda bus, p=p, s=s: NodePool(settings=s, pool_id=p, bus=bus))
            for p, s in (("pool-a", settings), ("pool-b", single))
        ]
        assert pools[0].arbiter is not None and pools[0].arbiter.turns
        assert pools[1].arbiter is not None and not pools[1].arbiter.turns
        client: BusClient = await run.start(lambda bus: BusClient(settings, bus))
        await client.started.wait()
        await client.until(lambda v: len(v.tes) == 3, 90)
        a_big, a_small = sorted(t.te_id for t in client.view.view.tes if t.pool_id == "pool-a")
        b_small = min(t.te_id for t in client.view.view.tes if t.pool_id == "pool-b")

        async def load(te_id: str, model: str) -> None:
            ack = await client.tes.control(
                te_id, LoadModel(model=model, path=str(tmp_path / model))
            )
            assert ack.ok, ack

            def ready(v: ClusterView) -> bool:
                return any(t.te_id == te_id and t.state == TEState.READY for t in v.tes)

            await client.until(ready, 60)

        await load(a_big, "big")
        await load(a_small, "small")
        api = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{settings.frontend.http_port}/v1",
            api_key="none",
            max_retries=0,
            timeout=120,
        )
        ask = {
            "messages": [{"role": "user", "content": "tell me a long story"}],
            "temperature": 0,
            "extra_body": {"ignore_eos": True},
        }
        alone = await api.chat.completions.create(model="small", max_tokens=3000, **ask)
        assert alone.usage is not None and alone.usage.completion_tokens == 3000

        # The long generation on pool A's small (the only instance of small so far).
        got: list[str] = []
        first = asyncio.Event()

        async def long_one() -> None:
            stream = await api.chat.completions.create(
                model="small", max_tokens=3000, stream=True, **ask
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    got.append(chunk.choices[0].delta.content)
                    first.set()

        story = asyncio.create_task(long_one())
        await asyncio.wait_for(first.wait(), 30)
        await load(b_small, "small")  # somewhere for it to go
        assert not story.done(), "the generation ended before the burst: make it longer"
        before = KV_PREEMPTIONS.labels("cpu")._value.get()
        moved = MOVED.labels("small", "validated")._value.get()
        started = time.monotonic()
        burst = await asyncio.gather(
            *(
                api.chat.completions.create(
                    model="big",
                    max_tokens=500,
                    messages=[{"role": "user", "content": f"burst {k} " + "word " * 20}],
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                for k in range(24)
            )
        )
        await asyncio.wait_for(story, 120)
        assert all(r.usage is not None and r.usage.completion_tokens == 500 for r in burst)
        assert KV_PREEMPTIONS.labels("cpu")._value.get() == before + 1
        assert "".join(got) == alone.choices[0].message.content  # resumed, unchanged
        # The hand-back named the TE the preemption validated it on, and the job executor
        # placed it there.
        assert MOVED.labels("small", "validated")._value.get() == moved + 1
        # Pool A's small handed its request back and unloaded; big grew into its room.
        await client.until(
            lambda v: any(t.te_id == a_small and t.state == TEState.IDLE for t in v.tes), 10
        )
        arbiter = pools[0].arbiter
        assert arbiter is not None
        held = {c.name: c.holds for c in arbiter._devices["cpu"].clients.values()}
        assert held.get(a_small, 0) == 0 and held[a_big] > (FLOOR + 20) * BLOCK_BYTES, held
        assert time.monotonic() - started < 100
