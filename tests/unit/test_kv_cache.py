"""The paged KV cache's memory: zeroed, and on CPU paid for only where it is written."""

import os

import pytest
import torch

from services.task_executor.engines.torch_engine.kv_cache import PagedKVCache, zeros


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zeros_are_zero_and_writable(dtype):
    t = zeros((3, 16, 2, 8), dtype=dtype, device=torch.device("cpu"))
    assert t.dtype == dtype and t.shape == (3, 16, 2, 8) and t.is_contiguous()
    assert not t.any()
    t.view(-1, 2, 8).index_copy_(0, torch.tensor([5]), torch.ones(1, 2, 8, dtype=dtype))
    assert t.sum().item() == 16


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_a_large_cache_costs_no_memory_until_written():
    before = _rss_bytes()
    cache = PagedKVCache(
        num_layers=4,
        num_blocks=4096,
        block_size=16,
        num_kv_heads=4,
        head_dim=64,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )  # 256 MiB of K and V
    grown = _rss_bytes() - before
    assert grown < 32 * 1024**2, f"allocating the cache made {grown >> 20} MiB resident"
    slots = torch.arange(64)
    cache.write(0, slots, torch.ones(64, 4, 64), torch.ones(64, 4, 64))
    assert cache.k[0].view(-1, 4, 64)[:64].eq(1).all()
    assert not cache.k[0].view(-1, 4, 64)[64:].any()
