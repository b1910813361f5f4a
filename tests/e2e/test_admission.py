"""Admission control end to end: a burst beyond what the only instance can queue is refused
at once with 503 and Retry-After, and every request that was admitted completes."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import openai
import pytest

from tests.e2e.conftest import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.nats, pytest.mark.redis]

MSGS = [{"role": "user", "content": "Tell me about the license of this program."}]


@pytest.fixture(scope="module")
def small(e2e_models_dir, nats_url, redis_url):
    # One TE, two batch slots, one batch's worth of queue: the fifth concurrent request
    # finds the only instance saturated and no TE to scale out on.
    c = Cluster(
        e2e_models_dir,
        nats_url,
        redis_url,
        pool_size="1",
        max_num_seqs="2",
        max_queued_per_slot="1",
        keep_alive="600",
    ).start()
    yield c
    c.stop()


async def test_a_burst_beyond_capacity_is_shed_early_and_the_rest_completes(small):
    client = openai.AsyncOpenAI(base_url=small.url, api_key="unused", max_retries=0, timeout=300)
    await client.chat.completions.create(model="demo", messages=MSGS, max_tokens=1)  # loaded

    async def one():
        t0 = time.monotonic()
        try:
            r = await client.chat.completions.create(
                model="demo",
                messages=MSGS,
                max_tokens=48,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return "ok", time.monotonic() - t0, r.usage.completion_tokens
        except openai.APIStatusError as e:
            return e.status_code, time.monotonic() - t0, e

    got = await asyncio.gather(*(one() for _ in range(16)))
    await client.close()
    done = [g for g in got if g[0] == "ok"]
    shed = [g for g in got if g[0] == 503]
    assert len(done) + len(shed) == 16, got
    assert len(done) >= 2 and shed, got  # at least a batch; how many more: timing
    assert all(tokens == 48 for _, _, tokens in done)
    for _, seconds, err in shed:
        assert err.body["code"] == "overloaded" and "saturated" in err.message
        assert int(err.response.headers["retry-after"]) >= 1
        assert seconds < 5  # refused up front, not after the 60 s placement deadline
    url = small.url.removesuffix("/v1") + "/metrics"
    metrics = await asyncio.to_thread(lambda: urllib.request.urlopen(url).read().decode())
    line = next(x for x in metrics.splitlines() if x.startswith("meshserve_shed_requests_total"))
    assert float(line.split()[-1]) == len(shed)
