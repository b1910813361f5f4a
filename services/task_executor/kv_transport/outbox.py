"""What a prefill TE offers a decode TE: one task's KV, layer by layer as the prefill computes
it, then the tokens, under a lease the puller renews (``server.KvServer`` keeps the lease).

The engine thread writes layers while the event loop sends them, so the outbox is the one
place the two threads meet: ``layer`` copies the rows into the outbox's arena, then takes a
lock for a list append and, at most once per loop iteration, wakes the server's loop
(``call_soon_threadsafe``); everything else runs on the loop. The outbox learns its loop from
``KvServer.offer`` (not at construction), so it can be made and written on any thread before
it is offered; writes made before that are kept and sent once a puller connects.

The arena is one host tensor ``[num_layers, 2, num_prompt_tokens, num_kv_heads, head_dim]``,
the segment layout a puller on this host asks for, so written ranges go into its segment as
a few strided copies (one when the whole KV is there) instead of one copy per range: a copy
per range runs at half the memory's speed or less, one strided ``copy_`` at its full speed.
It is freed when the lease ends; only the bounds of sent ranges stay, to check at the end
that every layer's range was covered.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable

import torch

from services.task_executor.dtypes import DTYPES


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
    ) -> None:
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
        self._arena: torch.Tensor | None = torch.empty(
            num_layers, 2, num_prompt_tokens, num_kv_heads, head_dim, dtype=dtype
        )
        self._lock = threading.Lock()
        self._pending: list[Piece] = []  # written, not yet taken by the sender
        self._ranges: list[tuple[int, int, int]] = []  # (layer, start, end) of every write
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
        arena = self._arena
        if k.shape[0] == 0 or arena is None:
            return
        dk, dv = arena[layer, 0, start:end], arena[layer, 1, start:end]
        dk.copy_(k)
        dv.copy_(v)
        # The byte views are made here, on the engine's thread: a few microseconds each that
        # the event loop does not spend.
        kb, vb = dk.reshape(-1).view(torch.uint8), dv.reshape(-1).view(torch.uint8)
        piece = Piece(layer, start, end, kb.numpy().data, vb.numpy().data)
        with self._lock:
            if self._discarded:
                return
            self._pending.append(piece)
            self._ranges.append((layer, start, end))
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
    def arena(self) -> torch.Tensor | None:
        """The arena as bytes, ``[num_layers, 2, num_prompt_tokens, row_bytes]`` (None once
        the lease ended)."""
        arena = self._arena
        if arena is None:
            return None
        return arena.view(torch.uint8).view(
            self.num_layers, 2, self.num_prompt_tokens, self.row_bytes
        )

    def take(self) -> list[Piece]:
        """The writes since the last ``take``, in order; the outbox forgets their tensors."""
        with self._lock:
            pieces, self._pending = self._pending, []
        return pieces

    def gap(self, first: int, end: int) -> tuple[int, int, int] | None:
        """``(layer, a, b)``: tokens ``[a, b)`` of ``layer`` within ``[first, end)`` that no
        write covered; None when every layer is covered."""
        with self._lock:
            ranges = sorted(self._ranges)
        by_layer: dict[int, list[tuple[int, int]]] = {}
        for layer, a, b in ranges:
            by_layer.setdefault(layer, []).append((a, b))
        for layer in range(self.num_layers):
            covered = first
            for a, b in by_layer.get(layer, []):
                if a > covered:
                    break
                covered = max(covered, b)
            if covered < end:
                nxt = [a for a, _ in by_layer.get(layer, []) if a > covered]
                return layer, covered, min([end, *nxt])
        return None

    def discard(self) -> None:
        """The lease ended: drop the KV (and any written later) and stop notifying."""
        with self._lock:
            self._discarded = True
            self._pending = []
            self._notify = None
            self._arena = None

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
