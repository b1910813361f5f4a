"""A frontend stopped gracefully (SIGTERM, as an orchestrator stops it) ends the streams
still running after its grace with an error event, not a cut mid-stream; its replacement
serves new requests."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import openai
import pytest

from tests.e2e.conftest import Cluster
from tests.fault.conftest import client_of, health, pids_of, wait_for

pytestmark = pytest.mark.timeout(240)

BACK_S = 45.0  # the launcher restarts the frontend within this


@pytest.fixture(scope="module")
def cluster(fault_models_dir, servers, tmp_path_factory):
    nats, redis = servers
    log = tmp_path_factory.mktemp("shutdown") / "cluster.log"
    c = Cluster(
        fault_models_dir, nats.url, redis.url, stderr=log, keep_alive="600", shutdown_grace="1"
    ).start()
    yield c
    c.stop()


async def signal_frontend_mid_stream(cluster, sig: int) -> int:
    """Stream a long generation, send the frontend ``sig`` at its third token, read on
    until the stream fails (the test asserts how); the tokens read."""
    stream = await client_of(cluster).chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "Tell me everything, at length."}],
        max_tokens=6000,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    got = 0
    async with asyncio.timeout(30):
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                got += 1
                if got == 3:
                    (pid,) = pids_of(cluster, "frontend")
                    os.kill(pid, sig)
    return got


async def test_streams_past_the_grace_end_with_an_error_event(cluster):
    with pytest.raises(openai.APIError, match="shutting down") as e:
        await signal_frontend_mid_stream(cluster, signal.SIGTERM)
    assert "retry" in str(e.value)
    # The launcher starts another frontend, which serves.
    wait_for("a new frontend", lambda: pids_of(cluster, "frontend"), BACK_S)

    async def served() -> bool:
        try:
            r = await client_of(cluster).chat.completions.create(
                model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )
            return bool(r.choices)
        except openai.APIError:
            return False

    for _ in range(int(BACK_S)):
        if await served():
            return
        await asyncio.sleep(1)
    raise AssertionError("the restarted frontend does not serve")


async def test_a_killed_frontends_generations_stop_on_their_tes(cluster):
    with pytest.raises(openai.APIError):
        await signal_frontend_mid_stream(cluster, signal.SIGKILL)
    killed_at = time.monotonic()

    def idle() -> bool:
        body = health(cluster)
        return body is not None and all(te["running"] == 0 for te in body["task_executors"])

    # Declared gone after the liveness timeout (2 s here), its generation stops: long before
    # its 6,000 tokens would have run out.
    wait_for("the orphaned generation to stop", idle, BACK_S)
    assert time.monotonic() - killed_at < 20
