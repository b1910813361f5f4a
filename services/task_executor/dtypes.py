"""The floating-point dtypes meshserve runs, stores and moves (weights in the host cache, KV
exports, engines' compute), by the name checkpoints, files and settings give them."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (a key of ``DTYPES`` for the dtypes it holds)."""
    return str(dtype).removeprefix("torch.")
