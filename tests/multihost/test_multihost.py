"""meshserve on three hosts (network namespaces on one bridge, links shaped with ``tc``):
NATS clustered over the hosts, Redis primary and replica under three Sentinels, two
frontends, two job executors, two cluster managers, two scalers and a node pool of two TEs
per host (layout: ``devtools.multihost.LAYOUT``). The official openai client talks to the frontends
from the test's own namespace. Each test cuts one host's link (packets dropped, no reset)
and heals it before the next; the tests run in this order, on one cluster."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from devtools.chat import stream_greedy
from devtools.multihost import (
    CM_METRICS,
    LAYOUT,
    SCALER_METRICS,
    MultiHostCluster,
)
from devtools.netns_hosts import Hosts
from shared.subjects import Keys
from tests.multihost.conftest import start_cluster

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

PROMPTS = [f"Tell me about the harbour of town {i} and its boats." for i in range(20)]
MAX_TOKENS = 120
SETTINGS = {
    # demo: three instances, always; demo2 (the same checkpoint): none until asked for.
    "min_replicas": "3",
    "max_replicas": "3",
    "model_scaling": json.dumps({"demo2": {"min_replicas": 0, "max_replicas": 2}}),
    "max_num_seqs": "4",
    "keep_alive": "120",
    "stable_window": "8",
    "panic_window": "2",
    "drain_timeout": "60",
}
FRONTENDS = [i for i, s in LAYOUT.items() if "frontend" in s]
CUT_PROMPTS = [
    f"Write the log of ship {i} crossing the bay at dawn, hour by hour." for i in range(20)
]
CUT_TOKENS = 300


@pytest.fixture(scope="module")
def mh(hosts: Hosts, mh_models_dir: Path) -> Iterator[MultiHostCluster]:
    c = start_cluster(hosts, mh_models_dir, **SETTINGS)
    try:
        c.wait("every host's TEs and both job executors in the view", lambda: _full(c, 0), 240)
        c.wait("min_replicas instances ready", lambda: _ready(c, FRONTENDS[0]) >= 3, 180)
        c.wait("Redis whole (a primary, a replica the Sentinels know)", c.redis_whole, 60)
        yield c
    finally:
        c.stop()


def _full(c: MultiHostCluster, via: int) -> bool:
    body = c.health(via)
    return body is not None and len(body["task_executors"]) == 6 and body["job_executors"] == 2


def _ready(c: MultiHostCluster, via: int) -> int:
    return sum(s == "ready" for s in c.instances(via).values())


def _pools_serving(c: MultiHostCluster, via: int) -> dict[str, int]:
    """Pool (host) -> instances of the demo model ready there."""
    body = c.health(via) or {}
    out: dict[str, int] = {}
    for te in body.get("task_executors", []):
        if te.get("model") == "demo" and te["state"] == "ready":
            out[te["pool"]] = out.get(te["pool"], 0) + 1
    return out


def _client(c: MultiHostCluster, i: int) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=c.url(i), api_key="none", max_retries=0, timeout=180)


async def _stream(
    client: openai.AsyncOpenAI,
    prompt: str,
    seen: list[int] | None = None,
    max_tokens: int = MAX_TOKENS,
) -> str:
    return await stream_greedy(client, prompt, max_tokens=max_tokens, seen=seen)


_reference: dict[str, str] = {}


async def _reference_for(c: MultiHostCluster) -> dict[str, str]:
    """The undisturbed greedy run, one request at a time (computed once)."""
    if not _reference:
        client = _client(c, FRONTENDS[0])
        for p in PROMPTS:
            _reference[p] = await _stream(client, p)
    return _reference


def _heal_and_rejoin(c: MultiHostCluster, host: int) -> float:
    """Heal the host's link: the seconds until both frontends see every TE and both job
    executors again. Then (not timed) until Redis is a primary with a replica the Sentinels
    could promote: the next test starts from a whole cluster."""
    c.hosts.heal(host)
    t0 = time.monotonic()
    c.wait(f"host {host} rejoins", lambda: _full(c, FRONTENDS[0]) and _full(c, FRONTENDS[1]), 90)
    took = time.monotonic() - t0
    c.wait("Redis whole again (a primary, a replica the Sentinels know)", c.redis_whole, 90)
    return took


async def test_chat_completions_are_served_across_hosts(mh: MultiHostCluster) -> None:
    reference = await _reference_for(mh)
    # Both frontends serve, from instances on more than one host.
    other = await _stream(_client(mh, FRONTENDS[1]), PROMPTS[0])
    assert other == reference[PROMPTS[0]]
    assert len(_pools_serving(mh, FRONTENDS[0])) >= 2, _pools_serving(mh, FRONTENDS[0])
    # NATS is one cluster of three servers, each routed to the other two.
    assert mh.redis_primary() == mh.address(2)


async def test_streams_survive_a_host_cut_and_the_host_rejoins(mh: MultiHostCluster) -> None:
    """20 streams of prompts no instance has seen (so that routing spreads them by load
    rather than sending them where their prefixes are cached); the host holding the most of
    them (not the client's frontend's) is cut mid-stream. The undisturbed run comes after,
    one request at a time."""
    client = _client(mh, FRONTENDS[0])

    before = mh.produced(FRONTENDS[0])
    seen = [0]
    streams = [asyncio.create_task(_stream(client, p, seen, CUT_TOKENS)) for p in CUT_PROMPTS]
    deadline = time.monotonic() + 60
    while seen[0] < 10 * len(CUT_PROMPTS):  # mid-stream: ten chunks a stream, on average
        assert time.monotonic() < deadline, "the streams did not start"
        await asyncio.sleep(0.01)
    # The host whose instances produced the most of them so far, other than the client's
    # frontend's host (its heartbeat is at most a quarter of a second old).
    await asyncio.sleep(0.5)
    now = mh.produced(FRONTENDS[0])
    load = {h: now[h] - before.get(h, 0) for h in now if h != FRONTENDS[0]}
    victim = max(load, key=lambda h: load[h])
    assert load[victim] > 0, (before, now)
    mh.hosts.cut(victim)
    t0 = time.monotonic()
    results = await asyncio.wait_for(asyncio.gather(*streams), 240)
    ended = time.monotonic() - t0

    def gone() -> bool:
        tes = (mh.health(FRONTENDS[0]) or {"task_executors": [{"pool": "?"}]})["task_executors"]
        return all(te["pool"] != f"pool-h{victim}" for te in tes)

    mh.wait(f"host {victim}'s TEs leave the view", gone, 30)
    print(f"host {victim} cut holding {load[victim]} of the streams; all ended {ended:.1f} s later")
    rejoined = _heal_and_rejoin(mh, victim)
    print(f"host {victim} healed; its TEs and job executor back in the view {rejoined:.1f} s later")
    reference = [await _stream(client, p, max_tokens=CUT_TOKENS) for p in CUT_PROMPTS]
    assert results == reference


def _leader(c: MultiHostCluster, service: str, port: int) -> int | None:
    hosts = [i for i, s in LAYOUT.items() if service in s]
    leading = [i for i in hosts if c.metric(i, port, f"meshserve:{service}_leader") == 1.0]
    return leading[0] if len(leading) == 1 else None


async def test_a_cut_scaler_leader_is_replaced_and_its_successor_scales_out(
    mh: MultiHostCluster,
) -> None:
    """The host of the scaler that leads is cut; the other scaler takes the lease, and a
    burst for ``demo2`` (no instance yet: ``SETTINGS``' model_scaling) gets instances from
    it, on the live hosts."""
    reference = await _reference_for(mh)
    # A host that rejoined brought its instances back: the scaler trims demo to its bound.
    mh.wait("demo back at 3 instances", lambda: len(mh.instances(FRONTENDS[0])) == 3, 90)
    leader = mh.wait("one scaler leads", lambda: _leader(mh, "scaler", SCALER_METRICS), 30)
    via = next(i for i in FRONTENDS if i != leader)
    mh.hosts.cut(leader)
    t0 = time.monotonic()
    successor = mh.wait(
        "another scaler leads",
        lambda: (s := _leader(mh, "scaler", SCALER_METRICS)) not in (None, leader) and s,
        30,
    )
    took_over = time.monotonic() - t0

    def cut_off() -> bool:
        tes = (mh.health(via) or {"task_executors": [{"pool": "?"}]})["task_executors"]
        return all(te["pool"] != f"pool-h{leader}" for te in tes)

    mh.wait(f"host {leader}'s TEs leave the view", cut_off, 30)
    client = _client(mh, via)

    async def ask(prompt: str) -> str:
        # The demo model's checkpoint under another name: the same text.
        return await stream_greedy(client, prompt, model="demo2", max_tokens=MAX_TOKENS)

    got = await asyncio.wait_for(asyncio.gather(*(ask(p) for p in PROMPTS[:8])), 180)
    assert got == [reference[p] for p in PROMPTS[:8]]
    demo2 = [
        te
        for te in (mh.health(via) or {})["task_executors"]
        if te.get("model") == "demo2" and te["state"] == "ready"
    ]
    assert demo2 and all(te["pool"] != f"pool-h{leader}" for te in demo2), demo2
    print(
        f"scaler on host {leader} cut; host {successor}'s took over {took_over:.1f} s later "
        f"and loaded demo2 on {sorted(te['pool'] for te in demo2)} for the burst"
    )
    _heal_and_rejoin(mh, leader)


async def test_a_cut_redis_primary_fails_over_and_nothing_is_lost(mh: MultiHostCluster) -> None:
    reference = await _reference_for(mh)
    addresses = {h.address: h.index for h in mh.hosts.hosts}
    primary = mh.wait(
        "the Sentinels name a primary",
        lambda: (a := mh.redis_primary()) in addresses and a,
        30,
    )
    host = addresses[primary]
    via = next(i for i in FRONTENDS if i != host)
    marker = f"{mh.name}:test-marker"
    mh.redis_cli(host, "SET", marker, "kept")
    # On the replica too (one that was cut before may still be catching up with the primary
    # the Sentinels chose meanwhile).
    mh.wait(
        "the write reaches the replica", lambda: mh.redis_cli(host, "WAIT", "1", "500") == "1", 60
    )
    cm_before = _leader(mh, "cluster_manager", CM_METRICS)
    mh.hosts.cut(host)
    t0 = time.monotonic()
    new = mh.wait(
        "the Sentinels promote the replica",
        lambda: (a := mh.redis_primary()) in addresses and a != primary and a,
        30,
    )
    promoted = time.monotonic() - t0
    new_host = addresses[new]
    assert mh.redis_cli(new_host, "GET", marker) == "kept"
    # The services follow the Sentinels to the new primary: the cluster manager leads there
    # (its lease renewed or taken again), requests are served, the registry is in place.
    client = _client(mh, via)

    async def serves() -> float:
        deadline = time.monotonic() + 60
        while True:
            try:
                assert await _stream(client, PROMPTS[2]) == reference[PROMPTS[2]]
                return time.monotonic() - t0
            except openai.APIError:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.5)

    served = await serves()
    mh.wait("a cluster manager leads", lambda: _leader(mh, "cluster_manager", CM_METRICS), 30)
    models = mh.redis_cli(new_host, "HKEYS", Keys(mh.name).models())
    assert "demo" in models, models
    print(
        f"Redis primary's host {host} cut; replica on host {new_host} promoted "
        f"{promoted:.1f} s later, served again {served:.1f} s after the cut "
        f"(cluster manager leader before: host {cm_before})"
    )
    # Healed, the old primary comes back as a replica (the Sentinels reconfigure it) and the
    # pair is whole again.
    _heal_and_rejoin(mh, host)
