"""The decode side of the KV data plane: pull one task's KV from the prefill TE that holds it
(``server.KvServer``), or tell it the KV will not be taken.

A pull keeps the prefill side's lease alive while the prefill computes (a renewal every
``renew_s``), writes each range into its place as it arrives, in whatever order the layers
come, and releases the lease once ``Done`` has come (the server sends it only after every
layer's range). Every failure (no connection, an error from the server, the connection
dropping, nothing complete within ``deadline_s``, the caller cancelling) closes the
connection, which ends the lease on the prefill side: the KV there is freed either way.

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
) -> Pulled:
    """``key``'s KV from the server at ``address`` ("host:port"), from token ``skip_tokens``
    on (the tokens before are held here already; none of their KV is sent). ``shm``: use
    shared memory if the server is on this host, with segments of ``pool`` (this process's
    ``default_pool()`` unless given). ``TransferFailed`` on any failure."""
    if skip_tokens < 0:
        raise ValueError("skip_tokens must not be negative")
    started = time.perf_counter()
    segments = (pool or default_pool()) if shm else None
    try:
        async with asyncio.timeout(deadline_s):
            return await _Pull(address, key, skip_tokens, renew_s, segments, started).run()
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
        started: float,
    ) -> None:
        self.address, self.key, self.skip = address, key, skip_tokens
        self.renew_s, self.pool, self.started = renew_s, pool, started
        self.sock: socket.socket | None = None
        self.segment: Lent | None = None
        self.nbytes = 0

    async def run(self) -> Pulled:
        renewer: asyncio.Task[None] | None = None
        try:
            try:
                self.sock = await wire.connect(self.address)
            except OSError as e:
                raise TransferFailed(f"cannot connect to {self.address}: {e}") from e
            meta = await self._ask()
            renewer = asyncio.create_task(self._renew(), name=f"kv-renew-{self.key}")
            kv, done = await self._receive(meta)
            renewer.cancel()
            await asyncio.gather(renewer, return_exceptions=True)
            with contextlib.suppress(OSError):  # everything is here: the release is a courtesy
                await wire.send(self.sock, wire.Release())
        except (OSError, wire.ProtocolError) as e:
            raise TransferFailed(f"KV {self.key!r} from {self.address}: {e}") from e
        finally:
            if renewer is not None:
                renewer.cancel()
            if self.sock is not None:
                self.sock.close()
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

    async def _ask(self) -> wire.Meta:
        assert self.sock is not None
        probe = shm_files.make_probe() if self.pool is not None else None
        try:
            path, data = (str(probe[0]), probe[1]) if probe is not None else (None, None)
            await wire.send(self.sock, wire.Pull(self.key, self.skip, path, data))
            msg, _ = await wire.recv_from_server(self.sock)
        finally:
            if probe is not None:
                shm_files.remove(probe[0])
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
        if msg.transport == "shm":
            if self.pool is None:
                raise wire.ProtocolError("shared memory, not asked for")
            row = msg.num_kv_heads * msg.head_dim * DTYPES[msg.dtype].itemsize
            self.segment = self.pool.lend(2 * msg.num_layers * msg.capacity * row)
            await wire.send(self.sock, wire.UseSegment(self.segment.path))
        return msg

    async def _renew(self) -> None:
        assert self.sock is not None
        with contextlib.suppress(OSError):  # the receiving side sees the connection fail
            while True:
                await asyncio.sleep(self.renew_s)
                await wire.send(self.sock, wire.Renew())

    async def _receive(self, meta: wire.Meta) -> tuple[torch.Tensor, wire.Done]:
        """The KV buffer (``[L, 2, capacity, kvh, hd]``) once complete, and ``Done``."""
        assert self.sock is not None
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
            msg, payload = await wire.recv_from_server(self.sock)
            if isinstance(msg, wire.Data):
                if payload != 2 * msg.ntok * row:
                    raise wire.ProtocolError("a Data frame that does not fit")
                _check_range(meta, msg.layer, msg.start, msg.ntok)
                for kv in (0, 1):
                    # K's (or V's) rows of these tokens: one run of bytes in the buffer
                    at = ((msg.layer * 2 + kv) * meta.capacity + msg.start - meta.first_token) * row
                    await wire.recv_into(self.sock, flat[at : at + msg.ntok * row])
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
