"""meshserve on a NATS cluster (``MESHSERVE_NATS_URL`` with the URLs of three clustered
``nats-server`` processes on loopback ports of their own): a cluster from `meshserve up`
serves chat completions through the official openai client; the NATS server holding the
most of its connections is killed outright during 10 streams, every stream completes with
the greedy output of an undisturbed run, and the cluster serves on."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from devtools.chat import stream_greedy
from shared.embedded import free_port, nats_server_binary
from tests.e2e.conftest import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.slow]

PROMPTS = [f"Tell me about the number {i} and the sea." for i in range(10)]


class NatsCluster:
    def __init__(self, root: Path, size: int = 3) -> None:
        self.clients = [free_port() for _ in range(size)]
        self.routes = [free_port() for _ in range(size)]
        self.monitors = [free_port() for _ in range(size)]
        self.procs: list[subprocess.Popen[bytes] | None] = []
        for i in range(size):
            others = ",".join(f"nats://127.0.0.1:{p}" for j, p in enumerate(self.routes) if j != i)
            log = (root / f"nats-{i}.log").open("wb")
            argv = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.clients[i]),
                    "-m", str(self.monitors[i]), "--cluster_name", "meshserve-test",
                    "--cluster", f"nats://127.0.0.1:{self.routes[i]}", "--routes", others]  # fmt: skip
            self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))

    @property
    def url(self) -> str:
        return ",".join(f"nats://127.0.0.1:{p}" for p in self.clients)

    def _monitor(self, i: int, path: str) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.monitors[i]}{path}", timeout=2) as r:
            return json.load(r)

    def wait_formed(self, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                if all(self._monitor(i, "/routez")["num_routes"] >= 2 for i in range(3)):
                    return
            time.sleep(0.2)
        raise AssertionError("the NATS cluster did not form")

    def busiest(self) -> int:
        """The live server holding the most client connections."""
        live = [i for i, p in enumerate(self.procs) if p is not None]
        return max(live, key=lambda i: self._monitor(i, "/connz")["num_connections"])

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        assert proc is not None
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        self.procs[i] = None

    def stop(self) -> None:
        for proc in self.procs:
            if proc is not None:
                proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5)


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    c = NatsCluster(tmp_path)
    try:
        c.wait_formed()
        yield c
    finally:
        c.stop()


async def _stream(client: openai.AsyncOpenAI, prompt: str, seen: list[int] | None = None) -> str:
    return await stream_greedy(client, prompt, seen=seen)


async def test_streams_survive_a_nats_server_of_the_cluster_killed(
    e2e_models_dir: Path, redis_url: str, nats_cluster: NatsCluster
) -> None:
    c = Cluster(e2e_models_dir, nats_cluster.url, redis_url, keep_alive="30").start()
    try:
        client = openai.AsyncOpenAI(base_url=c.url, api_key="none", max_retries=0, timeout=180)
        reference = [await _stream(client, p) for p in PROMPTS]
        seen = [0]  # chunks received, all streams
        streams = [asyncio.create_task(_stream(client, p, seen)) for p in PROMPTS]
        deadline = time.monotonic() + 60
        while seen[0] < 10 * len(PROMPTS):  # mid-stream: ten chunks a stream, on average
            assert time.monotonic() < deadline, "the streams did not start"
            await asyncio.sleep(0.01)
        victim = nats_cluster.busiest()
        nats_cluster.kill(victim)
        t0 = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*streams), 180)
        print(f"NATS server {victim} killed; the streams ended {time.monotonic() - t0:.1f} s later")
        assert results == reference
        # And it serves on, on the two servers left.
        assert await _stream(client, PROMPTS[0]) == reference[0]
        await client.close()
    finally:
        c.stop()
