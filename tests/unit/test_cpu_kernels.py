"""The torch engine's C decode attention: same results as torch's gather + SDPA path over the
paged cache, for the shapes and dtypes it takes; torch's ops where it cannot run."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from devtools.kernel_cases import decode_case
from services.task_executor.engines.base import EngineRequest
from services.task_executor.engines.factory import create_engine
from services.task_executor.engines.torch_engine import TorchEngine, cpu_kernels
from services.task_executor.engines.torch_engine.kv_cache import PagedKVCache
from shared.settings import Settings
from tests.engines import drain, tokens
from tests.unit.test_torch_engine import _write_tiny_llama, greedy

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None, reason="no C compiler on PATH: the engine runs torch's ops"
)


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
    case = decode_case(
        dtype=dtype,
        heads=heads,
        kv_heads=kv_heads,
        hd=hd,
        block_size=block_size,
        lens=lens,
        seed=0,
    )
    got = case.kernel_path(kernel)
    want = case.torch_path(case.bias())
    assert got.shape == want.shape and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        return
    # bf16: both round; the kernel must be at least as close as torch's path to the exact
    # result (float32 attention over the same bf16 inputs).
    upcast = dataclasses.replace(case, q=case.q.float(), cache=_as_float32(case.cache))
    exact = upcast.torch_path(upcast.bias())
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


def test_build_is_cached_per_host_and_fails_clearly_without_a_compiler(tmp_path: Path) -> None:
    toolchain = cpu_kernels.Toolchain(cache_dir=tmp_path / "kernels")
    first = cpu_kernels.build(toolchain=toolchain)
    assert first.parent == tmp_path / "kernels" and first.exists()
    mtime = first.stat().st_mtime_ns
    assert cpu_kernels.build(toolchain=toolchain) == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary left behind

    with pytest.raises(RuntimeError, match="no C compiler"):
        cpu_kernels.build(toolchain=cpu_kernels.Toolchain(cc="no-such-compiler"))


def test_the_settings_choose_the_toolchain(tmp_path: Path) -> None:
    """MESHSERVE_KERNEL_CACHE and CC reach the kernel a TE builds."""
    settings = Settings.load({"MESHSERVE_KERNEL_CACHE": str(tmp_path / "k"), "CC": "gcc"})
    engine = create_engine(
        "m", _write_tiny_llama(tmp_path / "m"), settings.with_values(device="cpu", dtype="float32")
    )
    try:
        assert engine.runner.decode_kernel is not None  # type: ignore[attr-defined]
        assert [p.suffix for p in (tmp_path / "k").iterdir()] == [".so"]
    finally:
        engine.close()


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
