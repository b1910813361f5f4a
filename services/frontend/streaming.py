"""Writing token streams to clients that may read slowly, or not at all.

aiohttp's ``StreamResponse.write`` applies back-pressure: once the socket's buffer and the
transport's (it pauses writing at 64 KiB) are full, a write waits until the client reads. A
handler waiting there holds up no other stream, and its tokens wait coalesced in its
attempt's inbox (``generation.Inbox``). But a client that never reads would keep its
generation, a TE batch slot, busy until the request's deadline. ``StallGuard`` ends such a
stream once one write has waited ``frontend.stall_timeout``: it aborts the connection, which
cancels the handler (the frontend runs with ``handler_cancellation``), whose cleanup cancels
the generation on its TE.

The kernel's socket buffer is bounded too: Linux grows a connection's send buffer up to
``net.ipv4.tcp_wmem``'s maximum (4 MiB by default, more than a whole long answer) for a
client that does not read. A stream's socket gets ``STREAM_SEND_BUFFER`` instead: at token
rates (KB/s) that covers any network's bandwidth-delay product.

One sweep every quarter of the timeout checks every open stream; a write only stamps the time
it started: no timer per stream or per token.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import socket
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager

from aiohttp import web
from prometheus_client import Counter, Gauge, Histogram

from shared.logging import get_logger

log = get_logger(__name__)

STALLED = Counter(
    "meshserve_stalled_streams",
    "Streams ended because one write to the client waited frontend.stall_timeout",
)
STREAM_DELAY = Histogram(
    "meshserve_stream_delay_seconds",
    "Time from a token's arrival at the frontend (from its TE) until its SSE event was "
    "handed to the client's connection: what the frontend adds to the inter-token latency",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30),
)

OPEN_STREAMS = Gauge("meshserve_open_streams", "SSE streams this frontend is writing")
WAITING_STREAMS = Gauge(
    "meshserve_waiting_streams",
    "SSE streams whose last write waits for the client to read (its buffers are full)",
)
# Asked of the kernel per stream socket (Linux doubles it for its bookkeeping).
STREAM_SEND_BUFFER = 64 * 1024


class StreamWriter:
    """Writes one response's events; ``since`` is when a write now waiting began."""

    __slots__ = ("_resp", "_transport", "request_id", "since", "task")

    def __init__(self, resp: web.StreamResponse, request: web.Request, request_id: str) -> None:
        self._resp = resp
        self._transport = request.transport
        self.request_id = request_id
        self.since: float | None = None
        self.task = asyncio.current_task()  # the handler writing it
        self._sock(socket.SO_SNDBUF, STREAM_SEND_BUFFER)

    async def write(self, data: bytes) -> None:
        self.since = time.monotonic()
        try:
            await self._resp.write(data)
        finally:
            self.since = None

    def abort(self) -> None:
        """Reset the connection: the bytes the client never read are dropped at once, not
        kept by the kernel until it gives up on a peer that reads nothing."""
        self._sock(socket.SO_LINGER, struct.pack("ii", 1, 0))
        if self._transport is not None:
            self._transport.abort()

    def _sock(self, option: int, value: int | bytes) -> None:
        sock = self._transport.get_extra_info("socket") if self._transport else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, option, value)


class StallGuard:
    def __init__(self, stall_timeout_s: float) -> None:
        self.stall_timeout_s = stall_timeout_s
        self._writers: set[StreamWriter] = set()
        self._none_open = asyncio.Event()
        self._none_open.set()
        OPEN_STREAMS.set_function(lambda: len(self._writers))
        WAITING_STREAMS.set_function(self.waiting)

    @property
    def streams(self) -> int:
        return len(self._writers)

    def waiting(self) -> int:
        return sum(w.since is not None for w in self._writers)

    @contextmanager
    def open(
        self, resp: web.StreamResponse, request: web.Request, request_id: str
    ) -> Iterator[StreamWriter]:
        writer = StreamWriter(resp, request, request_id)
        self._writers.add(writer)
        self._none_open.clear()
        try:
            yield writer
        finally:
            self._discard(writer)

    def _discard(self, writer: StreamWriter) -> None:
        self._writers.discard(writer)
        if not self._writers:
            self._none_open.set()

    def sweep(self, now: float) -> int:
        """End the streams whose write has waited the timeout; how many it ended."""
        stalled = [
            w
            for w in self._writers
            if w.since is not None and now - w.since >= self.stall_timeout_s
        ]
        for w in stalled:
            self._discard(w)
            log.warning(
                "client stalled: stream ended",
                request_id=w.request_id,
                waited_s=round(now - (w.since or now), 1),
            )
            STALLED.inc()
            w.abort()
        return len(stalled)

    async def drain(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for the open streams to end; how many are still open."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._none_open.wait(), timeout_s)
        return len(self._writers)

    def interrupt_all(self) -> None:
        """Cancel the handler of every open stream (the frontend is stopping): each ends its
        stream with an error event while its connection is still open."""
        for w in list(self._writers):
            if w.task is not None:
                w.task.cancel()

    async def run(self) -> None:
        period = self.stall_timeout_s / 4
        while True:
            await asyncio.sleep(period)
            self.sweep(time.monotonic())


def raise_open_files_limit() -> int:
    """The soft limit on open files raised to the hard one (each stream holds a socket; a
    soft limit of 1024, common, caps a frontend below that many streams). The limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            log.warning("could not raise the open files limit", soft=soft, hard=hard, error=str(e))
    return soft
