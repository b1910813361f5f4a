"""The decode side of the KV data plane: pull one task's KV from the prefill TE that holds it
(``server.KvServer``), or tell it the KV will not be taken.

A pull keeps the prefill side's lease alive while the prefill computes (a renewal every
``renew_s``), writes each range into its place as it arrives, in whatever order the layers
come, and releases the lease once ``Done`` has come (the server sends it only after every
layer's range). Every failure (no connection, an error from the server, the connection
dropping, nothing complete within ``deadline_s``, the caller cancelling) closes the
connection, which ends the lease on the prefill side: the KV there is freed either way. A
pull that completed keeps its connection for the next pull to the same TE
(``connections.py``).

Over TCP the payloads are received straight into the result tensor's memory. Over shared
memory the server writes into a segment of this process's (``pool.py``) and the result is a
tensor over it: no copy on this side at all. The segment goes back to the pool when the
result and every view of it are gone, so a caller copies what it needs into its KV cache and
drops the result (holding it holds the segment: the pool then makes new ones).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import time

import torch

from services.task_executor.dtypes import DTYPES
from services.task_executor.kv_transport import shm as shm_files
from services.task_executor.kv_transport import wire
from services.task_executor.kv_transport.connections import (
    Connection,
    Connections,
    default_connections,
)
from services.task_executor.kv_transport.pool import Lent, SegmentPool, default_pool


class TransferFailed(Exception):
    """A pull (or a rejection) that did not complete; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclasses.dataclass(slots=True, eq=False)
class Pulled:
    """A pulled KV: ``kv`` is ``[num_layers, 2, num_computed_tokens - first_token,
    num_kv_heads, head_dim]``, the tokens ``[first_token, num_computed_tokens)``."""

    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    first_token: int
    finish_reason: str | None
    dtype: torch.dtype
    kv: torch.Tensor
    transport: str  # "shm" or "tcp"
    nbytes: int  # KV bytes that came (a range sent twice counts twice)
    seconds: float


async def pull(
    address: str,
    key: str,
    *,
    skip_tokens: int,
    deadline_s: float,
    renew_s: float,
    shm: bool = True,
    pool: SegmentPool | None = None,
    connections: Connections | None = None,
    expect_bytes: int = 0,
) -> Pulled:
    """``key``'s KV from the server at ``address`` ("host:port"), from token ``skip_tokens``
    on (the tokens before are held here already; none of their KV is sent). ``shm``: use
    shared memory if the server is on this host, with segments of ``pool`` (this process's
    ``default_pool()`` unless given); over a kept connection of ``connections`` (the event
    loop's ``default_connections()`` unless given) or a new one. ``expect_bytes``: the KV's
    size as this side reckons it (the layout and the tokens past ``skip_tokens``): a segment
    of that size is named in the request, so the server starts writing at once (0: it is
    named once the server has said the size). ``TransferFailed`` on any failure."""
    if skip_tokens < 0:
        raise ValueError("skip_tokens must not be negative")
    started = time.perf_counter()
    segments = (pool or default_pool()) if shm else None
    conns = connections or default_connections()
    try:
        async with asyncio.timeout(deadline_s):
            return await _Pull(
                address, key, skip_tokens, renew_s, segments, conns, expect_bytes, started
            ).run()
    except TimeoutError as e:
        raise TransferFailed(f"no complete KV from {address} within {deadline_s} s") from e


async def reject(address: str, key: str, reason: str, *, timeout_s: float = 5.0) -> None:
    """Tell the server at ``address`` that ``key``'s KV will not be taken (its lease ends
    with ``"rejected: <reason>"``). ``TransferFailed`` if it could not be told (the lease
    ends anyway, by expiry, if the server is alive)."""
    sock: socket.socket | None = None
    try:
        async with asyncio.timeout(timeout_s):
            sock = await wire.connect(address)
            await wire.send(sock, wire.Reject(key, reason))
            msg, _ = await wire.recv_from_server(sock)
    except (OSError, wire.ProtocolError) as e:  # TimeoutError is an OSError
        raise TransferFailed(f"could not reject {key!r} at {address}: {e}") from e
    finally:
        if sock is not None:
            sock.close()
    if isinstance(msg, wire.Error):
        raise TransferFailed(msg.reason)


class _Pull:
    def __init__(
        self,
        address: str,
        key: str,
        skip_tokens: int,
        renew_s: float,
        pool: SegmentPool | None,
        connections: Connections,
        expect_bytes: int,
        started: float,
    ) -> None:
        self.address, self.key, self.skip = address, key, skip_tokens
        self.renew_s, self.pool, self.started = renew_s, pool, started
        self.connections, self.expect_bytes = connections, expect_bytes
        self.meta_received = False
        self.conn: Connection | None = None
        self.sock: socket.socket | None = None
        self.segment: Lent | None = None
        self.nbytes = 0

    async def run(self) -> Pulled:
        renewer: asyncio.Task[None] | None = None
        kept = False
        try:
            meta = await self._open()
            stop_renewing = asyncio.Event()
            renewer = asyncio.create_task(self._renew(stop_renewing), name=f"kv-renew-{self.key}")
            kv, done = await self._receive(meta)
            stop_renewing.set()  # (a renewal being sent is finished first: no half frame)
            await renewer
            try:
                await wire.send(self._socket(), wire.Release())
            except OSError:  # everything is here: the release is a courtesy
                pass
            else:
                assert self.conn is not None
                self.connections.released(self.conn)
                kept = True
        except (OSError, wire.ProtocolError) as e:
            raise TransferFailed(f"KV {self.key!r} from {self.address}: {e}") from e
        finally:
            if renewer is not None:
                renewer.cancel()
            if self.conn is not None and not kept:
                self.conn.close()
            if self.segment is not None:
                self.segment.discard()  # (after the result was taken, a no-op)
        n = done.num_computed_tokens
        first = min(meta.first_token, n)
        return Pulled(
            token_ids=done.token_ids,
            num_prompt_tokens=meta.num_prompt_tokens,
            num_computed_tokens=n,
            first_token=first,
            finish_reason=done.finish_reason,
            dtype=kv.dtype,
            kv=kv[:, :, : n - first],
            transport=meta.transport,
            nbytes=self.nbytes,
            seconds=time.perf_counter() - self.started,
        )

    def _socket(self) -> socket.socket:
        assert self.sock is not None
        return self.sock

    async def _open(self) -> wire.Meta:
        """A connection and the server's ``Meta``. A kept connection the server closed
        while it waited fails before the server has read anything: once, a new one."""
        while True:
            try:
                self.conn = await self.connections.get(self.address)
            except OSError as e:
                raise TransferFailed(f"cannot connect to {self.address}: {e}") from e
            self.sock = self.conn.sock
            try:
                return await self._ask(self.conn)
            except (OSError, wire.ConnectionClosed):
                if not self.conn.reused or self.meta_received:
                    raise
                self.conn.close()  # no Meta came: the server had not taken the pull
                if self.segment is not None:
                    self.segment.discard()
                    self.segment = None

    async def _ask(self, conn: Connection) -> wire.Meta:
        sock = self._socket()
        probe = None
        if self.pool is not None and conn.same_host is None:
            probe = shm_files.make_probe()
        if self.pool is not None and conn.same_host is not False and self.expect_bytes > 0:
            self.segment = self.pool.lend(self.expect_bytes)
        try:
            path, data = (str(probe[0]), probe[1]) if probe is not None else (None, None)
            again = self.pool is not None and conn.same_host is True
            named = self.segment.path if self.segment is not None else None
            await wire.send(sock, wire.Pull(self.key, self.skip, path, data, again, named))
            msg, _ = await wire.recv_from_server(sock)
        finally:
            if probe is not None:
                shm_files.remove(probe[0])
        self.meta_received = isinstance(msg, wire.Meta)
        if isinstance(msg, wire.Error):
            if self.segment is not None:  # refused before anything was taken
                self.segment.unused()
                self.segment = None
            raise TransferFailed(msg.reason)
        if not isinstance(msg, wire.Meta):
            raise wire.ProtocolError(f"a {type(msg).__name__} where Meta was due")
        if msg.dtype not in DTYPES or msg.transport not in ("shm", "tcp"):
            raise wire.ProtocolError(f"KV of {msg.dtype} over {msg.transport}")
        if min(msg.num_layers, msg.num_kv_heads, msg.head_dim) <= 0 or msg.capacity < 0:
            raise wire.ProtocolError("a KV of no shape")
        if msg.first_token != min(self.skip, msg.num_prompt_tokens):
            raise wire.ProtocolError(f"KV from token {msg.first_token}, asked from {self.skip}")
        if probe is not None and msg.capacity > 0:  # (with nothing to send, tcp says nothing)
            conn.same_host = msg.transport == "shm"
        if msg.transport != "shm":
            if self.segment is not None:  # named, not taken: nobody wrote it
                self.segment.unused()
                self.segment = None
            return msg
        if self.pool is None:
            raise wire.ProtocolError("shared memory, not asked for")
        row = msg.num_kv_heads * msg.head_dim * DTYPES[msg.dtype].itemsize
        nbytes = 2 * msg.num_layers * msg.capacity * row
        if msg.segment_taken:
            if self.segment is None:
                raise wire.ProtocolError("a segment taken that was not named")
            try:
                self.segment.fit(nbytes)
            except ValueError as e:
                raise wire.ProtocolError(str(e)) from e
            return msg
        if self.segment is not None:
            self.segment.unused()
        self.segment = self.pool.lend(nbytes)
        await wire.send(sock, wire.UseSegment(self.segment.path))
        return msg

    async def _renew(self, stop: asyncio.Event) -> None:
        sock = self._socket()
        with contextlib.suppress(OSError):  # the receiving side sees the connection fail
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.renew_s)
                if not stop.is_set():
                    await wire.send(sock, wire.Renew())

    async def _receive(self, meta: wire.Meta) -> tuple[torch.Tensor, wire.Done]:
        """The KV buffer (``[L, 2, capacity, kvh, hd]``) once complete, and ``Done``."""
        sock = self._socket()
        dtype = DTYPES[meta.dtype]
        shape = (meta.num_layers, 2, meta.capacity, meta.num_kv_heads, meta.head_dim)
        row = meta.num_kv_heads * meta.head_dim * dtype.itemsize
        buf: torch.Tensor | None = None
        if self.segment is not None:
            flat = self.segment.buffer()
        else:
            buf = torch.empty(shape, dtype=dtype)
            flat = buf.view(-1).view(torch.uint8).numpy().data
        while True:
            msg, payload = await wire.recv_from_server(sock)
            if isinstance(msg, wire.Data):
                if payload != 2 * msg.ntok * row:
                    raise wire.ProtocolError("a Data frame that does not fit")
                _check_range(meta, msg.layer, msg.start, msg.ntok)
                for kv in (0, 1):
                    # K's (or V's) rows of these tokens: one run of bytes in the buffer
                    at = ((msg.layer * 2 + kv) * meta.capacity + msg.start - meta.first_token) * row
                    await wire.recv_into(sock, flat[at : at + msg.ntok * row])
                self.nbytes += payload
            elif isinstance(msg, wire.Written):
                for layer, start, ntok in msg.ranges:
                    _check_range(meta, layer, start, ntok)
                    self.nbytes += 2 * ntok * row
            elif isinstance(msg, wire.Done):
                break
            elif isinstance(msg, wire.Error):
                raise TransferFailed(msg.reason)
            else:
                raise wire.ProtocolError(f"a {type(msg).__name__} mid-pull")
        if not 0 <= msg.num_computed_tokens <= meta.num_prompt_tokens:
            raise wire.ProtocolError(f"{msg.num_computed_tokens} computed tokens")
        del flat  # a view of the segment's memory would keep it from the pool
        if buf is None:
            assert self.segment is not None
            buf = self.segment.result().view(dtype).view(shape)
        return buf, msg


def _check_range(meta: wire.Meta, layer: int, start: int, ntok: int) -> None:
    end = meta.first_token + meta.capacity
    if not (0 <= layer < meta.num_layers and meta.first_token <= start and start + ntok <= end):
        raise wire.ProtocolError(f"layer {layer} tokens [{start}, {start + ntok}) do not fit")
