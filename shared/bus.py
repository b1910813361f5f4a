"""The bus: typed request/reply, publish and subscribe over NATS.

Messages are msgpack-encoded tagged Structs. A handler returns a reply Message (or
None); a MeshserveError it raises travels back as an ErrorReply and is raised again on
the caller's side, so a remote failure looks like a local one. Transport failures (no
responder, timeout, closed connection) become PeerUnreachable: the caller cannot tell
whether the peer acted on the call; only its subclass NoResponder (nobody subscribed)
says that nobody did. A request id given to publish or request travels in a
header and is bound to the logs of the handler on the other side."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import msgspec
import nats
import nats.errors
import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from shared import tracing
from shared.errors import (
    BadRequest,
    Internal,
    MeshserveError,
    NoResponder,
    PeerUnreachable,
    from_reply,
)
from shared.infra_metrics import BUS_ERRORS
from shared.logging import get_logger
from shared.messages.api import ErrorReply
from shared.messages.base import Message, decoder_for, encode
from shared.subjects import inbox_prefix

log = get_logger(__name__)

M = TypeVar("M", bound=Message)
Handler = Callable[[Any], Awaitable[Message | None]]

REQUEST_ID_HEADER = "Meshserve-Request-Id"


class Subscription:
    def __init__(self, sub: Any, tasks: set[asyncio.Task[None]]) -> None:
        self._sub = sub
        self._tasks = tasks

    async def close(self) -> None:
        """Stop receiving; wait for handlers already running."""
        try:
            await self._sub.unsubscribe()
        except nats.errors.Error:
            pass
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


# A server that stops answering (its host cut off: no TCP reset) is left after this many
# unanswered pings; a connect attempt gives up after CONNECT_TIMEOUT_S (a server across a
# LAN answers in milliseconds), and the client pauses RECONNECT_WAIT_S between rounds.
MAX_OUTSTANDING_PINGS = 2
CONNECT_TIMEOUT_S = 2.0
RECONNECT_WAIT_S = 0.5


class Bus:
    def __init__(self, nc: NatsClient) -> None:
        self._nc = nc
        self._subs: list[Subscription] = []
        # Called on losing the server and on getting it back (subscriptions in place again).
        # Core NATS delivers at most once: what was in flight then is gone, and a caller
        # waiting for messages (a token stream) must hear it rather than wait for ever.
        self.on_disconnected: list[Callable[[], None]] = []
        self.on_reconnected: list[Callable[[], None]] = []
        self.failover_s = 0.0  # how long moving to another server of the cluster may take

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        name: str,
        cluster: str,
        role: str | None = None,
        ping_interval: float = 1.0,
    ) -> Bus:
        """``url``: one server, or several comma-separated (the servers of a NATS cluster: the
        client connects to one and moves to another when it is lost; a cluster's servers
        also tell it of the others). ``role``: the service's role (``shared.access``), which
        names its reply inboxes: authenticated NATS lets a role subscribe to its own only.
        ``ping_interval``: seconds between pings; two unanswered and the server is taken for
        lost (``membership.nats_ping_interval``)."""
        listeners: list[Bus] = []

        async def disconnected() -> None:
            BUS_ERRORS.labels("disconnected").inc()
            for bus in listeners:
                for cb in list(bus.on_disconnected):
                    cb()

        async def reconnected() -> None:
            for bus in listeners:
                for cb in list(bus.on_reconnected):
                    cb()

        async def error(e: Exception) -> None:
            BUS_ERRORS.labels("client").inc()
            log.warning("nats client error", error=f"{type(e).__name__}: {e}")

        servers = [u.strip() for u in url.split(",") if u.strip()]
        if not servers:  # (nats.py would retry its default server forever, spinning)
            raise ValueError("no NATS server to connect to (an empty URL)")
        nc = await nats.connect(
            servers,
            name=name,
            # Reply inboxes carry the cluster name too, like every other subject.
            inbox_prefix=inbox_prefix(cluster, role),
            max_reconnect_attempts=-1,
            reconnect_time_wait=RECONNECT_WAIT_S,
            connect_timeout=CONNECT_TIMEOUT_S,
            ping_interval=ping_interval,
            max_outstanding_pings=MAX_OUTSTANDING_PINGS,
            allow_reconnect=True,
            disconnected_cb=disconnected,
            reconnected_cb=reconnected,
            error_cb=error,
        )
        bus = cls(nc)
        if len(servers) > 1:
            # Lost to found again on another server of the cluster: the pings that go
            # unanswered, one connect attempt to a server that does not answer either (a cut
            # host's), the pause. (One server: there is no other to move to.)
            bus.failover_s = (
                ping_interval * (MAX_OUTSTANDING_PINGS + 1) + CONNECT_TIMEOUT_S + RECONNECT_WAIT_S
            )
        listeners.append(bus)
        return bus

    @property
    def connected(self) -> bool:
        return self._nc.is_connected

    def new_inbox(self) -> str:
        return self._nc.new_inbox()

    async def publish(self, subject: str, msg: Message, *, request_id: str | None = None) -> None:
        headers = _headers(request_id)
        try:
            await self._nc.publish(subject, encode(msg), headers=headers)
        except nats.errors.Error as e:
            BUS_ERRORS.labels("transport").inc()
            raise PeerUnreachable(f"bus publish on {subject} failed: {e}") from e

    async def request(
        self,
        subject: str,
        msg: Message,
        reply: type[M],
        *,
        timeout: float,
        request_id: str | None = None,
    ) -> M:
        headers = _headers(request_id)
        try:
            resp = await self._nc.request(subject, encode(msg), timeout=timeout, headers=headers)
        except nats.errors.NoRespondersError as e:
            BUS_ERRORS.labels("no_responder").inc()
            raise NoResponder(f"nobody serves {subject}") from e
        except (TimeoutError, nats.errors.TimeoutError) as e:
            BUS_ERRORS.labels("timeout").inc()
            raise PeerUnreachable(f"no reply on {subject} within {timeout:.1f}s") from e
        except nats.errors.Error as e:
            BUS_ERRORS.labels("transport").inc()
            raise PeerUnreachable(f"bus request on {subject} failed: {e}") from e
        try:
            out: M | ErrorReply = decoder_for(reply, ErrorReply).decode(resp.data)
        except msgspec.DecodeError as e:
            BUS_ERRORS.labels("undecodable").inc()
            raise Internal(f"undecodable reply on {subject}: {e}") from e
        if isinstance(out, ErrorReply):
            raise from_reply(out)
        return out

    async def subscribe(
        self,
        subject: str,
        handlers: Mapping[type[Message], Handler],
        *,
        queue: str | None = None,
        concurrent: bool = False,
    ) -> Subscription:
        """Dispatch each message to the handler of its type. With concurrent=True each
        message runs in its own task (for handlers that wait), else in arrival order."""
        decoder = decoder_for(*handlers)
        tasks: set[asyncio.Task[None]] = set()

        async def handle(m: Msg) -> None:
            # Logs of this handler carry the request id the frontend assigned, if any.
            request_id = (m.headers or {}).get(REQUEST_ID_HEADER)
            context = {"request_id": request_id} if request_id else {}
            token = tracing.attach(m.headers)  # the sender's span, the parent of its own
            try:
                with structlog.contextvars.bound_contextvars(**context):
                    reply = await dispatch(m)
            finally:
                tracing.detach(token)
            if m.reply and reply is not None:
                try:
                    await m.respond(encode(reply))
                except nats.errors.Error as e:
                    log.warning("reply failed", subject=subject, error=str(e))

        async def dispatch(m: Msg) -> Message | None:
            try:
                msg = decoder.decode(m.data)
            except msgspec.DecodeError as e:
                return BadRequest(f"undecodable message on {subject}: {e}").to_reply()
            try:
                return await handlers[type(msg)](msg)
            except MeshserveError as e:
                return e.to_reply()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.exception("handler failed", subject=subject, msg_type=type(msg).__name__)
                return Internal(f"{type(e).__name__}: {e}").to_reply()

        async def cb(m: Msg) -> None:
            if not concurrent:
                await handle(m)
                return
            t = asyncio.create_task(handle(m))
            tasks.add(t)
            t.add_done_callback(tasks.discard)

        sub = await self._nc.subscribe(subject, queue=queue or "", cb=cb)
        s = Subscription(sub, tasks)
        self._subs.append(s)
        return s

    async def subscribe_raw(
        self, subject: str, cb: Callable[[Msg], Awaitable[None]], *, unbounded: bool = False
    ) -> Any:
        """A plain subscription for hot paths that decode themselves (token streams).

        nats.py drops a subscription's messages (a slow consumer error) once 512 Ki of them,
        or 128 MiB, wait for its callback. ``unbounded`` lifts both, for a subscriber that must
        lose nothing and bounds what waits itself."""
        if unbounded:
            return await self._nc.subscribe(
                subject, cb=cb, pending_msgs_limit=0, pending_bytes_limit=0
            )
        return await self._nc.subscribe(subject, cb=cb)

    async def flush(self, timeout: int = 2) -> None:
        await self._nc.flush(timeout=timeout)

    async def close(self) -> None:
        for s in self._subs:
            await s.close()
        self._subs.clear()
        if not self._nc.is_closed:
            try:
                await self._nc.drain()
            except (TimeoutError, nats.errors.Error):
                await self._nc.close()


def _headers(request_id: str | None) -> dict[str, str] | None:
    """The request id, and the current span's trace context where one records."""
    headers = {REQUEST_ID_HEADER: request_id} if request_id else {}
    tracing.inject(headers)
    return headers or None
