"""Readiness per model and the operator's status on a real cluster: `GET /v1/models/{id}` says
the model is at zero, then ready once a TE serves it; `GET /admin/status` and
`meshserve status` show the TE, its pool and the model it serves."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.task_executor.worker import TaskExecutor
from shared.messages.cluster import TEState
from shared.messages.scaling import LoadModel
from tests.integration.services import BusClient, control_plane, fast_settings, wait_health

pytestmark = [pytest.mark.nats, pytest.mark.redis]


async def test_readiness_and_the_status_command(
    cluster: str, nats_url: str, redis_url: str, tmp_path: Path, demo_model_dir: Path
) -> None:
    (tmp_path / "demo").symlink_to(demo_model_dir)
    settings = fast_settings(cluster, nats_url, redis_url, tmp_path)
    base = f"http://127.0.0.1:{settings.frontend.http_port}"
    async with control_plane(settings, nats_url, redis_url) as run:
        bus_client: BusClient = await run.start(lambda bus: BusClient(settings, bus))
        await bus_client.started.wait()
        await run.start(
            lambda bus: TaskExecutor(settings=settings, bus=bus, te_id="te-s1", pool_id="pool-s")
        )
        await wait_health(base, lambda body: len(body.get("task_executors", [])) == 1)
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        demo = await client.models.retrieve("demo")
        assert demo.model_extra["state"] == "at_zero"
        assert demo.model_extra["ready_instances"] == 0

        ack = await bus_client.tes.control(
            "te-s1", LoadModel(model="demo", path=str(tmp_path / "demo"))
        )
        assert ack.ok, ack
        await bus_client.until(lambda v: any(t.state == TEState.READY for t in v.tes), 60)
        await asyncio.sleep(0.3)  # the frontend's view catches up
        demo = await client.models.retrieve("demo")
        assert (demo.model_extra["state"], demo.model_extra["ready_instances"]) == ("ready", 1)
        listed = {m.id: m.model_extra["state"] for m in (await client.models.list()).data}
        assert listed == {"demo": "ready"}

        # One request, in vLLM's families (meshserve: prefix, model_name), as Prometheus reads
        # it (the counts are this process's: other tests' requests are in them too).
        before = await _demo_samples(base)
        r = await client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            extra_body={"ignore_eos": True},
        )
        after = await _demo_samples(base)

        def grew(name: str) -> float:
            return after.get(name, 0) - before.get(name, 0)

        assert grew("meshserve:time_to_first_token_seconds_count") == 1
        assert grew("meshserve:request_prefill_time_seconds_count") == 1
        # One inter-token latency per token after the first.
        assert r.usage is not None and r.usage.completion_tokens == 4
        assert grew("meshserve:inter_token_latency_seconds_count") == 3
        assert grew("meshserve:request_success_total") == 1
        assert grew("meshserve:generation_tokens_total") >= 1
        async with aiohttp.ClientSession() as http, http.get(f"{base}/admin/status") as r:
            traffic = (await r.json())["traffic"]
        assert traffic["demo"]["requests"] == 1 and traffic["demo"]["ttft_p50_s"] > 0

        out = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "services.cli", "status", "--url", base],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert "pool pool-s" in out.stdout
        te_line = next(line for line in out.stdout.splitlines() if line.startswith("te-s1"))
        assert "ready" in te_line and "demo" in te_line and "torch" in te_line
        assert "traffic seen by this frontend" in out.stdout
        model_line = next(line for line in out.stdout.splitlines() if line.startswith("demo"))
        assert model_line.split()[:3] == ["demo", "ready", "1"]


async def _demo_samples(base: str) -> dict[str, float]:
    """The demo model's samples at ``/metrics`` (default tenant, no adapter), summed over
    their other labels."""
    async with aiohttp.ClientSession() as http, http.get(f"{base}/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if (s.labels.get("model_name"), s.labels.get("adapter")) == ("demo", ""):
                out[s.name] = out.get(s.name, 0) + s.value
    return out
