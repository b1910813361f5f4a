"""The torch engine's C decode attention: same results as torch's gather + SDPA path over the
paged cache, for the shapes and dtypes it takes; torch's ops where it cannot run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from services.task_executor.engines.base import EngineRequest
from services.task_executor.engines.torch_engine import TorchEngine, cpu_kernels
from services.task_executor.engines.torch_engine.attention import (
    additive_mask,
    gathered_decode_attention,
)
from services.task_executor.engines.torch_engine.kv_cache import PagedKVCache
from tests.engines import drain, tokens
from tests.unit.test_torch_engine import _write_tiny_llama, greedy

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None, reason="no C compiler on PATH: the engine runs torch's ops"
)


def _reference(q, cache, tables, lens, block_size):
    """The engine's torch path: gather whole blocks, mask the padding, SDPA with GQA rows."""
    ck, cv = cache.gather(0, tables)
    valid = torch.arange(tables.shape[1] * block_size)[None, :] < lens[:, None]
    return gathered_decode_attention(q, ck, cv, additive_mask(valid[:, None, None, :], q.dtype))


def _as_float32(cache: PagedKVCache) -> PagedKVCache:
    k, v = cache.k[0], cache.v[0]
    out = PagedKVCache(
        num_layers=1,
        num_blocks=k.shape[0],
        block_size=k.shape[1],
        num_kv_heads=k.shape[2],
        head_dim=k.shape[3],
        dtype=torch.float32,
        device=CPU,
    )
    out.k[0].copy_(k)
    out.v[0].copy_(v)
    return out


@pytest.mark.parametrize(
    ("dtype", "heads", "kv_heads", "hd", "block_size", "lens"),
    [
        (torch.bfloat16, 14, 2, 64, 16, [600, 1, 16, 17, 33, 250]),  # Qwen2-0.5B's shape
        (torch.float32, 14, 2, 64, 16, [600, 1, 16, 17]),
        (torch.float32, 8, 8, 128, 4, [9, 3, 40]),  # no GQA, the other specialised head size
        (torch.bfloat16, 4, 2, 8, 4, [1, 7, 12]),  # the generic head size path
        (torch.float32, 32, 2, 32, 16, [50, 70]),  # 16 query heads per K/V head: the limit
    ],
)
def test_decode_attention_matches_torch(dtype, heads, kv_heads, hd, block_size, lens) -> None:
    kernel = cpu_kernels.decode_attention(
        dtype=dtype, device=CPU, num_heads=heads, num_kv_heads=kv_heads, head_dim=hd
    )
    assert kernel is not None
    gen = torch.Generator().manual_seed(0)
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
    # Blocks scattered over the cache, as a busy allocator leaves them; padding entries 0.
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lens), width, dtype=torch.int64)
    for i, n in enumerate(lens):
        used = -(-n // block_size)
        tables[i, :used] = perm[i * width : i * width + used]
    lens_t = torch.tensor(lens, dtype=torch.int64)
    # Queries as the model has them: the first heads of a wider row (q, then k and v).
    rows = torch.randn(len(lens), heads + 2 * kv_heads, hd, generator=gen).to(dtype)
    q = rows[:, :heads]

    got = kernel(q, cache.k[0], cache.v[0], tables, lens_t)
    want = _reference(q, cache, tables, lens_t, block_size)
    assert got.shape == want.shape and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        return
    # bf16: both round; the kernel must be at least as close as torch's path to the exact
    # result (float32 attention over the same bf16 inputs).
    exact = _reference(q.float(), _as_float32(cache), tables, lens_t, block_size)
    err_kernel = (got.float() - exact).abs().max().item()
    err_torch = (want.float() - exact).abs().max().item()
    assert err_kernel <= max(err_torch, 1e-3), (err_kernel, err_torch)


def test_decode_attention_is_declined_where_it_cannot_run() -> None:
    shape = {"num_heads": 14, "num_kv_heads": 2, "head_dim": 64}
    assert cpu_kernels.decode_attention(dtype=torch.float16, device=CPU, **shape) is None
    meta = torch.device("meta")
    assert cpu_kernels.decode_attention(dtype=torch.float32, device=meta, **shape) is None
    wide = {"num_heads": 34, "num_kv_heads": 2, "head_dim": 64}
    assert cpu_kernels.decode_attention(dtype=torch.float32, device=CPU, **wide) is None
    big = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 512}
    assert cpu_kernels.decode_attention(dtype=torch.float32, device=CPU, **big) is None


def test_build_is_cached_per_host_and_fails_clearly_without_a_compiler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MESHSERVE_KERNEL_CACHE", str(tmp_path / "kernels"))
    first = cpu_kernels.build()
    assert first.parent == tmp_path / "kernels" and first.exists()
    mtime = first.stat().st_mtime_ns
    assert cpu_kernels.build() == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary left behind

    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(RuntimeError, match="no C compiler"):
        cpu_kernels.build()


def test_engine_outputs_are_the_same_with_and_without_the_kernel(tmp_path: Path) -> None:
    # float32: the two paths agree to 1e-6, so greedy tokens must be identical (in bf16 each
    # path rounds its own way, and a random tiny model has near ties).
    model = _write_tiny_llama(tmp_path / "tiny")
    prompts = [[1, 2, 3], list(range(5, 40)), [7] * 20, list(range(60, 90))]

    def run(cpu_kernels: bool) -> list[list[int]]:
        engine = TorchEngine(
            model,
            device="cpu",
            dtype="float32",
            block_size=4,
            num_kv_blocks=128,
            cpu_kernels=cpu_kernels,
        )
        assert (engine.runner.decode_kernel is not None) == cpu_kernels
        for i, p in enumerate(prompts):
            engine.add_request(EngineRequest(f"r{i}", p, greedy(24)))
        outs = drain(engine)
        engine.close()
        return [tokens(outs[f"r{i}"]) for i in range(len(prompts))]

    with_kernel, torch_ops = run(True), run(False)
    assert all(len(t) == 24 for t in with_kernel)
    assert with_kernel == torch_ops
