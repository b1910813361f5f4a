"""The CPU's blocked causal attention against torch's SDPA, across block boundaries."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.task_executor.engines.torch_engine.attention import BLOCK, causal_attention


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> torch.Tensor:
    n, heads, hd = q.shape
    ctx = k.shape[0]
    group = heads // k.shape[1]
    kr, vr = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    mask = torch.arange(ctx)[None, :] <= torch.arange(start_pos, ctx)[:, None]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).double(),
        kr.transpose(0, 1).double(),
        vr.transpose(0, 1).double(),
        attn_mask=mask,
    )
    return o.transpose(0, 1).reshape(n, heads * hd)


@pytest.mark.parametrize(
    ("n", "start_pos"),
    [(1, 0), (7, 0), (BLOCK, 0), (BLOCK + 1, 0), (3 * BLOCK - 5, 0), (40, 300), (BLOCK + 9, 17)],
)
@pytest.mark.parametrize(("heads", "kv_heads"), [(14, 2), (4, 4)])
def test_blocked_matches_sdpa_fp32(n: int, start_pos: int, heads: int, kv_heads: int) -> None:
    g = torch.Generator().manual_seed(n * 1000 + start_pos)
    hd = 32
    # Scores with a realistic spread (some keys dominate), not just noise around zero.
    q = torch.randn(n, heads, hd, generator=g) * 2
    k = torch.randn(start_pos + n, kv_heads, hd, generator=g) * 2
    v = torch.randn(start_pos + n, kv_heads, hd, generator=g)
    got = causal_attention(q, k, v, start_pos)
    assert got.shape == (n, heads * hd)
    torch.testing.assert_close(got.double(), reference(q, k, v, start_pos), atol=1e-5, rtol=1e-5)


def test_blocked_bf16_is_as_close_as_sdpa_bf16() -> None:
    """bf16 rounds scores and probabilities; the error stays that of torch's own bf16 SDPA."""
    g = torch.Generator().manual_seed(0)
    n, heads, kv_heads, hd = 300, 14, 2, 64
    q = torch.randn(n, heads, hd, generator=g)
    k = torch.randn(n, kv_heads, hd, generator=g)
    v = torch.randn(n, kv_heads, hd, generator=g)
    exact = reference(q, k, v, 0)
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    ours = (causal_attention(qb, kb, vb, 0).double() - exact).abs().max().item()
    sdpa = (
        F.scaled_dot_product_attention(
            qb.transpose(0, 1)[None],
            kb.transpose(0, 1)[None],
            vb.transpose(0, 1)[None],
            is_causal=True,
            enable_gqa=True,
        )[0]
        .transpose(0, 1)
        .reshape(n, heads * hd)
    )
    theirs = (sdpa.double() - exact).abs().max().item()
    assert ours <= max(2 * theirs, 1e-2), (ours, theirs)


def test_views_of_a_fused_qkv_work() -> None:
    """The model passes strided views of one fused q/k/v tensor."""
    g = torch.Generator().manual_seed(1)
    n, heads, kv_heads, hd = 150, 4, 2, 16
    qkv = torch.randn(n, heads + 2 * kv_heads, hd, generator=g)
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    got = causal_attention(q, k, v, 0)
    want = causal_attention(q.contiguous(), k.contiguous(), v.contiguous(), 0)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got.double(), reference(q, k, v, 0), atol=1e-5, rtol=1e-5)
