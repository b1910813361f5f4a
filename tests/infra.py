"""Fixtures for tests that need real servers: NATS and Redis named by MESHSERVE_NATS_URL /
MESHSERVE_REDIS_URL, or embedded ones started for the session. Each test gets its own
cluster name, so parallel runs and earlier tests never see each other's subjects or keys."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from shared.bus import Bus
from shared.embedded import EmbeddedServer
from shared.store import Store


def _server(var: str, kind: str) -> Iterator[str]:
    url = os.environ.get(var)
    if url:
        yield url
        return
    with EmbeddedServer(kind) as server:
        yield server.url


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    yield from _server("MESHSERVE_NATS_URL", "nats")


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    yield from _server("MESHSERVE_REDIS_URL", "redis")


@pytest.fixture
def cluster() -> str:
    return f"test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def bus(nats_url: str, cluster: str) -> AsyncIterator[Bus]:
    b = await Bus.connect(nats_url, name="pytest", cluster=cluster)
    yield b
    await b.close()


@pytest.fixture
async def store(redis_url: str, cluster: str) -> AsyncIterator[Store]:
    s = await Store.connect(redis_url)
    yield s
    keys = [k async for k in s.redis.scan_iter(match=f"{cluster}:*")]
    if keys:
        await s.redis.delete(*keys)
    await s.close()
