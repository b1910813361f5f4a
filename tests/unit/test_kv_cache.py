"""The paged KV cache's memory: zeroed, on CPU paid for only where it is written, and given
back when the pool shrinks."""

import os

import pytest
import torch

from services.task_executor.engines.torch_engine.kv_cache import PagedKVCache, zeros


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zeros_are_zero_and_writable(dtype):
    t, buf = zeros((3, 16, 2, 8), dtype=dtype, device=torch.device("cpu"))
    assert buf is not None and len(buf) == t.numel() * t.element_size()
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


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_a_shrunk_cache_gives_its_memory_back_and_grows_again_zeroed():
    cache = PagedKVCache(
        num_layers=2,
        num_blocks=2048,
        block_size=16,
        num_kv_heads=4,
        head_dim=64,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )  # 128 MiB of K and V
    assert cache.resizable and cache.limit == 2048
    blocks = cache.allocator.allocate(2048)
    ones = torch.ones(2048 * 16, 4, 64)
    slots = torch.arange(2048 * 16)
    for layer in range(2):
        cache.write(layer, slots, ones, ones)
    written = _rss_bytes()
    # Blocks in use hold the limit up: only what is free above them goes.
    cache.allocator.free(blocks[16:])
    assert cache.resize(8) == 16 and cache.limit == 16
    freed = written - _rss_bytes()
    assert freed > 100 * 1024**2, f"a shrink to 16 of 2048 blocks gave back {freed >> 20} MiB"
    assert cache.k[0][:16].eq(1).all() and not cache.k[1][16:].any()  # kept; fresh pages
    assert cache.allocator.num_free == 0
    # Grown again: the blocks come back, reading as zeros, costing nothing until written.
    assert cache.resize(4096) == 2048 and cache.allocator.num_free == 2032
    assert cache.allocator.allocate(1) == [16] and not cache.v[0][16].any()
