"""Admission control end to end: a client sending one request after another is never
refused, however fast; a burst beyond what the only instance can queue is refused at once
with 503 and Retry-After, and every request that was admitted completes."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import aiohttp
import openai
import pytest

from loadgen.costmodel import EngineProfile
from loadgen.plan import plan
from loadgen.simulator import SimConfig, simulate
from loadgen.traces import TraceRequest
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


SEQUENTIAL = 3_000


async def test_a_sequential_client_is_never_refused(small):
    # The bound is four sequences on the only TE (two slots, one batch of queue), and TE
    # reports come every 0.25 s: a JE that counted its placements until the next report
    # refused this client within its first few dozen requests.
    statuses: dict[int, int] = {}
    body = {"model": "demo", "messages": MSGS, "max_tokens": 1}
    async with aiohttp.ClientSession() as http:
        for i in range(SEQUENTIAL):
            stream = i % 10 == 9  # every tenth streamed: both paths count placements
            async with http.post(
                f"{small.url}/chat/completions", json={**body, "stream": stream}
            ) as r:
                await r.read()
                statuses[r.status] = statuses.get(r.status, 0) + 1
    assert statuses == {200: SEQUENTIAL}


BURST, BURST_TOKENS = 16, 640  # long enough that none ends before the burst is in


async def test_a_burst_beyond_capacity_is_shed_early_and_the_rest_completes(small):
    client = openai.AsyncOpenAI(base_url=small.url, api_key="unused", max_retries=0, timeout=300)
    await client.chat.completions.create(model="demo", messages=MSGS, max_tokens=1)  # loaded

    async def one():
        t0 = time.monotonic()
        try:
            r = await client.chat.completions.create(
                model="demo",
                messages=MSGS,
                max_tokens=BURST_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return "ok", time.monotonic() - t0, r.usage.completion_tokens
        except openai.APIStatusError as e:
            return e.status_code, time.monotonic() - t0, e

    got = await asyncio.gather(*(one() for _ in range(BURST)))
    await client.close()
    done = [g for g in got if g[0] == "ok"]
    shed = [g for g in got if g[0] == 503]
    assert len(done) + len(shed) == BURST, got
    # Exactly what the bound admits (no request of the burst ends before the burst is in:
    # each decodes BURST_TOKENS), and exactly what the simulator, with the same ledger and
    # admission, sheds of the same burst.
    assert len(done) == 2 * (1 + 1), got
    assert len(shed) == simulated_shed(), got
    assert all(tokens == BURST_TOKENS for _, _, tokens in done)
    for _, seconds, err in shed:
        assert err.body["code"] == "overloaded" and "saturated" in err.message
        assert int(err.response.headers["retry-after"]) >= 1
        assert seconds < 5  # refused up front, not after the 60 s placement deadline
    url = small.url.removesuffix("/v1") + "/metrics"
    metrics = await asyncio.to_thread(lambda: urllib.request.urlopen(url).read().decode())
    line = next(x for x in metrics.splitlines() if x.startswith("meshserve_shed_requests_total"))
    assert float(line.split()[-1]) == len(shed)


def simulated_shed() -> int:
    """The same requests in the simulator: one device with the cluster's settings (two
    slots, one batch of queue, the heartbeat interval), the warm-up, a sequential client's
    500 requests (none shed there either), then the burst."""
    profile = EngineProfile(
        model="demo",
        load_s=1.0,
        decode_batches=(1, 2),
        decode_s=(0.005, 0.006),
        decode_ctx_s=0.0,
        prefill_s=1e-4,
        prefill_s2=0.0,
        max_num_seqs=2,
        max_prefill_tokens=2048,
        kv_blocks=1000,
        block_size=16,
        max_model_len=8192,
    )
    reqs = [TraceRequest(arrival_s=0.0, input_tokens=20, output_tokens=1)]
    reqs += [
        TraceRequest(arrival_s=5 + 0.006 * i, input_tokens=20, output_tokens=1) for i in range(500)
    ]
    reqs += [TraceRequest(arrival_s=10.0, input_tokens=20, output_tokens=BURST_TOKENS)] * BURST
    cfg = SimConfig(
        devices=1, pool_size=1, heartbeat_s=0.25, keep_alive_s=600, max_queued_per_slot=1
    )
    _, stats = simulate(plan(reqs, model="demo"), {"demo": profile}, cfg)
    return stats.shed
