"""The torch engine's C kernels: decode attention gives the same results as torch's gather +
SDPA path over the paged cache, and the position-wise kernels those of the model's torch ops,
for the shapes and dtypes they take; torch's ops where they cannot run."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from devtools.kernel_cases import decode_case
from services.task_executor.engines.base import EngineRequest
from services.task_executor.engines.factory import create_engine
from services.task_executor.engines.torch_engine import TorchEngine, cpu_kernels
from services.task_executor.engines.torch_engine.kv_cache import PagedKVCache
from shared.native import Toolchain
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
        (torch.bfloat16, 8, 2, 128, 16, [1, 31, 300]),  # bf16 at 128, odd lengths
        (torch.bfloat16, 10, 2, 64, 4, [5, 64]),  # a group the fast path does not specialise
        (torch.bfloat16, 4, 2, 8, 4, [1, 7, 12]),  # the generic head size path
        (torch.float32, 32, 2, 32, 16, [50, 70]),  # 16 query heads per K/V head: the limit
        # AMX's path (where the CPU has it): 16 heads in two passes, blocks of 32, many chunks
        (torch.bfloat16, 32, 2, 64, 32, [700, 129, 5]),
        (torch.bfloat16, 12, 4, 128, 16, [1000, 128]),
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
    toolchain = Toolchain(cache_dir=tmp_path / "kernels")
    first = cpu_kernels.build(toolchain=toolchain)
    assert first.parent == tmp_path / "kernels" and first.exists()
    mtime = first.stat().st_mtime_ns
    assert cpu_kernels.build(toolchain=toolchain) == first and first.stat().st_mtime_ns == mtime
    # No temporary left behind: the library and the lock that one compiler at a time holds.
    assert sorted(p.name for p in first.parent.iterdir()) == [
        first.with_suffix(".lock").name,
        first.name,
    ]

    with pytest.raises(RuntimeError, match="no C compiler"):
        cpu_kernels.build(toolchain=Toolchain(cc="no-such-compiler"))


def test_the_settings_choose_the_toolchain(tmp_path: Path) -> None:
    """MESHSERVE_KERNEL_CACHE and CC reach the kernel a TE builds."""
    settings = Settings.load({"MESHSERVE_KERNEL_CACHE": str(tmp_path / "k"), "CC": "gcc"})
    engine = create_engine(
        "m", _write_tiny_llama(tmp_path / "m"), settings.with_values(device="cpu", dtype="float32")
    )
    try:
        assert engine.runner.decode_kernel is not None  # type: ignore[attr-defined]
        assert sorted(p.suffix for p in (tmp_path / "k").iterdir()) == [".lock", ".so"]
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("m", "group", "start"), [(128, 7, 0), (37, 7, 300), (5, 1, 3), (1, 4, 0)])
def test_causal_softmax_matches_torchs_mask_and_softmax(dtype, m, group, start) -> None:
    from services.task_executor.engines.torch_engine.attention import _upper

    kernel = cpu_kernels.causal_softmax(dtype=dtype, device=CPU)
    assert kernel is not None
    gen = torch.Generator().manual_seed(m + start)
    cols = start + m
    scores = (torch.randn(2, m, group, cols, generator=gen) * 4).to(dtype)
    ref = scores.clone()
    ref[..., start:].masked_fill_(_upper(m, CPU), float("-inf"))
    ref = torch.softmax(ref, dim=-1, dtype=torch.float32).to(dtype)
    out = kernel(scores, start + 1)
    assert out.data_ptr() == scores.data_ptr()  # in place
    assert torch.equal(out == 0, ref == 0)  # masked exactly where torch masks
    tol = 1e-6 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    with pytest.raises(ValueError):
        kernel(torch.zeros(2, m, group, cols + 1, dtype=dtype)[..., :cols], 1)  # strided
    with pytest.raises(ValueError):
        kernel(scores, cols + 1)


@pytest.mark.parametrize("start", [0, 200])
def test_prefill_attention_with_the_kernel_matches_torchs_ops(start) -> None:
    from services.task_executor.engines.torch_engine.attention import causal_attention

    kernel = cpu_kernels.causal_softmax(dtype=torch.bfloat16, device=CPU)
    assert kernel is not None
    gen = torch.Generator().manual_seed(start)
    n = 300  # three query blocks, the last one short
    q = torch.randn(n, 14, 64, generator=gen).to(torch.bfloat16)
    k = torch.randn(start + n, 2, 64, generator=gen).to(torch.bfloat16)
    v = torch.randn(start + n, 2, 64, generator=gen).to(torch.bfloat16)
    want = causal_attention(q, k, v, start)
    got = causal_attention(q, k, v, start, kernel)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert cpu_kernels.causal_softmax(dtype=torch.float16, device=CPU) is None
    assert cpu_kernels.causal_softmax(dtype=torch.float32, device=torch.device("meta")) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_position_wise_kernels_match_the_models_torch_ops(dtype) -> None:
    from services.task_executor.engines.torch_engine.model import _rms_norm

    ew = cpu_kernels.elementwise(dtype=dtype, device=CPU)
    assert ew is not None
    gen = torch.Generator().manual_seed(3)
    # bf16 rounds once where torch rounds after each op: within an ulp or two of bf16.
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    rows, dim = 37, 96

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    h, delta, weight = rand(rows, dim), rand(rows, dim), 1 + rand(dim) / 5
    want_h = h + delta
    want = _rms_norm(want_h, weight, 1e-6)
    got = ew.add_rms_norm(h, delta, weight, 1e-6)  # h is updated in place
    torch.testing.assert_close(h, want_h)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(ew.add_rms_norm(h, None, weight, 1e-6), want, **tol)

    gate_up = rand(rows, 2 * 80)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ew.silu_mul(gate_up), F.silu(gate) * up, **tol)

    heads, kv, hd, max_len = 6, 2, 16, 64
    qkv = rand(rows, heads + 2 * kv, hd)
    positions = torch.randint(0, max_len, (rows,), generator=gen)
    table = torch.rand(max_len, hd // 2, generator=gen) * 6
    cos = torch.cat((table.cos(), table.cos()), dim=-1).to(dtype)
    sin = torch.cat((table.sin(), table.sin()), dim=-1).to(dtype)
    qk = qkv[:, : heads + kv]
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    turned = torch.cat((-qk[..., hd // 2 :], qk[..., : hd // 2]), dim=-1)
    want_qk = qk * c + turned * s
    v_before = qkv[:, heads + kv :].clone()
    ew.rope_(qk, positions, cos, sin)  # in place, through the view
    torch.testing.assert_close(qkv[:, : heads + kv], want_qk, **tol)
    assert torch.equal(qkv[:, heads + kv :], v_before)  # V is not rotated

    with pytest.raises(ValueError):
        ew.silu_mul(gate_up[:, :-1])  # odd width
    with pytest.raises(ValueError):
        ew.add_rms_norm(h.float() if dtype != torch.float32 else h.double(), None, weight, 1e-6)
    assert cpu_kernels.elementwise(dtype=torch.float16, device=CPU) is None
    assert cpu_kernels.elementwise(dtype=dtype, device=torch.device("meta")) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_matmul_run_in_pieces_equals_one_run(dtype) -> None:
    """Inputs whose row count oneDNN runs slowly go in pieces (linear.SPLIT_ROWS)."""
    from services.task_executor.engines.torch_engine import linear

    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(40, 24, generator=gen).to(dtype)
    bias = torch.randn(40, generator=gen).to(dtype)
    # Where oneDNN cannot pack the dtype (bf16 on AVX2) the plain weight runs whole.
    packed = linear.pack(weight) if linear.can_pack(dtype, CPU) else weight
    low, high = linear.SPLIT_ROWS
    for rows in (low - 1, low + 1, (low + high) // 2, high):
        x = torch.randn(rows, 24, generator=gen).to(dtype)
        got = linear.linear(x, packed, bias)
        want = torch.cat([linear.linear(x[s : s + 100], packed, bias) for s in range(0, rows, 100)])
        assert got.shape == (rows, 40)
        torch.testing.assert_close(got, want)
