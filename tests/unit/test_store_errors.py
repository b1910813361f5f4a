"""A Redis command's failures as the callers see them (shared/store.py): counted by kind, and
redis-py's event-loop error for a connection closed under it (after a Sentinel failover to a
host that had been cut off) turned into the ConnectionError every caller handles, rather
than an error that stops a service's background task."""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis
import redis.exceptions

from shared.infra_metrics import REDIS_ERRORS
from shared.store import MeteredRedis

CLOSED = "unable to perform operation on <TCPTransport closed=True>; the handler is closed"


def _connection_errors() -> float:
    return REDIS_ERRORS.labels("connection")._value.get()  # type: ignore[attr-defined,no-any-return]


async def test_a_transport_closed_under_a_command_is_a_lost_connection(monkeypatch) -> None:
    async def closed(self: Any, *args: Any, **options: Any) -> Any:
        raise RuntimeError(CLOSED)

    monkeypatch.setattr(aioredis.Redis, "execute_command", closed)
    client = MeteredRedis()
    before = _connection_errors()
    with pytest.raises(redis.exceptions.ConnectionError, match="connection lost"):
        await client.get("k")
    assert _connection_errors() == before + 1


async def test_other_runtime_errors_are_not_hidden(monkeypatch) -> None:
    async def bug(self: Any, *args: Any, **options: Any) -> Any:
        raise RuntimeError("something else")

    monkeypatch.setattr(aioredis.Redis, "execute_command", bug)
    with pytest.raises(RuntimeError, match="something else"):
        await MeteredRedis().get("k")
