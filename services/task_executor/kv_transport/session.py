"""One puller's connection on the prefill side, once it has been matched to an outbox: the
KV goes out over the connection as the outbox fills, then ``Done``; the puller's renewals,
release or rejection come back. A puller on this host reads the KV in place, in the outbox's
arena (``Meta`` named it): to it only ``Done`` goes, once the whole KV is there.

Two tasks share the socket: the sender is its only writer and the reader its only reader
(but for ``Done`` to a puller in place, which goes out from ``run`` or ``wake`` directly,
when nothing else is being written: a loop iteration sooner, the puller's only wait). A
lease that ends (``stop``) tells the sender, which sends the error frame, if any, between two
frames (never inside one) and returns; a sender stuck on a puller that stopped reading is
cancelled after ``STOP_GRACE_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable

from services.task_executor.dtypes import dtype_name
from services.task_executor.kv_transport import wire
from services.task_executor.kv_transport.outbox import Finished, Outbox, Piece
from shared.logging import get_logger

log = get_logger(__name__)

STOP_GRACE_S = 1.0
# The most one batch of frames holds (the sender looks for a stop between two).
BATCH_BYTES = 32 << 20


class Session:
    """Sends ``Meta``, then ``outbox`` from token ``skip_tokens`` on over ``sock`` or, with
    ``arena`` (the outbox's, which the puller reads in place), only ``Done`` once the KV is
    all there. A KV complete when the pull comes goes in one write: ``Meta`` and ``Done``
    together, one wake-up of the puller."""

    def __init__(
        self,
        sock: socket.socket,
        outbox: Outbox,
        *,
        skip_tokens: int,
        arena: str | None,
        on_renew: Callable[[], None],
        on_end: Callable[[str, str | None], None],
    ) -> None:
        self._sock, self._outbox = sock, outbox
        self.in_place = arena is not None  # the puller reads the outbox's arena itself
        self._on_renew, self._on_end = on_renew, on_end
        self.first = min(skip_tokens, outbox.num_prompt_tokens)
        self.capacity = outbox.num_prompt_tokens - self.first
        self._head = [wire.frame_head(self.meta(outbox, self.first, arena))]  # not sent yet
        self._wake = asyncio.Event()
        self._stopped = False
        self._done_sent = False  # Done is out (or, of its frame, what _head still holds)
        self._writing = False  # the sender is in the middle of a write
        self._error: str | None = None
        # Its sender ended within the grace, nothing half-sent: after a release, the
        # connection may carry another pull.
        self.clean = False

    def wake(self) -> None:
        """The outbox changed. A puller in place waits only for ``Done``: sent from here,
        when it is due and nothing else is being written (not a loop iteration later)."""
        if self.in_place and not (self._stopped or self._done_sent or self._writing):
            self._finish_now()
        self._wake.set()

    def stop(self, error: str | None) -> None:
        """The lease ended: send ``error`` (if any) and close."""
        if not self._stopped:
            self._stopped, self._error = True, error
            self._wake.set()

    @staticmethod
    def meta(outbox: Outbox, first: int, arena: str | None) -> wire.Meta:
        """Over shared memory (``arena``: the outbox's) or, without one, TCP."""
        o = outbox
        return wire.Meta(
            transport="shm" if arena is not None else "tcp",
            num_layers=o.num_layers,
            num_kv_heads=o.num_kv_heads,
            head_dim=o.head_dim,
            dtype=dtype_name(o.dtype),
            num_prompt_tokens=o.num_prompt_tokens,
            first_token=first,
            capacity=o.num_prompt_tokens - first,
            arena=arena,
        )

    async def run(self) -> None:
        """Until the lease ends or the puller goes away."""
        if self.in_place:
            self._finish_now()  # (the KV may be complete already)
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

    def _finish_now(self) -> None:
        """A puller in place whose KV is all in the arena already: ``Meta`` and ``Done`` in
        one write, before the session's tasks are even made (the puller waits on nothing
        else). What the socket does not take now, the sender sends first; anything but the
        KV complete is left to the sender."""
        finished = self._outbox.finished
        if finished is None or self._gap(finished) is not None:
            return
        data = b"".join([*self._head, self._done(finished)])
        try:
            sent = self._sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            return  # (the sender meets the same error and ends the pull)
        self._head = [data[sent:]] if sent < len(data) else []
        self._done_sent = True

    def _gap(self, finished: Finished) -> tuple[int, int, int] | None:
        end = finished.num_computed_tokens
        return self._outbox.gap(min(self.first, end), end)

    @staticmethod
    def _done(finished: Finished) -> bytes:
        done = wire.Done(finished.token_ids, finished.num_computed_tokens, finished.finish_reason)
        return wire.frame_head(done)

    async def _send_until_stopped(self) -> None:
        outbox = self._outbox
        while not self._stopped and not self._done_sent:
            self._wake.clear()
            taken = outbox.take()  # (in place, the puller reads what they wrote directly)
            pieces = [] if self.in_place else [p for p in map(self._clip, taken) if p is not None]
            if pieces:
                await self._send_pieces(pieces)
                continue
            finished = outbox.finished
            if finished is not None:
                gap = self._gap(finished)
                if gap is not None:
                    layer, a, b = gap
                    self._on_end(
                        f"failed: layer {layer} lacks tokens [{a}, {b})",
                        f"the prefill's KV is incomplete: layer {layer} lacks tokens [{a}, {b})",
                    )
                    return
                await self._send([self._done(finished)])
                self._done_sent = True
                break
            if self._head:  # nothing to send yet: the puller may get ready meanwhile
                await self._send([])
            await self._wake.wait()
        if self._head:  # the part of Meta and Done the socket did not take at once
            await self._send([])
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
        batch: list[Piece] = []
        size = 0
        for p in pieces:
            batch.append(p)
            size += 2 * (p.end - p.start) * row
            if size >= BATCH_BYTES or len(batch) * 3 >= wire.MAX_BUFFERS:
                await self._send_batch(batch)
                batch, size = [], 0
                if self._stopped:
                    return
        if batch:
            await self._send_batch(batch)

    async def _send_batch(self, batch: list[Piece]) -> None:
        buffers: list[memoryview | bytes] = []
        for p in batch:
            ntok = p.end - p.start
            head = wire.Data(p.layer, p.start, ntok)
            buffers.append(wire.frame_head(head, 2 * ntok * self._outbox.row_bytes))
            buffers += [p.k_bytes, p.v_bytes]
        await self._send(buffers)

    async def _send(self, buffers: list[memoryview | bytes]) -> None:
        """``buffers``, after ``Meta`` if it has not gone yet."""
        head, self._head = self._head, []
        self._writing = True
        try:
            await wire.send_buffers(self._sock, [*head, *buffers])
        finally:
            self._writing = False
