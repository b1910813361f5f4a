"""Matrix multiplies against the weights, in the fastest layout the device offers.

On CPU, ``F.linear`` with a plain row-major weight gets a fraction of the memory bandwidth
that oneDNN reaches with the weight pre-packed into its blocked layout. Measured on the
Zen 4 / AMX dev host, one core, a decode step's worth of Qwen2-0.5B matrices (all distinct, so
nothing stays in cache): bf16 ~15 -> ~36 GB/s at 1 token, ~14 -> ~23 GB/s at 8 tokens; fp32
~18 -> ~27 GB/s. So on CPU every weight is packed once at load time and multiplied with
oneDNN's linear. On CUDA, and wherever oneDNN is missing or refuses the dtype, weights stay
plain and ``F.linear`` runs.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import xxhash

from shared import native

_PACKABLE = (torch.float32, torch.bfloat16)


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or dtype not in _PACKABLE or not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ones(8, 8, dtype=dtype)
        out = linear(torch.ones(2, 8, dtype=dtype), torch.ops.mkldnn._reorder_linear_weight(w, 1))
    except RuntimeError:
        return False
    return bool((out == 8).all())


# The batch size oneDNN picks the packed layout for. Decode batches are what it is tuned for
# (prefill is compute-bound and runs at the same rate with any hint). Measured on a 2-core AVX2
# host (fp32, Qwen2-0.5B matrices, 24 layers): hint 8 against hint 1 runs a decode step's layer
# matmuls 1.32x faster at 8 tokens and 1.29x at 16, the same at 1 token; the 152k x 896 lm_head
# 1.5x faster at 2-8 tokens and 1.09x slower at 1.
PACK_BATCH_HINT = 8


@functools.cache
def packed_form(dtype: torch.dtype) -> str:
    """What a packed weight's bytes depend on besides its values (the host cache's form of a
    packed matrix): oneDNN's layout for the dtype and batch hint, chosen by torch's oneDNN
    for this CPU's instruction set."""
    flags = xxhash.xxh3_64_hexdigest(native.cpu_flags().encode())
    return f"{dtype}|fused|onednn-linear-{PACK_BATCH_HINT}|torch-{torch.__version__}|cpu-{flags}"


def pack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's layout for ``weight`` ``[out, in]``, for decode-sized inputs (larger inputs
    still run)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)


# Between these row counts oneDNN's packed bf16 matmul runs at two thirds of its rate on either
# side (2-core Sapphire Rapids, oneDNN 3.12, a Qwen2-0.5B layer's four matrices: 2.4 TF/s at
# 512 and 1,536 rows, 1.5-1.8 from 768 to 1,280), so such inputs run in pieces of the lower
# bound: a 1,024-token prefill 0.66 -> 0.59 s. Above it, pieces cost more than they gain.
SPLIT_ROWS = (512, 1536)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for a plain or a packed weight; ``x`` is ``[tokens, in]``."""
    if weight.is_mkldnn:
        rows = x.shape[0]
        low, high = SPLIT_ROWS
        if low < rows < high:
            out = torch.empty(rows, weight.size(0), dtype=x.dtype, device=x.device)
            for s in range(0, rows, low):
                out[s : s + low] = linear(x[s : s + low], weight, bias)
            return out
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
