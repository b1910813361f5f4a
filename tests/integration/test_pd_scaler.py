"""The scaler's PD split on a real cluster (NATS, Redis, torch engines, the official
``openai`` client): with ``max_prefill_replicas`` set, long prompts that the job executor's
rule would disaggregate make the scaler load a prefill instance beside the model's instance,
by itself; the next long prompt is disaggregated and answers as the colocated run did, a
short one stays colocated; once requests stop, the prefill instance unloads with the
model at the keep-alive."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

import openai
import pytest

from services.scaler.service import Scaler
from services.task_executor.worker import TaskExecutor
from shared.embedded import free_port
from shared.messages.cluster import ClusterView, TEState
from shared.messages.tasks import TaskMode, TaskProgress
from shared.settings import Settings
from tests.integration.services import BusClient, control_plane

pytestmark = [pytest.mark.nats, pytest.mark.redis, pytest.mark.slow]

PD_HEADER = "x-meshserve-pd"


def _prompt(i: int) -> str:
    """About 800 tokens of the demo tokenizer: over the test's uncached threshold."""
    return f"Request {i}. " + " ".join(f"w{(7 * k + 13 * i) % 997}" for k in range(360))


def _prefill_ready(view: ClusterView) -> bool:
    return any(
        t.role == TaskMode.PREFILL and t.state == TEState.READY and t.kv_address for t in view.tes
    )


async def test_the_scaler_loads_a_prefill_instance_for_long_prompts_and_unloads_it_when_idle(
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
        torch_threads=1,
        pd="auto",
        pd_min_uncached_tokens=256,
        max_replicas=1,
        max_prefill_replicas=1,
        keep_alive=timedelta(seconds=8),
        preload_window=timedelta(0),
    )
    async with control_plane(settings, nats_url, redis_url) as run:
        watcher: BusClient = await run.start(lambda bus: BusClient(settings, bus))
        await watcher.started.wait()
        # What the TEs tell the job executor as tasks end: the outputs its predictor learns.
        outputs: dict[str, int] = {}

        async def on_progress(msg: TaskProgress) -> None:
            outputs.update(msg.outputs)

        await watcher.bus.subscribe(
            watcher.subjects.task_progress("*"), {TaskProgress: on_progress}
        )
        for te_id in ("te-a", "te-b"):
            await run.start(
                lambda bus, te_id=te_id: TaskExecutor(
                    settings=settings, bus=bus, te_id=te_id, pool_id="p"
                )
            )
        await run.start(lambda bus: Scaler(settings=settings, bus=bus))
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{settings.frontend.http_port}/v1", api_key="none"
        )

        async def chat(content: str) -> tuple[str, str]:
            raw = await client.chat.completions.with_raw_response.create(
                model="demo",
                messages=[{"role": "user", "content": content}],
                max_tokens=12,
                temperature=0,
                extra_body={"ignore_eos": True},
                timeout=120,
            )
            r = raw.parse()
            assert r.usage is not None and r.usage.completion_tokens == 12
            return r.choices[0].message.content or "", raw.headers.get(PD_HEADER, "")

        # From zero: the model's instance first; the long prompt finds no prefill instance.
        first, how = await chat(_prompt(0))
        assert not how.startswith("disaggregated"), how
        # Its prefill work, reported by the job executor, makes the scaler load one.
        await watcher.until(_prefill_ready, 60)
        await watcher.until(
            lambda v: (
                sorted(t.role for t in v.tes if t.model == "demo")
                == [TaskMode.COLOCATED, TaskMode.PREFILL]
            )
        )

        again, how = await chat(_prompt(0))
        assert how.startswith("colocated"), how  # its decode instance holds the prompt now
        _, how = await chat(_prompt(1))
        assert how.startswith("disaggregated"), how  # (its tokens: tests/integration/test_pd.py)
        _, how = await chat("Hello there.")
        assert how.startswith("colocated"), how
        assert again == first
        # Every finished task said how many tokens it produced (prefill tasks are not
        # finished requests: none of theirs).
        for _ in range(50):  # the notices go out just after the last tokens
            if len(outputs) == 4:
                break
            await asyncio.sleep(0.1)
        assert len(outputs) == 4 and set(outputs.values()) == {12}, outputs
        assert not any(k.endswith("/prefill") for k in outputs)

        # No requests: both instances go at the keep-alive.
        await watcher.until(lambda v: all(t.model is None for t in v.tes), 60)
