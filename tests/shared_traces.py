"""Where the real traces are: the repository's ``traces/`` (they ship with it), else
``$MESHSERVE_TRACES_DIR``. A checkout without them (a sparse or trimmed copy) still runs the
replay and simulator tests on the slice kept in tests/data (``azure_slice``); a test of a
whole trace fails there (they ship with the repository: a missing one is a broken checkout)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "traces"

AZURE_HEAD = ROOT / "tests" / "data" / "azure_llm_2023_conv_head300.csv"


def trace_path(name: str) -> Path:
    """The first place that has ``name``; the repository's ``traces/`` when none has it."""
    candidates = [TRACES / name]
    if env := os.environ.get("MESHSERVE_TRACES_DIR"):
        candidates.append(Path(env) / name)
    return next((p for p in candidates if p.is_file()), candidates[0])


def azure_slice() -> Path:
    """The Azure conversation trace, or its first 300 requests kept in tests/data: enough for
    a replay or a simulation of a few hundred requests, wherever the checkout is."""
    full = trace_path("azure_llm_2023_conv.csv")
    return full if full.is_file() else AZURE_HEAD
