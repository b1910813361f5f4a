"""The Redis store. Every key goes through shared.subjects.Keys, so it starts with the
cluster name."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit, urlunsplit

import redis.asyncio as aioredis
import redis.asyncio.client
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialWithJitterBackoff

from shared.errors import Unavailable
from shared.infra_metrics import REDIS_ERRORS

if TYPE_CHECKING:
    from shared.settings import Settings


class Store:
    def __init__(self, client: aioredis.Redis) -> None:
        self.redis = client

    @classmethod
    async def connect(
        cls, url: str, *, sentinels: Sequence[str] = (), master: str = "meshserve"
    ) -> Store:
        """The Redis at ``url``; with ``sentinels``, the primary they monitor as ``master``
        (``url`` then gives the credentials and database), found again after a failover:
        a command that meets a lost connection or a demoted server asks them anew."""
        if sentinels:
            client = _through_sentinels(url, sentinels, master)
            where = f"the primary {master!r} of Sentinels {', '.join(sentinels)}"
        else:
            client = MeteredRedis.from_url(url, decode_responses=False, socket_connect_timeout=5)
            where = redacted(url)
        try:
            await client.ping()
        except Exception as e:
            await client.aclose()
            raise Unavailable(f"redis at {where} is unreachable: {e}") from e
        return cls(client)

    @classmethod
    async def for_settings(cls, settings: Settings) -> Store:
        """The cluster's Redis as the settings name it (its URL, or its Sentinels)."""
        if not settings.redis_url:
            raise Unavailable("MESHSERVE_REDIS_URL is not set")
        return await cls.connect(
            settings.redis_url, sentinels=settings.redis_sentinels, master=settings.redis_master
        )

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


# Under Sentinel the primary may be on a host that was cut off: no reset tells a client, so
# a command to it fails only by its timeout, and each of redis-py's retries (which ask the
# Sentinels for the primary anew) waits as long. A Sentinel or a primary on the network
# answers in milliseconds: a command is given PRIMARY_TIMEOUT_S and three tries, a Sentinel
# SENTINEL_TIMEOUT_S (one on a cut host is passed over for the next).
PRIMARY_TIMEOUT_S = 2.0
SENTINEL_TIMEOUT_S = 1.0


def _unquoted(part: str | None) -> str | None:
    return None if part is None else unquote(part)


def _through_sentinels(url: str, sentinels: Sequence[str], master: str) -> aioredis.Redis:
    parts = urlsplit(url)
    db = int(parts.path.strip("/") or 0)
    nodes = [(h, int(p)) for h, _, p in (s.rpartition(":") for s in sentinels)]
    username, password = _unquoted(parts.username), _unquoted(parts.password)
    # The URL's user logs into the Sentinels too, where they ask for one (infra-secrets'
    # sentinel.conf lets each role only look the primary up).
    asked = {
        "socket_connect_timeout": SENTINEL_TIMEOUT_S,
        "socket_timeout": SENTINEL_TIMEOUT_S,
        "username": username,
        "password": password,
    }
    sentinel = Sentinel(nodes, sentinel_kwargs=asked)  # type: ignore[no-untyped-call]
    client: aioredis.Redis = sentinel.master_for(
        master,
        redis_class=MeteredRedis,
        username=username,
        password=password,
        db=db,
        decode_responses=False,
        socket_connect_timeout=PRIMARY_TIMEOUT_S,
        socket_timeout=PRIMARY_TIMEOUT_S,
        retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), retries=3),
    )
    return client


def _count(e: BaseException) -> None:
    """One failed command or transaction in ``meshserve:redis_errors_total``."""
    if isinstance(e, redis.exceptions.NoScriptError):
        return  # a script's first call loads it: a step of the protocol, not a failure
    if isinstance(e, redis.exceptions.WatchError):
        REDIS_ERRORS.labels("watch").inc()
    elif isinstance(e, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)):
        REDIS_ERRORS.labels("connection").inc()
    elif isinstance(e, redis.exceptions.RedisError):
        REDIS_ERRORS.labels("refused").inc()


@contextlib.contextmanager
def _metered() -> Iterator[None]:
    """Count a failed command by kind and pass the error on; redis-py's event-loop error
    for a connection closed under it (``_lost``) becomes the ConnectionError it is."""
    try:
        yield
    except RuntimeError as e:
        if "closed" not in str(e):
            raise
        lost = _lost(e)
        _count(lost)
        raise lost from e
    except Exception as e:
        _count(e)
        raise


def _lost(e: RuntimeError) -> redis.exceptions.ConnectionError:
    """redis-py lets an event loop's error through where a Sentinel's connection was
    closed under it ("unable to perform operation on <TCPTransport closed=True>", seen after
    a failover to a host that had been cut off): a lost connection like any other, which
    every caller already handles, not a bug that should stop a service."""
    return redis.exceptions.ConnectionError(f"connection lost: {e}")


class MeteredPipeline(redis.asyncio.client.Pipeline):
    """A pipeline or transaction whose failures are counted (``MeteredRedis.pipeline``)."""

    async def immediate_execute_command(self, *args: Any, **options: Any) -> Any:
        with _metered():
            return await super().immediate_execute_command(*args, **options)  # type: ignore[no-untyped-call]

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        with _metered():
            return await super().execute(raise_on_error)


class MeteredRedis(aioredis.Redis):
    """redis-py's client, with each failed command counted by kind (the callers still get
    the error and decide what it means)."""

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        with _metered():
            return await super().execute_command(*args, **options)  # type: ignore[no-untyped-call]

    def pipeline(self, transaction: bool = True, shard_hint: str | None = None) -> Any:
        return MeteredPipeline(
            self.connection_pool, self.response_callbacks, transaction, shard_hint
        )


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
