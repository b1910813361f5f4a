"""Where the real traces are: ``../shared/traces`` beside the checkout (the documented place),
``$MESHSERVE_TRACES_DIR``, or the workspace's copy when the checkout lives elsewhere (CI
clones into a temporary directory)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


AZURE_HEAD = ROOT / "tests" / "data" / "azure_llm_2023_conv_head300.csv"


def trace_path(name: str) -> Path:
    """The first place that has ``name``; the documented one when none has it (callers skip
    on ``not path.is_file()``)."""
    candidates = [ROOT.parent / "shared" / "traces" / name]
    if env := os.environ.get("MESHSERVE_TRACES_DIR"):
        candidates.insert(0, Path(env) / name)
    candidates.append(Path("/work/shared/traces") / name)
    return next((p for p in candidates if p.is_file()), candidates[0])


def azure_slice() -> Path:
    """The Azure conversation trace, or its first 300 requests kept in tests/data: enough for
    a replay or a simulation of a few hundred requests, wherever the checkout is."""
    full = trace_path("azure_llm_2023_conv.csv")
    return full if full.is_file() else AZURE_HEAD
