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

Over TCP the payloads are received straight into the result tensor's memory, and the lease
is released as soon as ``pull`` has returned (the release goes out on the loop's next turn:
the caller's import does not wait for it). Over shared memory the result is a read-only
view of the prefill TE's arena (``mapped.py``): no copy at all until the caller's own (its
import into its KV cache). The lease is then held, and renewed, until the result and every
view of it are gone: the prefill side writes the arena again only after that release, so
what the caller reads is never overwritten under it. A caller copies what it needs and drops
the result; one that holds it past ``deadline_s`` stops renewing, and the prefill side, its
lease expired, drops the arena instead of reusing it (the pages stay, intact, for this
mapping).

A small pull's time is its two wake-ups of idle processes and the Python between them (on
this project's 2-core VMs a core idle for 20 ms runs the same code ~10x slower at first), so
the path is kept short: renewals run off a timer (no task until one is due), the in-place
result is made while ``Done`` is awaited, and ``Meta`` and ``Done`` come in one frame pair
when the KV was complete before the pull.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import time
import warnings
import weakref

import torch

from services.task_executor.dtypes import DTYPES
from services.task_executor.kv_transport import shm as shm_files
from services.task_executor.kv_transport import wire
from services.task_executor.kv_transport.connections import (
    Connection,
    Connections,
    default_connections,
)
from services.task_executor.kv_transport.mapped import MappedArenas, default_mapped

# Releases sent once a shared-memory result is gone (kept here: a task nobody holds may be
# collected before it runs).
_RELEASES: set[asyncio.Task[None]] = set()


class TransferFailed(Exception):
    """A pull (or a rejection) that did not complete; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclasses.dataclass(slots=True, eq=False)
class Pulled:
    """A pulled KV: ``kv`` is ``[num_layers, 2, num_computed_tokens - first_token,
    num_kv_heads, head_dim]``, the tokens ``[first_token, num_computed_tokens)``; over shared
    memory, a read-only view of the prefill TE's arena whose lease ends when it is gone."""

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
    mapped: MappedArenas | None = None,
    connections: Connections | None = None,
) -> Pulled:
    """``key``'s KV from the server at ``address`` ("host:port"), from token ``skip_tokens``
    on (the tokens before are held here already; none of their KV is sent). ``shm``: read it
    in place if the server is on this host, through ``mapped`` (the event loop's
    ``default_mapped()`` unless given); over a kept connection of ``connections`` (the
    event loop's ``default_connections()`` unless given) or a new one. ``TransferFailed`` on
    any failure."""
    if skip_tokens < 0:
        raise ValueError("skip_tokens must not be negative")
    started = time.perf_counter()
    arenas = (mapped or default_mapped()) if shm else None
    conns = connections or default_connections()
    job = _Pull(address, key, skip_tokens, renew_s, arenas, conns, started + deadline_s)
    try:
        async with asyncio.timeout(deadline_s):
            return await job.run(started)
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
        mapped: MappedArenas | None,
        connections: Connections,
        renew_until: float,
    ) -> None:
        self.address, self.key, self.skip = address, key, skip_tokens
        self.renew_s, self.mapped, self.renew_until = renew_s, mapped, renew_until
        self.connections = connections
        self.meta_received = False
        self.conn: Connection | None = None
        self.sock: socket.socket | None = None
        self.nbytes = 0
        # Renewals: a timer (nothing runs between two), and the one being sent, if any.
        self._renew_timer: asyncio.TimerHandle | None = None
        self._renewal: asyncio.Task[None] | None = None

    async def run(self, started: float) -> Pulled:
        # The lease ends after the return: once an in-place result is gone, or (TCP) on the
        # loop's next turn. Until then failures close the connection here.
        released_later = False
        try:
            meta = await self._open()
            self._renew_later()
            if meta.arena is not None:
                kv, done = await self._in_place(meta)
                released_later = True
            else:
                kv, done = await self._receive(meta)
                # Everything is here: the release is a courtesy, sent once the caller has
                # the KV (a send here would wake the server, which on a busy host takes
                # this core before the caller gets its result).
                released_later = True
                self._release_soon()
        except (OSError, wire.ProtocolError) as e:
            raise TransferFailed(f"KV {self.key!r} from {self.address}: {e}") from e
        finally:
            if not released_later:
                self._stop_renewing()
                if self.conn is not None:
                    self.conn.close()  # (one handed back after its release is kept)
        n = done.num_computed_tokens
        return Pulled(
            token_ids=done.token_ids,
            num_prompt_tokens=meta.num_prompt_tokens,
            num_computed_tokens=n,
            first_token=min(meta.first_token, n),
            finish_reason=done.finish_reason,
            dtype=kv.dtype,
            kv=kv,
            transport=meta.transport,
            nbytes=self.nbytes,
            seconds=time.perf_counter() - started,
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

    async def _ask(self, conn: Connection) -> wire.Meta:
        sock = self._socket()
        probe = None
        if self.mapped is not None and conn.same_host is None:
            probe = shm_files.make_probe()
        try:
            path, data = (str(probe[0]), probe[1]) if probe is not None else (None, None)
            again = self.mapped is not None and conn.same_host is True
            await wire.send(sock, wire.Pull(self.key, self.skip, path, data, again))
            msg, _ = await wire.recv_from_server(sock)
        finally:
            if probe is not None:
                shm_files.remove(probe[0])
        self.meta_received = isinstance(msg, wire.Meta)
        if isinstance(msg, wire.Error):
            raise TransferFailed(msg.reason)
        if not isinstance(msg, wire.Meta):
            raise wire.ProtocolError(f"a {type(msg).__name__} where Meta was due")
        if msg.dtype not in DTYPES or msg.transport not in ("shm", "tcp"):
            raise wire.ProtocolError(f"KV of {msg.dtype} over {msg.transport}")
        if min(msg.num_layers, msg.num_kv_heads, msg.head_dim) <= 0 or msg.capacity < 0:
            raise wire.ProtocolError("a KV of no shape")
        if msg.first_token != min(self.skip, msg.num_prompt_tokens):
            raise wire.ProtocolError(f"KV from token {msg.first_token}, asked from {self.skip}")
        if (msg.transport == "shm") != (msg.arena is not None):
            raise wire.ProtocolError("shared memory without an arena, or the other way")
        if msg.arena is not None and self.mapped is None:
            raise wire.ProtocolError("shared memory, not asked for")
        if probe is not None and msg.capacity > 0:  # (with nothing to send, tcp says nothing)
            conn.same_host = msg.transport == "shm"
        return msg

    def _renew_later(self) -> None:
        """A renewal in ``renew_s`` (unless the pull's deadline has passed by then)."""
        loop = asyncio.get_running_loop()
        self._renew_timer = loop.call_later(self.renew_s, self._renew_now)

    def _renew_now(self) -> None:
        self._renew_timer = None
        if time.perf_counter() > self.renew_until:
            return
        if self._renewal is None or self._renewal.done():  # (else one is still on its way)
            sock = self._socket()
            self._renewal = asyncio.create_task(wire.send(sock, wire.Renew()))
            self._renewal.add_done_callback(_ignore_failure)  # the receiving side sees it
        self._renew_later()

    def _stop_renewing(self) -> None:
        if self._renew_timer is not None:
            self._renew_timer.cancel()
            self._renew_timer = None

    async def _release(self) -> None:
        """Stop renewing, release the lease, hand the connection back (``OSError`` if the
        release could not be sent: the connection is closed then)."""
        self._stop_renewing()
        if self._renewal is not None:
            # (a renewal being sent is finished first: no half frame)
            await asyncio.gather(self._renewal, return_exceptions=True)
        conn, self.conn = self.conn, None
        assert conn is not None
        try:
            await wire.send(conn.sock, wire.Release())
        except OSError:
            conn.close()
            raise
        self.connections.released(conn)

    def _result_gone(self, loop: asyncio.AbstractEventLoop) -> None:
        """The last view of an in-place result died (any thread): release on the loop."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: the connection too
            loop.call_soon_threadsafe(self._release_soon)

    def _release_soon(self) -> None:
        async def release() -> None:
            with contextlib.suppress(OSError):  # (the lease then ends as disconnected)
                await self._release()

        task = asyncio.create_task(release(), name=f"kv-release-{self.key}")
        _RELEASES.add(task)
        task.add_done_callback(_RELEASES.discard)

    async def _in_place(self, meta: wire.Meta) -> tuple[torch.Tensor, wire.Done]:
        """The KV in the prefill's arena (``[L, 2, computed - first, kvh, hd]``, read-only)
        once ``Done`` says it is all there, and ``Done``."""
        assert self.mapped is not None and meta.arena is not None
        dtype = DTYPES[meta.dtype]
        inner = meta.num_kv_heads * meta.head_dim
        arena_bytes = 2 * meta.num_layers * meta.num_prompt_tokens * inner * dtype.itemsize
        whole = self.mapped.get(meta.arena, arena_bytes)  # OSError: not readable here
        # The result is made before Done comes (the wait is the prefill's): one tensor over
        # an array of its own, whose death is the result's (the tensor's storage holds it:
        # any tensor made from the result keeps it alive).
        view = whole[:arena_bytes]
        with warnings.catch_warnings():  # read-only: the result is never written
            warnings.simplefilter("ignore", UserWarning)
            t = torch.frombuffer(view, dtype=dtype)
        shape = [meta.num_layers, 2, meta.capacity, meta.num_kv_heads, meta.head_dim]
        plane = meta.num_prompt_tokens * inner  # one layer's K (or V)
        stride = (2 * plane, plane, inner, meta.head_dim, 1)
        kv = t.as_strided(shape, stride, meta.first_token * inner)
        del t
        msg, _ = await wire.recv_from_server(self._socket())
        if isinstance(msg, wire.Error):
            raise TransferFailed(msg.reason)
        if not isinstance(msg, wire.Done):
            raise wire.ProtocolError(f"a {type(msg).__name__} mid-pull")
        if not 0 <= msg.num_computed_tokens <= meta.num_prompt_tokens:
            raise wire.ProtocolError(f"{msg.num_computed_tokens} computed tokens")
        self.nbytes = 2 * meta.num_layers * meta.capacity * inner * dtype.itemsize
        weakref.finalize(view, self._result_gone, asyncio.get_running_loop())
        n = max(msg.num_computed_tokens - meta.first_token, 0)
        return (kv if n == meta.capacity else kv[:, :, :n]), msg

    async def _receive(self, meta: wire.Meta) -> tuple[torch.Tensor, wire.Done]:
        """The KV received into a buffer of this side's (``[L, 2, computed - first, kvh,
        hd]``) once complete, and ``Done``."""
        sock = self._socket()
        dtype = DTYPES[meta.dtype]
        shape = (meta.num_layers, 2, meta.capacity, meta.num_kv_heads, meta.head_dim)
        row = meta.num_kv_heads * meta.head_dim * dtype.itemsize
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
            elif isinstance(msg, wire.Done):
                break
            elif isinstance(msg, wire.Error):
                raise TransferFailed(msg.reason)
            else:
                raise wire.ProtocolError(f"a {type(msg).__name__} mid-pull")
        if not 0 <= msg.num_computed_tokens <= meta.num_prompt_tokens:
            raise wire.ProtocolError(f"{msg.num_computed_tokens} computed tokens")
        return buf[:, :, : max(msg.num_computed_tokens - meta.first_token, 0)], msg


def _ignore_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()


def _check_range(meta: wire.Meta, layer: int, start: int, ntok: int) -> None:
    end = meta.first_token + meta.capacity
    if not (0 <= layer < meta.num_layers and meta.first_token <= start and start + ntok <= end):
        raise wire.ProtocolError(f"layer {layer} tokens [{start}, {start + ntok}) do not fit")
