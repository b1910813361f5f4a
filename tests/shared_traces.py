"""Where the real traces are: ``../shared/traces`` beside the checkout (the documented place),
``$MESHSERVE_TRACES_DIR``, or the workspace's copy when the checkout lives elsewhere (CI
clones into a temporary directory)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def trace_path(name: str) -> Path:
    """The first place that has ``name``; the documented one when none has it (callers skip
    on ``not path.is_file()``)."""
    candidates = [ROOT.parent / "shared" / "traces" / name]
    if env := os.environ.get("MESHSERVE_TRACES_DIR"):
        candidates.insert(0, Path(env) / name)
    candidates.append(Path("/work/shared/traces") / name)
    return next((p for p in candidates if p.is_file()), candidates[0])
