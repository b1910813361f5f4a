"""Decode iterations replayed from CUDA graphs (vLLM's and SGLang's answer to launch overhead).

Run eagerly, a decode step of a small model is bound by its host: measured on an H100 for a
Qwen2-0.5B-shaped model at batch 1, about 15 ms of Python and kernel launches (some 715
kernels) for 2.2 ms of GPU work. A graph captured once per shape replays the whole forward
with one launch.

A graph is captured per bucket of (batch size, block-table width): the batch is padded up to
a bucket size and the table to a power-of-two width, so a few dozen graphs serve every
iteration. Padding rows repeat the batch's last row (same token, position, slot and table),
so they write exactly the K/V that row writes, and their logits are dropped. Table columns
past a request's blocks point at block 0 and are masked out by its length. The captured
forward is the eager one, so outputs are the same.

Only pure decode iterations without LoRA adapters replay (prefill chunks have shapes of their
own and few steps; adapters' slots and ranks change between iterations); everything else runs
eagerly. All graphs share one memory pool: they run one at a time, and
each iteration's logits are copied out before the next replay.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from services.task_executor.engines.torch_engine.kv_cache import PagedKVCache

if TYPE_CHECKING:
    from services.task_executor.engines.torch_engine.model import ForwardBatch

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def bucket(n: int, sizes: tuple[int, ...] | list[int]) -> int:
    """The smallest size that holds ``n`` (sizes ascending; ``n`` at most the last)."""
    for s in sizes:
        if s >= n:
            return s
    raise ValueError(f"{n} exceeds the largest bucket {sizes[-1]}")


def batch_buckets(max_batch: int) -> list[int]:
    return [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]


def width_buckets(max_blocks: int) -> list[int]:
    """Powers of two below ``max_blocks``, then ``max_blocks``."""
    out, w = [], 1
    while w < max_blocks:
        out.append(w)
        w *= 2
    return [*out, max_blocks]


@dataclasses.dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # [b]
    positions: torch.Tensor  # [b]
    slots: torch.Tensor  # [b]
    lens: torch.Tensor  # [b]
    tables: torch.Tensor  # [b, w]
    rows: torch.Tensor  # arange(b): which of the batch's rows each padded row copies
    logits: torch.Tensor | None = None  # [b, vocab], the captured output


class DecodeGraphs:
    """Replays ``forward`` (the eager forward: ForwardBatch, cache -> logits) for pure decode
    batches of up to ``max_batch`` requests whose tables hold up to ``max_blocks`` blocks."""

    def __init__(
        self,
        forward: Callable[[ForwardBatch, PagedKVCache], torch.Tensor],
        batch_type: type[ForwardBatch],
        *,
        max_batch: int,
        max_blocks: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self._forward = forward
        self._batch_type = batch_type
        self._batches = batch_buckets(max_batch)
        self._widths = width_buckets(max_blocks)
        self._block_size = block_size
        self._device = device
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self.replays = 0

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def covers(self, batch: ForwardBatch) -> bool:
        """Whether ``batch`` replays a graph: a pure decode batch within the buckets, with no
        LoRA adapter (the captured forward has none: such batches run eagerly)."""
        n = batch.input_ids.shape[0]
        tables = batch.decode_block_tables
        return (
            batch.lora is None
            and not batch.prefills
            and tables is not None
            and batch.num_decode == n
            and batch.logits_indices.shape[0] == n
            and n <= self._batches[-1]
            and tables.shape[1] <= self._widths[-1]
        )

    def run(self, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
        n, width = _decode_inputs(batch)[0].shape
        key = bucket(n, self._batches), bucket(width, self._widths)
        g = self._graphs.get(key)
        if g is None:
            g = self._capture(*key, batch, cache)
        else:
            self._load(g, batch)
            g.graph.replay()
        self.replays += 1
        assert g.logits is not None
        return g.logits[:n].clone()

    def _load(self, g: _Graph, batch: ForwardBatch) -> None:
        tables, lens = _decode_inputs(batch)
        n, width = tables.shape
        rows = g.rows.clamp(max=n - 1)  # the padded rows repeat the last one
        torch.index_select(batch.input_ids, 0, rows, out=g.ids)
        torch.index_select(batch.positions, 0, rows, out=g.positions)
        torch.index_select(batch.slots, 0, rows, out=g.slots)
        torch.index_select(lens, 0, rows, out=g.lens)
        g.tables[:, width:].zero_()
        g.tables[:, :width].copy_(tables.index_select(0, rows))

    def _static_forward(self, g: _Graph, cache: PagedKVCache) -> torch.Tensor:
        b, w = g.tables.shape
        valid = torch.arange(w * self._block_size, device=self._device)[None, :] < g.lens[:, None]
        static = self._batch_type(
            input_ids=g.ids,
            positions=g.positions,
            slots=g.slots,
            logits_indices=g.rows,
            num_decode=b,
            decode_block_tables=g.tables,
            decode_lens=g.lens,
            decode_mask=valid[:, None, None, :],
            prefills=(),
        )
        return self._forward(static, cache)

    def _capture(self, b: int, w: int, batch: ForwardBatch, cache: PagedKVCache) -> _Graph:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=self._device)

        g = _Graph(
            graph=torch.cuda.CUDAGraph(),
            ids=zeros(b),
            positions=zeros(b),
            slots=zeros(b),
            lens=zeros(b),
            tables=zeros(b, w),
            rows=torch.arange(b, device=self._device),
        )
        # Loaded before the warm-up runs: they write this batch's K/V, as its replay will.
        self._load(g, batch)
        side = torch.cuda.Stream(self._device)
        side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(side):
            for _ in range(2):  # lazy initialisation (cuBLAS workspaces, kernels) off-graph
                self._static_forward(g, cache)
        torch.cuda.current_stream(self._device).wait_stream(side)
        with torch.cuda.graph(g.graph, pool=self._pool):
            g.logits = self._static_forward(g, cache)
        g.graph.replay()
        self._graphs[b, w] = g
        return g


def _decode_inputs(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """A pure decode batch's block tables and lengths (``covers`` checked it has them)."""
    if batch.decode_block_tables is None or batch.decode_lens is None:
        raise ValueError("a CUDA graph replays decode batches only")
    return batch.decode_block_tables, batch.decode_lens
