"""Autoscaling on a real cluster: a burst from one stream to many makes the scaler add
instances of the model; when the load falls it drains back to min_replicas while requests
still stream, and no request is cut: every output equals the undisturbed greedy run's."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from tests.e2e.conftest import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = [f"Story {i}: once upon a time in the city of {i * 7}," for i in range(8)]
MAX_TOKENS = 160


def _instances(url: str) -> dict[str, str]:
    """TE id -> state, for the TEs that hold the demo model."""
    with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=5) as r:
        body = json.loads(r.read())
    return {t["id"]: t["state"] for t in body["task_executors"] if t.get("model") == "demo"}


async def _ask(client: openai.AsyncOpenAI, prompt: str) -> str:
    stream = await client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
    )
    out = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            out.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].finish_reason:
            assert chunk.choices[0].finish_reason in ("stop", "length")
    return "".join(out)


async def _workers(client, n: int, seconds: float, reference: dict[str, str], done: list):
    """``n`` clients, each asking one prompt after another for ``seconds``; every answer
    is checked against the reference."""

    async def worker(k: int) -> None:
        end = time.monotonic() + seconds
        i = k
        while time.monotonic() < end:
            prompt = PROMPTS[i % len(PROMPTS)]
            assert await _ask(client, prompt) == reference[prompt], prompt
            done.append(prompt)
            i += n

    await asyncio.gather(*(worker(k) for k in range(n)))


def _scale_downs(url: str) -> float:
    """Scale-downs done (drained and unloaded), from the frontend's /metrics."""
    with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("meshserve_scale_events_total{") and 'kind="down"' in line
    )


async def _watch(url: str, seen: list[dict[str, str]], stop: asyncio.Event) -> None:
    while not stop.is_set():
        seen.append(await asyncio.to_thread(_instances, url))
        await asyncio.sleep(0.2)


async def test_burst_scales_out_and_the_drain_back_cuts_nothing(
    e2e_models_dir: Path, nats_url: str, redis_url: str, tmp_path: Path
) -> None:
    cluster = Cluster(
        e2e_models_dir,
        nats_url,
        redis_url,
        stderr=tmp_path / "cluster.log",
        pool_size="3",
        max_num_seqs="2",  # a queue forms with 3 streams: the scaler must add instances
        min_replicas="1",
        max_replicas="3",
        keep_alive="3",
        stable_window="4",
        panic_window="2",
        drain_timeout="60",
    ).start()
    try:
        client = openai.AsyncOpenAI(base_url=cluster.url, api_key="unused", max_retries=0)
        deadline = time.monotonic() + 60
        while "ready" not in _instances(cluster.url).values():  # min_replicas=1, no traffic
            assert time.monotonic() < deadline, "min_replicas did not load the model"
            await asyncio.sleep(0.2)
        # The undisturbed greedy run: one request at a time on the one instance.
        reference = {p: await _ask(client, p) for p in PROMPTS}
        assert len(_instances(cluster.url)) == 1

        seen: list[dict[str, str]] = []
        stop = asyncio.Event()
        watcher = asyncio.create_task(_watch(cluster.url, seen, stop))
        done: list[str] = []
        # The burst: eight streams at once, for long enough to see instances arrive.
        await _workers(client, 8, 12.0, reference, done)
        peak = max(sum(s == "ready" for s in snap.values()) for snap in seen)
        assert peak == 3, seen[-1]
        # The load falls to two streams: the scaler drains instances after the stable window,
        # while requests go on. (A drain of an idle instance ends within a poll of /health:
        # the scale-down events say it happened.)
        # Two streams go on until an instance has been drained away: 12 s on a quiet host,
        # longer where the host is busy (the stable window, the drain and the unload).
        downs = _scale_downs(cluster.url)
        deadline = time.monotonic() + 36
        while True:
            await _workers(client, 2, 6.0, reference, done)
            if _scale_downs(cluster.url) > downs:
                break
            assert time.monotonic() < deadline, seen[-1]
        # Then nothing: back to min_replicas, one instance.
        deadline = time.monotonic() + 30
        while sum(s == "ready" for s in _instances(cluster.url).values()) != 1 or any(
            s != "ready" for s in _instances(cluster.url).values()
        ):
            assert time.monotonic() < deadline, _instances(cluster.url)
            await asyncio.sleep(0.2)
        stop.set()
        await watcher
        assert len(done) > 16
        log = (tmp_path / "cluster.log").read_text()
        assert "resubmitting request" not in log  # drained, not cut and moved
    finally:
        cluster.stop()
