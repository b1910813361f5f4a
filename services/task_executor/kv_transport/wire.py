"""The KV transport's wire: frames on a TCP connection between a decode TE (the puller) and a
prefill TE (the server), and the non-blocking socket I/O both ends do on their event loops.

A frame is an 8-byte prefix (header length, payload length: little-endian u32 each), a
msgpack header (one of the message structs below, tagged by type) and, for ``Data`` only, a
raw payload: the K rows then the V rows of one layer's token range. Payloads are never
decoded or copied by this module: the sender hands the tensors' memory to ``sendmsg`` and
the receiver ``recv_into``s the slice of its result tensor the header names.

The exchange: the puller sends ``Pull`` (or ``Reject``), the server answers ``Meta`` (how the
KV will come: over this connection, or in place in the server's arena in /dev/shm, which
``Meta`` names) or ``Error``; then, over TCP, ``Data`` frames as the prefill computes; and
``Done`` once every layer's range has been sent (or written into the arena). The puller
sends ``Renew`` while it waits and ``Release`` once it holds everything (over shared memory:
once it has read all it will read of the arena). An ``Error`` frame ends a pull at any
point, and the connection with it. After a ``Release`` the server answers ``Ok`` and the
connection may carry the puller's next ``Pull`` (``connections.py``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import struct
from collections.abc import Sequence
from typing import Any

import msgspec

PREFIX = struct.Struct("<II")
# A header holds at most a request's token ids (a few hundred KiB for 100k tokens).
MAX_HEADER = 64 << 20
# sendmsg takes at most IOV_MAX (1024 on Linux) buffers a call.
MAX_BUFFERS = 1000
SOCKET_BUFFER = 4 << 20
# One sendmsg at most: on loopback the receiver is woken on the sender's core and waits for
# the call to end, so a call the size of the socket buffer (8 MiB) idles the receiver.
CALL_BYTES = 1 << 20


class ProtocolError(Exception):
    """The peer sent something this side cannot take: the connection is dropped."""


class ConnectionClosed(ProtocolError):
    """The peer closed the connection (mid-frame or between frames)."""


# --- the puller's messages ------------------------------------------------------------------


class Pull(msgspec.Struct, tag="pull"):
    """Send me ``key``'s KV from token ``skip_tokens`` on. ``probe_path``/``probe``: a file
    the puller wrote in /dev/shm and its bytes: shared memory is used if the server reads the
    same bytes there (same host, or /dev/shm shared across network namespaces).
    ``same_host_as_before``: no probe, use shared memory if an earlier pull's probe on this
    connection found it shared. Neither: over this connection."""

    key: str
    skip_tokens: int
    probe_path: str | None = None
    probe: bytes | None = None
    same_host_as_before: bool = False


class Reject(msgspec.Struct, tag="reject"):
    key: str
    reason: str


class Renew(msgspec.Struct, tag="renew"):
    pass


class Release(msgspec.Struct, tag="release"):
    pass


# --- the server's messages ------------------------------------------------------------------


class Meta(msgspec.Struct, tag="meta"):
    """How the KV comes. The result is ``[num_layers, 2, capacity, num_kv_heads, head_dim]``
    holding tokens ``[first_token, first_token + capacity)``. Over shared memory
    (``transport == "shm"``) the KV lies in the file ``arena``, laid out ``[num_layers, 2,
    num_prompt_tokens, num_kv_heads, head_dim]`` from its first byte; the puller reads the
    tokens it asked for there, once ``Done`` has come."""

    transport: str  # "shm" or "tcp"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    num_prompt_tokens: int
    first_token: int
    capacity: int
    arena: str | None = None


class Data(msgspec.Struct, tag="data"):
    """Tokens ``[start, start + ntok)`` of ``layer``; the payload is K's rows then V's."""

    layer: int
    start: int
    ntok: int


class Done(msgspec.Struct, tag="done"):
    token_ids: list[int]
    num_computed_tokens: int
    finish_reason: str | None


class Error(msgspec.Struct, tag="error"):
    reason: str


class Ok(msgspec.Struct, tag="ok"):
    pass


ToServer = Pull | Reject | Renew | Release
ToClient = Meta | Data | Done | Error | Ok

_encoder = msgspec.msgpack.Encoder()
_to_server = msgspec.msgpack.Decoder(ToServer)
_to_client = msgspec.msgpack.Decoder(ToClient)


def frame_head(msg: ToServer | ToClient, payload_bytes: int = 0) -> bytes:
    header = _encoder.encode(msg)
    return PREFIX.pack(len(header), payload_bytes) + header


# --- socket I/O on an event loop ------------------------------------------------------------


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (``"[::1]:port"`` for IPv6) -> ``(host, port)``."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"not a host:port address: {address!r}")
    return host.strip("[]"), int(port)


async def connect(address: str) -> socket.socket:
    loop = asyncio.get_running_loop()
    host, port = parse_address(address)
    addrs: list[tuple[int, Any]]
    try:  # a numeric address (the usual case) needs no resolver thread
        ip = ipaddress.ip_address(host)
        addrs = [(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, (host, port))]
    except ValueError:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        addrs = [(info[0], info[4]) for info in infos]
    last: OSError = OSError(f"no address for {address}")
    for family, addr in addrs:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        # Before the connection: the window scale is agreed on in the handshake.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
        try:
            await loop.sock_connect(sock, addr)
        except OSError as e:
            sock.close()
            last = e
            continue
        tune(sock)
        return sock
    raise last


def tune(sock: socket.socket) -> None:
    """Small control frames (a renewal, ``Done``) must not wait behind Nagle's algorithm."""
    sock.setblocking(False)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def send_buffers(sock: socket.socket, buffers: Sequence[memoryview | bytes]) -> None:
    """All of ``buffers``, in order, by ``sendmsg`` calls of up to ``CALL_BYTES`` (the
    payloads go from the tensors' memory into the kernel: no copy in user space)."""
    loop = asyncio.get_running_loop()
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    i = 0
    while i < len(views):
        try:
            sent = sock.sendmsg(_upto(views, i, CALL_BYTES))
        except (BlockingIOError, InterruptedError):
            await _writable(loop, sock)
            continue
        while sent:
            if sent >= len(views[i]):
                sent -= len(views[i])
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0


def _upto(views: list[memoryview], i: int, limit: int) -> list[memoryview]:
    """The views from ``i`` on, cut after ``limit`` bytes (and ``MAX_BUFFERS`` views)."""
    out, size = [], 0
    for v in views[i : i + MAX_BUFFERS]:
        out.append(v[: limit - size])
        size += len(out[-1])
        if size >= limit:
            break
    return out


async def _writable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    ready: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()
    loop.add_writer(fd, _wake, ready)
    try:
        await ready
    finally:
        loop.remove_writer(fd)


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    ready: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()
    loop.add_reader(fd, _wake, ready)
    try:
        await ready
    finally:
        loop.remove_reader(fd)


def _wake(ready: asyncio.Future[None]) -> None:
    if not ready.done():
        ready.set_result(None)


async def send(sock: socket.socket, msg: ToServer | ToClient) -> None:
    await send_buffers(sock, [frame_head(msg)])


async def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Exactly ``len(view)`` bytes into ``view``. Each read is tried first and the loop is
    asked to wait only when nothing is there (``loop.sock_recv_into`` waits for the loop's
    poll before every read under uvloop: a loop iteration per read)."""
    loop = asyncio.get_running_loop()
    while len(view):
        try:
            n = sock.recv_into(view)
        except (BlockingIOError, InterruptedError):
            await _readable(loop, sock)
            continue
        if n == 0:
            raise ConnectionClosed("the peer closed the connection")
        view = view[n:]


async def _recv_header(sock: socket.socket) -> tuple[bytes, int]:
    prefix = bytearray(PREFIX.size)
    await recv_into(sock, memoryview(prefix))
    header_len, payload_len = PREFIX.unpack(prefix)
    if header_len > MAX_HEADER:
        raise ProtocolError(f"a {header_len}-byte frame header")
    header = bytearray(header_len)
    await recv_into(sock, memoryview(header))
    return bytes(header), payload_len


async def recv_from_client(sock: socket.socket) -> ToServer:
    header, payload_len = await _recv_header(sock)
    if payload_len:
        raise ProtocolError("a puller's frame with a payload")
    try:
        msg: ToServer = _to_server.decode(header)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"bad frame from the puller: {e}") from e
    return msg


async def recv_from_server(sock: socket.socket) -> tuple[ToClient, int]:
    """The next message and the length of its payload (the caller reads the payload)."""
    header, payload_len = await _recv_header(sock)
    try:
        msg = _to_client.decode(header)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"bad frame from the server: {e}") from e
    if payload_len and not isinstance(msg, Data):
        raise ProtocolError(f"a {type(msg).__name__} frame with a payload")
    return msg, payload_len
