"""One puller's connection on the prefill side, once it has been matched to an outbox: the
KV goes out as the outbox fills (over the connection, or into the puller's shared-memory
segment), then ``Done``; the puller's renewals, release or rejection come back.

Nothing is written after ``Done``: the puller reuses its segment once it holds the result.

Two tasks share the socket: the sender is its only writer and the reader its only reader. A
lease that ends (``stop``) tells the sender, which sends the error frame, if any, between two
frames (never inside one) and returns; a sender stuck on a puller that stopped reading is
cancelled after ``STOP_GRACE_S``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import socket
from collections.abc import Callable

import torch

from services.task_executor.dtypes import dtype_name
from services.task_executor.kv_transport import wire
from services.task_executor.kv_transport.outbox import Outbox, Piece
from shared.logging import get_logger

log = get_logger(__name__)

STOP_GRACE_S = 1.0
# The most one batch holds (the sender looks for a stop between two): the frames of one
# sendmsg loop, or the copies into a segment between two ``Written`` frames (a batch's
# ranges are merged into a few strided copies, so these are larger).
BATCH_BYTES = 32 << 20
SHM_BATCH_BYTES = 256 << 20


class Session:
    """Sends ``outbox`` from token ``skip_tokens`` on over ``sock``, or into ``segment`` (the
    puller's, mapped here: uint8, laid out as ``Meta`` says) by copies on ``executor``
    (``torch.copy_``, each with torch's own threads)."""

    def __init__(
        self,
        sock: socket.socket,
        outbox: Outbox,
        *,
        skip_tokens: int,
        segment: torch.Tensor | None,
        executor: concurrent.futures.Executor,
        on_renew: Callable[[], None],
        on_end: Callable[[str, str | None], None],
    ) -> None:
        self._sock, self._outbox, self._segment = sock, outbox, segment
        self._arena = outbox.arena  # held here: a copy in flight outlives the lease's end
        self._executor = executor
        self._on_renew, self._on_end = on_renew, on_end
        self.first = min(skip_tokens, outbox.num_prompt_tokens)
        self.capacity = outbox.num_prompt_tokens - self.first
        self._wake = asyncio.Event()
        self._stopped = False
        self._error: str | None = None
        # Its sender ended within the grace, nothing half-sent: after a release, the
        # connection may carry another pull.
        self.clean = False

    def wake(self) -> None:
        self._wake.set()

    def stop(self, error: str | None) -> None:
        """The lease ended: send ``error`` (if any) and close."""
        if not self._stopped:
            self._stopped, self._error = True, error
            self._wake.set()

    @staticmethod
    def meta(outbox: Outbox, first: int, transport: str, segment_taken: bool) -> wire.Meta:
        o = outbox
        return wire.Meta(
            transport=transport,
            num_layers=o.num_layers,
            num_kv_heads=o.num_kv_heads,
            head_dim=o.head_dim,
            dtype=dtype_name(o.dtype),
            num_prompt_tokens=o.num_prompt_tokens,
            first_token=first,
            capacity=o.num_prompt_tokens - first,
            segment_taken=segment_taken,
        )

    async def run(self) -> None:
        """Until the lease ends or the puller goes away."""
        sender = asyncio.create_task(self._send_all(), name=f"kv-send-{self._outbox.key}")
        reader = asyncio.create_task(self._read_all(), name=f"kv-read-{self._outbox.key}")
        try:
            await asyncio.wait({sender, reader}, return_when=asyncio.FIRST_COMPLETED)
            if not self._stopped:
                # Neither a release nor a lease's end: the connection failed.
                self._on_end("disconnected", None)
            if not sender.done():
                await asyncio.wait({sender}, timeout=STOP_GRACE_S)
            self.clean = sender.done()
        finally:
            for task in (sender, reader):
                task.cancel()
            await asyncio.gather(sender, reader, return_exceptions=True)

    # --- the puller's frames ------------------------------------------------------------

    async def _read_all(self) -> None:
        with contextlib.suppress(OSError, wire.ProtocolError):
            while not self._stopped:
                msg = await wire.recv_from_client(self._sock)
                if isinstance(msg, wire.Renew):
                    self._on_renew()
                elif isinstance(msg, wire.Release):
                    self._on_end("released", None)
                elif isinstance(msg, wire.Reject):
                    self._on_end(f"rejected: {msg.reason}", None)
                else:
                    raise wire.ProtocolError(f"a {type(msg).__name__} mid-pull")

    # --- the KV --------------------------------------------------------------------------

    async def _send_all(self) -> None:
        try:
            await self._send_until_stopped()
        except (OSError, wire.ProtocolError) as e:
            log.debug("KV puller connection failed", key=self._outbox.key, error=str(e))
            return
        except Exception:  # a bug: the pull fails (the lease ends as "disconnected")
            log.exception("KV sending failed", key=self._outbox.key)
            return
        if self._error is not None:
            with contextlib.suppress(OSError, TimeoutError):
                async with asyncio.timeout(STOP_GRACE_S):
                    await wire.send(self._sock, wire.Error(self._error))

    async def _send_until_stopped(self) -> None:
        outbox = self._outbox
        while not self._stopped:
            self._wake.clear()
            pieces = [p for p in map(self._clip, outbox.take()) if p is not None]
            if pieces:
                await self._send_pieces(pieces)
                continue
            finished = outbox.finished
            if finished is not None:
                end = finished.num_computed_tokens
                gap = outbox.gap(min(self.first, end), end)
                if gap is not None:
                    layer, a, b = gap
                    self._on_end(
                        f"failed: layer {layer} lacks tokens [{a}, {b})",
                        f"the prefill's KV is incomplete: layer {layer} lacks tokens [{a}, {b})",
                    )
                    return
                done = wire.Done(finished.token_ids, end, finished.finish_reason)
                await wire.send(self._sock, done)
                break
            await self._wake.wait()
        while not self._stopped:  # Done is out: wait for the release (or the lease's end)
            self._wake.clear()
            await self._wake.wait()

    def _clip(self, p: Piece) -> Piece | None:
        """The part of ``p`` at or past the first token sent."""
        if p.end <= self.first:
            return None
        if p.start >= self.first:
            return p
        return p.cut(self.first, self._outbox.row_bytes)

    async def _send_pieces(self, pieces: list[Piece]) -> None:
        row = self._outbox.row_bytes
        tcp = self._segment is None
        limit = BATCH_BYTES if tcp else SHM_BATCH_BYTES
        batch: list[Piece] = []
        size = 0
        for p in pieces:
            batch.append(p)
            size += 2 * (p.end - p.start) * row
            if size >= limit or (tcp and len(batch) * 3 >= wire.MAX_BUFFERS):
                await self._send_batch(batch)
                batch, size = [], 0
                if self._stopped:
                    return
        if batch:
            await self._send_batch(batch)

    async def _send_batch(self, batch: list[Piece]) -> None:
        if self._segment is None:
            buffers: list[memoryview | bytes] = []
            for p in batch:
                ntok = p.end - p.start
                buffers.append(
                    wire.frame_head(
                        wire.Data(p.layer, p.start, ntok), 2 * ntok * self._outbox.row_bytes
                    )
                )
                buffers += [p.k_bytes, p.v_bytes]
            await wire.send_buffers(self._sock, buffers)
            return
        arena = self._arena
        assert arena is not None  # a piece came, so the lease had not ended when we began
        o = self._outbox
        segment = self._segment.view(o.num_layers, 2, self.capacity, o.row_bytes)
        regions = merge_ranges([(p.layer, p.start, p.end) for p in batch])
        first = self.first

        def copy() -> None:
            for lo, hi, a, b in regions:
                segment[lo:hi, :, a - first : b - first].copy_(arena[lo:hi, :, a:b])

        await asyncio.get_running_loop().run_in_executor(self._executor, copy)
        ranges = [(p.layer, p.start, p.end - p.start) for p in batch]
        await wire.send(self._sock, wire.Written(ranges))


def merge_ranges(ranges: list[tuple[int, int, int]]) -> list[tuple[int, int, int, int]]:
    """``(layer, start, end)`` ranges as ``(first_layer, last_layer + 1, start, end)``
    rectangles that cover the same (layer, token) cells: consecutive layers with the same
    tokens merge, then rectangles of the same layers whose tokens follow on."""
    by_tokens: list[tuple[int, int, int, int]] = []
    for layer, a, b in sorted(set(ranges), key=lambda r: (r[1], r[2], r[0])):
        if by_tokens and by_tokens[-1][2:] == (a, b) and by_tokens[-1][1] == layer:
            lo = by_tokens[-1][0]
            by_tokens[-1] = (lo, layer + 1, a, b)
        else:
            by_tokens.append((layer, layer + 1, a, b))
    merged: list[tuple[int, int, int, int]] = []
    for lo, hi, a, b in sorted(by_tokens):
        if merged and merged[-1][:2] == (lo, hi) and merged[-1][3] == a:
            merged[-1] = (lo, hi, merged[-1][2], b)
        else:
            merged.append((lo, hi, a, b))
    return merged
