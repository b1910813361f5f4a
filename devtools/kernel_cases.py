"""Decode-attention inputs over a paged cache as the model has them, with both of its
paths: torch's gather + SDPA (the engine's fallback) and the C kernel. The kernel's test
(tests/unit/test_cpu_kernels.py) checks one against the other on these cases and
``scripts/bench-kernels`` times them."""

from __future__ import annotations

import dataclasses

import torch

from services.task_executor.engines.torch_engine import cpu_kernels
from services.task_executor.engines.torch_engine.attention import (
    additive_mask,
    gathered_decode_attention,
)
from services.task_executor.engines.torch_engine.kv_cache import PagedKVCache

CPU = torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    """One decode step's attention inputs over a paged cache (layer 0), as the model has them:
    ``q`` ``[batch, heads, hd]``, the first heads of wider q/k/v rows; ``tables`` padded with
    block 0; ``lens`` the tokens each request attends to."""

    q: torch.Tensor
    cache: PagedKVCache
    tables: torch.Tensor
    lens: torch.Tensor

    def bias(self) -> torch.Tensor:
        """The additive padding mask, built once per forward in the model."""
        keys = torch.arange(self.tables.shape[1] * self.cache.block_size)
        valid = keys[None, :] < self.lens[:, None]
        return additive_mask(valid[:, None, None, :], self.q.dtype)

    def torch_path(self, bias: torch.Tensor) -> torch.Tensor:
        """The engine's fallback: gather whole blocks, then SDPA with GQA rows."""
        ck, cv = self.cache.gather(0, self.tables)
        return gathered_decode_attention(self.q, ck, cv, bias)

    def kernel_path(self, kernel: cpu_kernels.DecodeAttention) -> torch.Tensor:
        return kernel(self.q, self.cache.k[0], self.cache.v[0], self.tables, self.lens)


def decode_case(
    *,
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    hd: int,
    block_size: int,
    lens: list[int],
    seed: int,
) -> DecodeCase:
    """Random K/V and queries, each request's blocks scattered over the cache as a busy
    allocator leaves them."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in lens)
    num_blocks = len(lens) * width + 3
    cache = PagedKVCache(
        num_layers=1,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=kv_heads,
        head_dim=hd,
        dtype=dtype,
        device=CPU,
    )
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=gen))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=gen))
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lens), width, dtype=torch.int64)
    for i, n in enumerate(lens):
        used = -(-n // block_size)
        tables[i, :used] = perm[i * width : i * width + used]
    rows = torch.randn(len(lens), heads + 2 * kv_heads, hd, generator=gen).to(dtype)
    return DecodeCase(rows[:, :heads], cache, tables, torch.tensor(lens, dtype=torch.int64))
