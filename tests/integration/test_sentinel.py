"""Redis under Sentinel (``MESHSERVE_REDIS_SENTINELS``): a primary, a replica and three
Sentinels (real ``redis-server`` processes on loopback ports of their own), a cluster manager
finding the primary through them. The primary is killed outright: the Sentinels promote the
replica, the cluster manager's next commands reach it, and what was written before the kill
is there. Skipped where ``redis-server`` is not installed."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from services.cluster_manager.service import ClusterManager
from shared.embedded import free_port
from shared.leader import CLUSTER_MANAGER
from shared.messages.cluster import ClusterView
from shared.store import Store
from shared.subjects import Keys, Subjects
from tests.integration.services import BusClient, Running, fast_settings

pytestmark = [pytest.mark.nats]

MASTER = "meshserve"


class Servers:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, *args: str) -> None:
        binary = shutil.which("redis-server")
        assert binary is not None
        log = (self.root / f"{name}.log").open("wb")
        self.procs[name] = subprocess.Popen(
            [binary, *args], stdout=log, stderr=subprocess.STDOUT, cwd=self.root
        )

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[tuple[Servers, int, int, list[str]]]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed: no Sentinels to run")
    servers = Servers(tmp_path)
    primary, replica = free_port(), free_port()
    plain = ("--save", "", "--appendonly", "no", "--bind", "127.0.0.1")
    servers.start("primary", "--port", str(primary), *plain)
    servers.start(
        "replica", "--port", str(replica), *plain, "--replicaof", "127.0.0.1", str(primary)
    )
    addresses = []
    for i in range(3):
        port = free_port()
        conf = tmp_path / f"sentinel-{i}.conf"
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\n"
            f"sentinel monitor {MASTER} 127.0.0.1 {primary} 2\n"
            f"sentinel down-after-milliseconds {MASTER} 1000\n"
            f"sentinel failover-timeout {MASTER} 5000\n"
        )
        servers.start(f"sentinel-{i}", str(conf), "--sentinel")
        addresses.append(f"127.0.0.1:{port}")
    try:
        yield servers, primary, replica, addresses
    finally:
        servers.stop()


async def _known(sentinels: list[str], replica: int) -> bool:
    """Whether every Sentinel lists the replica, up and linked to the primary."""
    for address in sentinels:
        host, _, port = address.rpartition(":")
        client = aioredis.Redis(host=host, port=int(port), socket_timeout=1)
        try:
            replicas = await client.execute_command("SENTINEL", "REPLICAS", MASTER)
        finally:
            await client.aclose()
        if not any(_good(r, replica) for r in replicas):
            return False
    return True


def _good(entry: object, port: int) -> bool:
    fields = entry if isinstance(entry, dict) else dict(zip(entry[::2], entry[1::2], strict=True))  # type: ignore[index]
    text = {_s(k): _s(v) for k, v in fields.items()}
    return text.get("port") == str(port) and not {"s_down", "disconnected"} & set(
        text.get("flags", "").split(",")
    )


def _s(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _logs(root: Path) -> str:
    return "\n".join(
        f"== {log.name}\n" + "\n".join(log.read_text().splitlines()[-25:])
        for log in sorted(root.glob("*.log"))
    )


async def _until(what: str, check: Callable[[], Awaitable[object]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if await check():
                return
        await asyncio.sleep(0.2)
    raise AssertionError(f"not within {timeout} s: {what}")


async def test_a_failover_is_followed_through_the_sentinels(
    cluster: str,
    nats_url: str,
    tmp_path: Path,
    sentinels: tuple[Servers, int, int, list[str]],
) -> None:
    servers, primary, replica, addresses = sentinels
    # The URL's host is not used (a port nothing listens on): the Sentinels name the primary.
    url = f"redis://127.0.0.1:{free_port()}/0"
    settings = fast_settings(
        cluster,
        nats_url,
        url,
        tmp_path,
        redis_sentinels=addresses,
        redis_master=MASTER,
        leader_lease=timedelta(seconds=1),
    )
    probe: Store | None = None

    async def primary_is(port: int) -> bool:
        nonlocal probe
        if probe is None:
            probe = await Store.for_settings(settings)
        pool = probe.redis.connection_pool
        return await pool.get_master_address() == ("127.0.0.1", port)  # type: ignore[attr-defined,no-any-return]

    await _until("the Sentinels name the primary", lambda: primary_is(primary), 20)
    assert probe is not None
    run = Running(settings, nats_url)
    views: list[ClusterView] = []
    try:
        store = await Store.for_settings(settings)
        cm: ClusterManager = await run.start(
            lambda bus: ClusterManager(settings=settings, bus=bus, store=store)
        )
        client: BusClient = await run.start(lambda bus: BusClient(settings, bus))
        await client.started.wait()

        async def on_view(v: ClusterView) -> None:
            views.append(v)

        sub = await client.bus.subscribe(Subjects(cluster).view(), {ClusterView: on_view})

        async def leads() -> bool:
            return cm.lease.leading()

        await _until("the cluster manager leads", leads, 10)
        await probe.redis.set(f"{cluster}:before", b"1")

        async def replicated() -> bool:  # on the replica too
            assert probe is not None
            return await probe.redis.execute_command("WAIT", 1, 1000) == 1  # type: ignore[no-any-return]

        await _until("the write reaches the replica", replicated, 20)
        # A Sentinel learns of replicas from the primary's INFO, every 10 s: killed before
        # they all know it, they find "no good replica" to promote.
        await _until("every Sentinel knows the replica", lambda: _known(addresses, replica), 30)
        servers.kill("primary")
        killed = time.monotonic()
        await _until("the Sentinels promoted the replica", lambda: primary_is(replica), 30)

        async def writes() -> bool:
            assert probe is not None
            return bool(await probe.redis.set(f"{cluster}:after", b"1"))

        await _until("a write reaches the new primary", writes, 30)

        async def kept() -> bool:
            assert probe is not None
            return await probe.redis.get(f"{cluster}:before") == b"1"

        await _until("what was written before the kill is there", kept, 10)
        # The cluster manager follows: its lease is renewed (or taken again) on the new
        # primary, and its views go on.
        epoch_key = Keys(cluster).leader_epoch(CLUSTER_MANAGER)

        async def renewed() -> bool:
            assert probe is not None
            return cm.lease.leading() and await probe.redis.exists(epoch_key) == 1

        await _until("the cluster manager leads on the new primary", renewed, 20)
        views.clear()

        async def pushed() -> bool:  # a view under the epoch it leads with now
            return bool(views) and views[-1].version >> 32 == cm.lease.epoch

        await _until("the cluster manager pushes views again", pushed, 20)
        print(f"failover followed {time.monotonic() - killed:.1f} s after the kill")
        await sub.close()
    except AssertionError:
        print(_logs(tmp_path))  # what the Sentinels and servers saw
        raise
    finally:
        await run.stop()
        if probe is not None:
            await probe.close()
