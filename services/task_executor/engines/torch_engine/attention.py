"""Causal attention of one request's new tokens (prefill) over its keys, GQA without repeating K/V.

On CUDA this is ``scaled_dot_product_attention`` (flash kernels), and on a CPU with AMX too:
there torch's CPU flash kernel runs its products on AMX tiles, and measured on a 2-core
Sapphire Rapids host it beat the blocked path below 1.8-2.2x in bf16 (a Qwen2-0.5B-shaped
layer: 14 vs 30 ms at 2,048 tokens, 187 vs 377 ms at 8,192) and 1.5x in float32; with a
mask for a chunk after cached keys, 1.1-2.7x. Elsewhere (``sdpa_is_fastest``), on a CPU
without AMX, torch's flash kernel for bf16 runs far below the matmul rate: measured on a
2-core AVX-512 BF16 host, a 512-token
Qwen2-0.5B-shaped layer took 6.5-8 ms in SDPA, whether the inputs were contiguous or not and
with or without repeated K/V, while its two matmuls take about 0.6 ms each. So on CPU the
queries are taken in blocks of ``BLOCK`` tokens; each block is two batched matmuls (one per
K/V head, the query heads that share it stacked as rows) over the keys up to the block's last
position only, with the causal mask applied to the block's own diagonal part. That measured
2.7-3.2 ms for the same layer, and skips the upper half of the score matrix as flash
attention does.

Between the two matmuls, torch's way is three passes over a score matrix of tens of MiB
(mask, float32 softmax into a new tensor, cast back into another): at 4k tokens that was half
the time of the block. Where the C kernels build (``cpu_kernels.causal_softmax``), one
in-place pass masks, softmaxes and rounds instead: 2.3x faster for a 128-query block over
4,096 keys (5.4 -> 2.3 ms, 2-core AVX-512 host).

Precision is that of transformers' eager attention: scores come out of the matmul in the
model's dtype, the softmax runs in float32 and its result is cast back before the product
with V.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

BLOCK = 128

# In place: (scores [kv_heads, m, group, keys], keys the first query sees) -> probabilities.
Softmax = Callable[[torch.Tensor, int], torch.Tensor]


@functools.lru_cache(maxsize=8)
def _upper(n: int, device: torch.device) -> torch.Tensor:
    """``[n, 1, n]``, True above the diagonal: query i does not see key j > i."""
    return torch.ones(n, n, dtype=torch.bool, device=device).triu(1)[:, None, :]


def sdpa_is_fastest(device: torch.device) -> bool:
    """Whether torch's ``scaled_dot_product_attention`` is the fastest prefill attention on
    ``device``: on a GPU, and on a CPU whose flash kernel runs on AMX tiles."""
    return device.type != "cpu" or torch.cpu._is_amx_tile_supported()


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start_pos: int,
    softmax: Softmax | None = None,
    *,
    sdpa: bool | None = None,
) -> torch.Tensor:
    """q ``[n, heads, hd]`` at positions ``start_pos .. start_pos + n - 1``; k/v
    ``[start_pos + n, kv_heads, hd]``, every key up to the last query. Returns
    ``[n, heads * hd]``. Query head h uses K/V head ``h // (heads // kv_heads)``.
    ``sdpa``: torch's SDPA (default on a GPU) or, on CPU, the blocked path, where ``softmax``
    (``cpu_kernels.causal_softmax``) replaces torch's mask and softmax."""
    if not (q.device.type != "cpu" if sdpa is None else sdpa):
        return _blocked(q, k, v, start_pos, softmax)
    n, heads, hd = q.shape
    qp, kp, vp = (t.transpose(0, 1)[None] for t in (q, k, v))
    if start_pos == 0:
        o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
    else:
        ctx = start_pos + n
        qpos = torch.arange(start_pos, ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, enable_gqa=True)
    return o[0].transpose(0, 1).reshape(n, heads * hd)


def _blocked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start_pos: int,
    softmax: Softmax | None = None,
) -> torch.Tensor:
    n, heads, hd = q.shape
    n_kv = k.shape[1]
    group = heads // n_kv
    # Scaled before the product: the queries are far smaller than the scores (and for a
    # power-of-two head size the rounding is the same).
    qg = (q * hd**-0.5).reshape(n, n_kv, group, hd).transpose(0, 1)  # [kv, n, group, hd]
    kc = k.transpose(0, 1).contiguous()  # [kv, ctx, hd]
    vc = v.transpose(0, 1).contiguous()
    out = torch.empty(n, n_kv, group, hd, dtype=q.dtype, device=q.device)
    for s in range(0, n, BLOCK):
        e = min(n, s + BLOCK)
        m, end = e - s, start_pos + e  # queries in the block; keys they may see
        qb = qg[:, s:e].reshape(n_kv, m * group, hd)
        scores = torch.bmm(qb, kc[:, :end].transpose(1, 2)).view(n_kv, m, group, end)
        if softmax is not None:
            probs = softmax(scores, start_pos + s + 1).view(n_kv, m * group, end)
        else:
            # Keys before the block's first position are visible to all of it; the block's
            # own positions form the causal triangle.
            scores[..., start_pos + s :].masked_fill_(_upper(m, q.device), float("-inf"))
            # float32 softmax straight from the model-dtype scores (no float32 copy first).
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            probs = probs.view(n_kv, m * group, end)
        out[s:e] = torch.bmm(probs, vc[:, :end]).view(n_kv, m, group, hd).transpose(0, 1)
    return out.view(n, heads * hd)


def additive_mask(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``valid``, -inf elsewhere: SDPA on CPU runs a float mask faster than a boolean
    one (batch 8, 1,088 keys: about 0.5 vs 0.7 ms per layer)."""
    bias = torch.zeros(valid.shape, dtype=dtype, device=valid.device)
    return bias.masked_fill_(~valid, float("-inf"))


def gathered_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """One query token per request over its keys gathered into a padded batch: q ``[batch,
    heads, hd]``, k/v ``[batch, kv_heads, keys, hd]``, ``bias`` an ``additive_mask``
    ``[batch, 1, 1, keys]``. Returns ``[batch, heads * hd]``. The query heads that share a K/V
    head are laid out as its query rows (h = kv * group + g, transformers' repeat_kv order),
    so GQA needs no K/V repetition. (The CPU C kernel in ``cpu_kernels`` computes the same
    without the gather.)"""
    b, heads, hd = q.shape
    n_kv = k.shape[1]
    o = F.scaled_dot_product_attention(q.reshape(b, n_kv, heads // n_kv, hd), k, v, attn_mask=bias)
    return o.reshape(b, heads * hd)
