"""Failures talking to NATS and Redis are counted by kind in the process's /metrics
(``shared/infra_metrics.py``), against real servers; the caller still gets the error."""

from __future__ import annotations

import asyncio

import pytest
import redis.exceptions
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from shared.bus import Bus
from shared.errors import Internal, NoResponder, PeerUnreachable
from shared.messages.cluster import GetView
from shared.messages.scaling import ControlAck
from shared.store import MeteredRedis, Store

pytestmark = [pytest.mark.nats, pytest.mark.redis]


def _exposed(family: str) -> dict[str, float]:
    """``{kind: value}`` of one family, read back through Prometheus' parser ({} before its
    first sample)."""
    text = generate_latest().decode()
    return {
        s.labels["kind"]: s.value
        for f in text_string_to_metric_families(text)
        if f.name == family
        for s in f.samples
        if s.name.endswith("_total")
    }


async def test_bus_failures_are_counted_by_kind(bus: Bus, cluster: str) -> None:
    before = _exposed("meshserve:bus_errors")
    subject = f"{cluster}.test.infra"
    with pytest.raises(NoResponder):
        await bus.request(f"{subject}.nobody", GetView(), ControlAck, timeout=1)

    async def slow(_: GetView) -> ControlAck:
        await asyncio.sleep(5)
        return ControlAck(te_id="x", ok=True)

    await bus.subscribe(f"{subject}.slow", {GetView: slow}, concurrent=True)
    with pytest.raises(PeerUnreachable):
        await bus.request(f"{subject}.slow", GetView(), ControlAck, timeout=0.2)

    async def garbage(m) -> None:
        await m.respond(b"\xc1 not msgpack")

    await bus.subscribe_raw(f"{subject}.garbage", garbage)
    with pytest.raises(Internal):
        await bus.request(f"{subject}.garbage", GetView(), ControlAck, timeout=2)
    after = _exposed("meshserve:bus_errors")
    for kind in ("no_responder", "timeout", "undecodable"):
        assert after[kind] - before.get(kind, 0.0) == 1, (kind, before, after)


async def test_redis_failures_are_counted_by_kind(store: Store, cluster: str) -> None:
    before = _exposed("meshserve:redis_errors")
    key = f"{cluster}:infra-metrics"
    await store.redis.set(key, b"1")
    with pytest.raises(redis.exceptions.ResponseError):
        await store.redis.lpush(key, b"2")  # a string, not a list
    # A script's first call loads it (NOSCRIPT, then SCRIPT LOAD): not a failure.
    assert await store.redis.register_script("return 7")(keys=[], args=[]) == 7
    async with store.redis.pipeline(transaction=True) as p:
        await p.watch(key)
        await store.redis.set(key, b"3")  # another writer wins the race
        p.multi()
        p.set(key, b"4")
        with pytest.raises(redis.exceptions.WatchError):
            await p.execute()
    assert await store.redis.get(key) == b"3"
    await store.redis.delete(key)
    unreachable = MeteredRedis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=1)
    with pytest.raises(redis.exceptions.ConnectionError):
        await unreachable.get(key)
    await unreachable.aclose()
    after = _exposed("meshserve:redis_errors")
    for kind in ("refused", "watch", "connection"):
        assert after[kind] - before.get(kind, 0.0) == 1, (kind, before, after)
