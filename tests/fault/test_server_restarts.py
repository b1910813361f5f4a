"""Restart Redis or NATS under a running cluster (the fault tests' own servers, on the
same port): serving goes on, what the services keep in Redis comes back, and a request in
flight while NATS is away completes or fails with a clear 5xx; none hangs."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest
import redis

from tests.fault.conftest import (
    CALL_TIMEOUT_S,
    Req,
    await_for,
    client_of,
    cluster_whole,
    references,
    requests_for,
    start_cluster,
    under_load,
)

# Each test bounded as a whole (a cluster start and the demo model included).
pytestmark = pytest.mark.timeout(240)

# Soft state back in Redis within this after a restart (its writers look every few seconds).
REBUILD_S = 20.0
# A restarted NATS: every service reconnected and serving within this.
RECONNECT_S = 30.0


@pytest.fixture
def cluster(fault_models_dir, servers, tmp_path):
    nats, redis_server = servers
    c = start_cluster(fault_models_dir, nats, redis_server, tmp_path)
    yield c
    c.stop()


def _keys(url: str, cluster: str) -> set[str]:
    r = redis.Redis.from_url(url)
    try:
        return {k.decode() for k in r.scan_iter(match=f"{cluster}:*")}
    finally:
        r.close()


async def _all(client, reqs: list[Req]) -> list[str | BaseException]:
    return await asyncio.wait_for(
        asyncio.gather(*(r.run(client) for r in reqs), return_exceptions=True),
        CALL_TIMEOUT_S + 10,
    )


async def test_redis_restart_keeps_serving_and_rebuilds_soft_state(cluster, servers):
    _, redis_server = servers
    reqs = requests_for("redis", 6)
    expected = await references(cluster, reqs)
    # What the cluster keeps in Redis once it served: the model registry, the measured
    # capacity, the host cache's metadata, the prompt index of the TE that ran them.
    soft = {
        f"{cluster.name}:models",
        f"{cluster.name}:capacity",
        f"{cluster.name}:kvidx:demo:tes",
    }
    hostcache = f"{cluster.name}:hostcache:"

    def all_soft_state() -> set[str]:
        k = _keys(redis_server.url, cluster.name)
        return k if k >= soft and any(key.startswith(hostcache) for key in k) else set()

    before = await await_for("the soft state in Redis", all_soft_state, REBUILD_S, every=0.25)

    def restart() -> None:
        redis_server.restart(kill=True)  # on the test's thread (EmbeddedServer.start)
        assert _keys(redis_server.url, cluster.name) <= before - soft, "Redis kept its data"

    got = await under_load(cluster, reqs[:3], reqs[3:], restart)
    for r in reqs:
        assert got[r] == expected[r], f"{r} differs from its undisturbed output: {got[r]!r}"

    t0 = time.monotonic()
    after = await await_for(
        "the soft state rebuilt",
        lambda: (k := _keys(redis_server.url, cluster.name)) >= before and k,
        REBUILD_S,
        every=0.25,
    )
    print(f"soft state rebuilt within {time.monotonic() - t0:.1f}s: {sorted(after)}")
    client = client_of(cluster)
    try:
        assert await _all(client, reqs) == [expected[r] for r in reqs]
    finally:
        await client.close()


def _clear_5xx(e: BaseException) -> bool:
    """A failure the client can act on: a 5xx with an OpenAI error body, or, in a stream
    that had begun, the error event the server sent (the openai client raises APIError)."""
    if isinstance(e, openai.APIStatusError):
        if e.status_code < 500:
            return False
    elif type(e) is not openai.APIError:
        return False
    body = e.body
    return (
        isinstance(body, dict)
        and body.get("type") in ("service_unavailable", "internal_error")
        and bool(body.get("message"))
    )


async def test_nats_restart_ends_in_flight_requests_and_serving_resumes(cluster, servers):
    nats, _ = servers
    reqs = requests_for("nats", 6)
    expected = await references(cluster, reqs)
    t0 = time.monotonic()

    async def restart() -> None:  # on the test's thread (EmbeddedServer.start)
        nats.stop_process(kill=True)
        await asyncio.sleep(1.0)
        nats.start()

    got = await under_load(cluster, reqs[:3], reqs[3:], restart)
    took = time.monotonic() - t0
    for r, out in got.items():
        if isinstance(out, BaseException):
            assert _clear_5xx(out), f"{r}: {out!r}"
        else:
            assert out == expected[r], f"{r} completed with another output"
    print(
        f"in flight at the restart: {[type(o).__name__ for o in got.values()]} within {took:.1f}s"
    )

    await await_for("serving after the restart", lambda: cluster_whole(cluster), RECONNECT_S)
    client = client_of(cluster)
    try:
        assert await _all(client, reqs) == [expected[r] for r in reqs]
    finally:
        await client.close()


async def test_a_long_nats_outage_fails_requests_with_503_and_serving_resumes(cluster, servers):
    """NATS away for longer than the liveness deadline (2 s here): what was in flight fails
    with a 503 soon after that deadline, a new request is refused at once, and once NATS
    is back everything serves as before."""
    nats, _ = servers
    reqs = requests_for("outage", 3)
    expected = await references(cluster, reqs)
    client = client_of(cluster)
    flowing = {r: 0 for r in reqs if r.stream}
    in_flight = asyncio.gather(
        *(r.run(client, lambda n, r=r: flowing.__setitem__(r, n)) for r in reqs),
        return_exceptions=True,
    )
    t0 = time.monotonic()
    try:
        await await_for("streams flowing", lambda: min(flowing.values()) >= 3, CALL_TIMEOUT_S)
        nats.stop_process(kill=True)
        t0 = time.monotonic()
        got = await asyncio.wait_for(in_flight, 10)
        # The deadline passed while NATS is still down: refused at once.
        await asyncio.sleep(max(0.0, 2.5 - (time.monotonic() - t0)))
        t1 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as refused:
            await asyncio.wait_for(reqs[0].run(client), 5)
        assert refused.value.status_code == 503 and time.monotonic() - t1 < 2
    finally:
        if not nats.running:  # back after 5 s, on the test's thread (EmbeddedServer.start)
            await asyncio.sleep(max(0.0, 5.0 - (time.monotonic() - t0)))
            nats.start()
        await client.close()
    for r, out in zip(reqs, got, strict=True):
        if isinstance(out, BaseException):
            assert _clear_5xx(out), f"{r}: {out!r}"
        else:
            assert out == expected[r], f"{r} completed with another output"
    assert any(isinstance(out, BaseException) for out in got), "the outage disturbed nothing"

    await await_for("serving after the restart", lambda: cluster_whole(cluster), RECONNECT_S)
    client = client_of(cluster)
    try:
        assert await _all(client, reqs) == [expected[r] for r in reqs]
    finally:
        await client.close()
