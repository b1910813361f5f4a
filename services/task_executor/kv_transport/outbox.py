"""What a prefill TE offers a decode TE: one task's KV, layer by layer as the prefill computes
it, then the tokens, under a lease the puller renews (``server.KvServer`` keeps the lease).

The engine thread writes layers while the event loop sends them, so the outbox is the one
place the two threads meet: ``layer`` copies the rows into the outbox's arena, then takes a
lock for a list append and, at most once per loop iteration, wakes the server's loop
(``call_soon_threadsafe``); everything else runs on the loop. The outbox learns its loop from
``KvServer.offer`` (not at construction), so it can be made and written on any thread before
it is offered; writes made before that are kept and sent once a puller connects.

The arena is one host tensor ``[num_layers, 2, num_prompt_tokens, num_kv_heads, head_dim]``
in a file in /dev/shm (``pool.ArenaPool``) where the TE has a pool: a puller on this host
maps it and reads the KV in place (no copy of the transport's own). Without a pool, or
without room in /dev/shm, it is on the heap and every puller gets it over TCP. When the lease
ends the arena goes back to the pool, to be written again only where nobody may still read
it (``KvServer`` decides: a puller in place that released, or none in place at all); only
the bounds of written ranges stay, to check at the end that every layer's range was covered.
A new arena costs its pages once (made and mapped up front, tens of milliseconds for 200 MB
on this project's VMs); the pool's are reused.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import threading
from collections.abc import Callable

import torch

from services.task_executor.dtypes import DTYPES
from services.task_executor.kv_transport.pool import Arena, ArenaPool, try_lend


@dataclasses.dataclass(slots=True)
class Piece:
    """Tokens ``[start, end)`` of ``layer``: K's rows and V's, as buffers over the arena's
    memory (for ``sendmsg``; a copy into shared memory reads the arena itself)."""

    layer: int
    start: int
    end: int
    k_bytes: memoryview
    v_bytes: memoryview

    def cut(self, first: int, row_bytes: int) -> Piece:
        """The tokens at or past ``first`` (which lies inside the piece)."""
        n = (first - self.start) * row_bytes
        return Piece(self.layer, first, self.end, self.k_bytes[n:], self.v_bytes[n:])


@dataclasses.dataclass(frozen=True, slots=True)
class Finished:
    token_ids: list[int]
    num_computed_tokens: int
    finish_reason: str | None


class Outbox:
    """One prefill task's KV, offered to one puller under a lease."""

    def __init__(
        self,
        key: str,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        num_prompt_tokens: int,
        lease_s: float,
        arenas: ArenaPool | None = None,
    ) -> None:
        """``arenas``: where the KV is written, so that pullers on this host read it in
        place (None: on the heap, for TCP pullers only)."""
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported KV dtype {dtype}")
        if min(num_layers, num_kv_heads, head_dim) <= 0 or num_prompt_tokens < 0:
            raise ValueError("an outbox needs positive dimensions")
        if lease_s <= 0:
            raise ValueError("lease_s must be positive")
        self.key = key
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype = dtype
        self.num_prompt_tokens = num_prompt_tokens
        self.lease_s = lease_s
        self.row_bytes = num_kv_heads * head_dim * dtype.itemsize  # one token of K (or V)
        shape = (num_layers, 2, num_prompt_tokens, num_kv_heads, head_dim)
        nbytes = num_layers * 2 * num_prompt_tokens * self.row_bytes
        self._pool = arenas
        self._shared: Arena | None = try_lend(arenas, nbytes)
        if self._shared is not None:
            assert self._shared.tensor is not None
            self._arena: torch.Tensor | None = self._shared.tensor[:nbytes].view(dtype).view(shape)
        else:
            self._arena = torch.empty(shape, dtype=dtype)
        self._lock = threading.Lock()
        self._writers = 0  # layer() calls copying into the arena now
        self._pending: list[Piece] = []  # written, not yet taken by the sender
        # Per layer, the tokens written: disjoint [start, end) intervals in order (a write
        # usually extends the last one: a prefill computes its chunks in order).
        self._covered: list[list[list[int]]] = [[] for _ in range(num_layers)]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._notify: Callable[[], None] | None = None
        self._wake_scheduled = False
        self._discarded = False
        self.finished: Finished | None = None
        self.failure: str | None = None

    # --- the prefill side ---------------------------------------------------------------

    def layer(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Tokens ``[start, start + k.shape[0])`` of ``layer``: K and V ``[ntok,
        num_kv_heads, head_dim]`` on any device, copied into the arena (the caller keeps its
        tensors). Any thread. A range written again replaces the earlier bytes (the same
        values: a recomputed chunk). Ranges must lie within the prompt (``ValueError``
        otherwise: a caller's bug)."""
        want = (self.num_kv_heads, self.head_dim)
        if k.shape != v.shape or k.dim() != 3 or tuple(k.shape[1:]) != want:
            raise ValueError(f"layer {layer}: K {tuple(k.shape)}, V {tuple(v.shape)}")
        if k.dtype != self.dtype or v.dtype != self.dtype:
            raise ValueError(f"layer {layer}: {k.dtype}/{v.dtype}, the outbox holds {self.dtype}")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} of {self.num_layers}")
        end = start + k.shape[0]
        if start < 0 or end > self.num_prompt_tokens:
            raise ValueError(
                f"tokens [{start}, {end}) outside the prompt's {self.num_prompt_tokens}"
            )
        if k.shape[0] == 0:
            return
        with self._lock:  # the arena stays ours until this write is over
            arena = self._arena
            if arena is None:
                return
            self._writers += 1
        try:
            dk, dv = arena[layer, 0, start:end], arena[layer, 1, start:end]
            dk.copy_(k)
            dv.copy_(v)
            # The byte views are made here, on the engine's thread: a few microseconds each
            # that the event loop does not spend.
            kb, vb = dk.reshape(-1).view(torch.uint8), dv.reshape(-1).view(torch.uint8)
            piece = Piece(layer, start, end, kb.numpy().data, vb.numpy().data)
        finally:
            with self._lock:
                self._writers -= 1
                discarded, last = self._discarded, self._writers == 0
        if discarded:  # the lease ended under this write: the arena is never reused
            if last:
                self._give_back(reuse=False)
            return
        with self._lock:
            if self._discarded:
                return
            self._pending.append(piece)
            _cover(self._covered[layer], start, end)
        self._signal()

    def done(
        self, token_ids: list[int], num_computed_tokens: int, finish_reason: str | None
    ) -> None:
        """The prompt is computed: ``token_ids`` is the prompt and the first sampled token(s);
        the KV of tokens ``[0, num_computed_tokens)`` (at most the prompt) is all written."""
        if not 0 <= num_computed_tokens <= min(self.num_prompt_tokens, len(token_ids)):
            raise ValueError(
                f"{num_computed_tokens} computed tokens for a prompt of {self.num_prompt_tokens}"
                f" and {len(token_ids)} token ids"
            )
        with self._lock:
            if self.finished is not None or self.failure is not None:
                return
            self.finished = Finished(list(token_ids), num_computed_tokens, finish_reason)
        self._signal()

    def fail(self, reason: str) -> None:
        """The prefill failed: the puller gets ``reason`` as an error, the lease ends."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
        self._signal()

    # --- the server's side (event-loop thread) ------------------------------------------

    def attach(self, loop: asyncio.AbstractEventLoop, notify: Callable[[], None]) -> None:
        """``notify()`` runs on ``loop`` after writes, ``done`` and ``fail`` (coalesced: one
        call may stand for many writes); once now, for what happened before."""
        with self._lock:
            self._loop, self._notify = loop, notify
        self._signal()

    @property
    def shared_path(self) -> str | None:
        """The arena's file in /dev/shm (None: the KV is on the heap)."""
        return str(self._shared.path) if self._shared is not None else None

    def take(self) -> list[Piece]:
        """The writes since the last ``take``, in order; the outbox forgets their tensors."""
        with self._lock:
            pieces, self._pending = self._pending, []
        return pieces

    def gap(self, first: int, end: int) -> tuple[int, int, int] | None:
        """``(layer, a, b)``: tokens ``[a, b)`` of ``layer`` within ``[first, end)`` that no
        write covered; None when every layer is covered."""
        with self._lock:  # (a few intervals a layer: written in order, one)
            for layer, intervals in enumerate(self._covered):
                covered = first
                for a, b in intervals:
                    if a > covered:
                        break
                    covered = max(covered, b)
                if covered < end:
                    nxt = [a for a, _ in intervals if a > covered]
                    return layer, covered, min([end, *nxt])
        return None

    def discard(self, *, reuse: bool = False) -> None:
        """The lease ended: drop the KV (and any written later) and stop notifying. The
        arena goes back to its pool, to be written again only if ``reuse`` (nobody reads it
        any more) and no write was in flight."""
        with self._lock:
            if self._discarded:
                return
            self._discarded = True
            self._pending = []
            self._notify = None
            self._arena = None
            writing = self._writers > 0
        if not writing:  # else the last write gives it back, never to be reused
            self._give_back(reuse=reuse)

    def _give_back(self, *, reuse: bool) -> None:
        with self._lock:
            shared, self._shared = self._shared, None
        if shared is not None and self._pool is not None:
            self._pool.give_back(shared, reuse=reuse)

    def _signal(self) -> None:
        with self._lock:
            loop = self._loop
            if loop is None or self._wake_scheduled or self._notify is None:
                return
            self._wake_scheduled = True
        try:
            loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: the server is gone, nobody will pull
            pass

    def _deliver(self) -> None:
        with self._lock:
            self._wake_scheduled = False
            notify = self._notify
        if notify is not None:
            notify()


def _cover(intervals: list[list[int]], start: int, end: int) -> None:
    """Add ``[start, end)`` to ``intervals`` (disjoint, in order), merging what touches."""
    if intervals and intervals[-1][0] <= start:  # the usual case: at or past the last one
        if start <= intervals[-1][1]:
            intervals[-1][1] = max(intervals[-1][1], end)
        else:
            intervals.append([start, end])
        return
    i = bisect.bisect_left(intervals, start, key=lambda iv: iv[1])  # first ending at/after
    j = i
    while j < len(intervals) and intervals[j][0] <= end:
        start, end = min(start, intervals[j][0]), max(end, intervals[j][1])
        j += 1
    intervals[i:j] = [[start, end]]
