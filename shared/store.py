"""The Redis store. Every key goes through shared.subjects.Keys, so it starts with the
cluster name."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis

from shared.errors import Unavailable


class Store:
    def __init__(self, client: aioredis.Redis) -> None:
        self.redis = client

    @classmethod
    async def connect(cls, url: str) -> Store:
        client = aioredis.from_url(url, decode_responses=False, socket_connect_timeout=5)
        try:
            await client.ping()
        except Exception as e:
            await client.aclose()
            raise Unavailable(f"redis at {redacted(url)} is unreachable: {e}") from e
        return cls(client)

    async def replace_hash(self, key: str, mapping: dict[str, bytes]) -> None:
        """Set a hash to exactly this mapping, atomically."""
        async with self.redis.pipeline(transaction=True) as p:
            p.delete(key)
            if mapping:
                fields: dict[Any, Any] = dict(mapping)  # redis-py's mapping type is invariant
                p.hset(key, mapping=fields)
            await p.execute()

    async def hash_items(self, key: str) -> dict[str, bytes]:
        raw = await self.redis.hgetall(key)
        return {_text(k): v if isinstance(v, bytes) else v.encode() for k, v in raw.items()}

    async def close(self) -> None:
        await self.redis.aclose()


def redacted(url: str) -> str:
    """The URL without its user name and password, for logs and error messages."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
