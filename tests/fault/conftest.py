"""Faults against a running local cluster (`meshserve up`, tests/e2e's Cluster) on NATS and
Redis of the fault tests' own, which a test may restart without disturbing anybody else's.

Every process is found by what it runs: the launcher starts `python -m services.<name>`,
the node pool `python -m services.task_executor.worker <te id> <pool id>`, each with
MESHSERVE_CLUSTER=<cluster> in its environment."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from devtools.procs import module_of
from shared.embedded import EmbeddedServer
from tests.e2e.conftest import Cluster, processes_of

# Every client call is bounded: a request that hangs fails its test instead of stalling it.
CALL_TIMEOUT_S = 60.0

MODEL = "demo"

# Service roles as `python -m <module>` names them.
ROLES = {
    "frontend": "services.frontend",
    "job_executor": "services.job_executor",
    "cluster_manager": "services.cluster_manager",
    "scaler": "services.scaler",
    "node_pool": "services.task_executor",
    "te": "services.task_executor.worker",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(here):
            for mark in ("fault", "e2e", "nats", "redis", "slow"):
                item.add_marker(mark)


def pids_of(cluster: Cluster, role: str) -> list[int]:
    """Live processes of one role in the cluster."""
    module = ROLES[role]
    return sorted(pid for pid in processes_of(cluster.name) if module_of(pid) == module)


def kill9(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def health(cluster: Cluster, timeout: float = 2.0) -> dict | None:
    """The frontend's /health body, or None while it does not answer or is not ready."""
    try:
        with urllib.request.urlopen(
            cluster.url.removesuffix("/v1") + "/health", timeout=timeout
        ) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def cluster_whole(cluster: Cluster) -> bool:
    """The view shows the whole cluster serving again: one JE, both TEs, the model."""
    body = health(cluster)
    return bool(
        body
        and body["status"] == "ok"
        and body["job_executors"] == 1
        and len(body["task_executors"]) == 2
        and body["models"] == ["demo"]
    )


def wait_for(what: str, check, timeout: float, every: float = 0.1):
    """Poll ``check()`` until it returns something truthy; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:g}s")
        time.sleep(every)


async def await_for(what: str, check, timeout: float, every: float = 0.1):
    """wait_for for a test running on the event loop (its requests go on meanwhile)."""
    deadline = time.monotonic() + timeout
    while True:
        got = await asyncio.to_thread(check)
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:g}s")
        await asyncio.sleep(every)


@dataclass(frozen=True)
class Req:
    """One greedy request; ``prompt`` differs per request, so each has its own output."""

    prompt: str
    stream: bool
    max_tokens: int = 300

    async def run(self, client: openai.AsyncOpenAI, on_chunk=None) -> str:
        """The generated text. ``on_chunk(n)`` is called with the chunks seen so far."""
        kw = dict(
            model=MODEL,
            messages=[{"role": "user", "content": self.prompt}],
            max_tokens=self.max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        if not self.stream:
            r = await client.chat.completions.create(**kw)
            assert r.choices[0].finish_reason == "length"
            assert r.usage.completion_tokens == self.max_tokens
            return r.choices[0].message.content or ""
        stream = await client.chat.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}
        )
        parts, usage, finish, n = [], None, None, 0
        async for c in stream:
            n += 1
            if c.usage is not None:
                usage = c.usage
            for choice in c.choices:
                parts.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
            if on_chunk is not None:
                on_chunk(n)
        assert finish == "length" and usage is not None
        assert usage.completion_tokens == self.max_tokens
        return "".join(parts)


PROMPTS = [
    "Tell me about the license of this program.",
    "How do I start a local cluster?",
    "What does the scaler do when a model is idle?",
    "Explain the job executor in one sentence.",
    "Which engines run on a CPU?",
    "Where do the weights of an idle model stay?",
]


def requests_for(tag: str, n: int = 4) -> list[Req]:
    """``n`` distinct requests, every other one streaming."""
    return [Req(f"{PROMPTS[i % len(PROMPTS)]} ({tag} {i})", stream=i % 2 == 0) for i in range(n)]


def client_of(cluster: Cluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=cluster.url, api_key="unused", max_retries=0, timeout=CALL_TIMEOUT_S
    )


async def references(cluster: Cluster, reqs: list[Req]) -> dict[Req, str]:
    """Each request's undisturbed greedy output, one at a time on the same cluster."""
    client = client_of(cluster)
    try:
        return {r: await asyncio.wait_for(r.run(client), CALL_TIMEOUT_S) for r in reqs}
    finally:
        await client.close()


@pytest.fixture(scope="module")
def fault_models_dir(tmp_path_factory, demo_model_dir: Path) -> Path:
    d = tmp_path_factory.mktemp("fault-models")
    (d / MODEL).symlink_to(demo_model_dir)
    return d


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[EmbeddedServer, EmbeddedServer]]:
    """NATS and Redis of this module's own: restarting them disturbs no other test."""
    with EmbeddedServer("nats") as nats, EmbeddedServer("redis") as redis:
        yield nats, redis


def start_cluster(models_dir: Path, nats: EmbeddedServer, redis: EmbeddedServer, tmp: Path):
    # The model stays loaded between tests (no scale-to-zero in the middle of a fault),
    # and a restarted service finds the cluster in its steady state.
    return Cluster(
        models_dir, nats.url, redis.url, stderr=tmp / "cluster.log", keep_alive="600"
    ).start()


async def under_load(cluster: Cluster, first: list[Req], second: list[Req], fault) -> dict:
    """Start ``first``, run ``fault()`` (awaited if a coroutine) once every stream among them is
    producing tokens, start ``second`` right after it (they arrive while the killed process
    is gone or coming back), and return each request's output or the error it ended with.
    Fails the test if any request is still running CALL_TIMEOUT_S later."""
    client = client_of(cluster)
    flowing: dict[Req, int] = {r: 0 for r in first if r.stream}

    def seen(r: Req):
        return lambda n: flowing.__setitem__(r, n)

    tasks = {r: asyncio.create_task(r.run(client, seen(r) if r.stream else None)) for r in first}
    try:
        await await_for(
            "the first requests streaming",
            lambda: (
                all(n >= 3 for n in flowing.values())
                or any(t.done() for r, t in tasks.items() if r.stream)
            ),
            CALL_TIMEOUT_S,
            every=0.02,
        )
        # The streams are in flight when the fault hits. A non-streaming request may be done
        # already on a loaded machine: its output is checked all the same.
        assert not any(t.done() for r, t in tasks.items() if r.stream), "streams ended early"
        # On this thread: a server it restarts must not die with a worker thread.
        if inspect.isawaitable(done := fault()):
            await done
        tasks |= {r: asyncio.create_task(r.run(client)) for r in second}
        _, pending = await asyncio.wait(tasks.values(), timeout=CALL_TIMEOUT_S + 10)
        assert not pending, f"{len(pending)} requests hung"
        return {r: t.exception() or t.result() for r, t in tasks.items()}
    finally:
        for t in tasks.values():
            t.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        await client.close()
