"""The host cache's ``index.json`` read without torch: what a TE reports in its heartbeat
(which models the host's cache holds, and how much of each) and the store's bookkeeping.

``{"entries": {key: {first_seen, last_use, uses, hits, misses, alpha}},
"models": {model: {keys, bytes, fingerprints}}}``, written by ``store`` under the
directory's lock (by rename: readers never see half of it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shared.messages.cluster import CachedWeights

SUFFIX = ".t"  # of a tensor file's name: KEY.t


def read_index(root: Path) -> dict[str, Any]:
    try:
        index: dict[str, Any] = json.loads((root / "index.json").read_text())
    except (FileNotFoundError, ValueError):
        index = {}
    index.setdefault("entries", {})
    index.setdefault("models", {})
    return index


def entry_path(root: Path, key: str) -> Path:
    return root / "tensors" / f"{key}{SUFFIX}"


def entry_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def residencies(root: Path) -> dict[str, CachedWeights]:
    """What the cache at ``root`` holds of every model loaded through it: Tangram's
    S_resident of S, by model."""
    out = {}
    for model, manifest in read_index(root)["models"].items():
        resident = sum(entry_size(entry_path(root, k)) for k in manifest["keys"])
        out[model] = CachedWeights(resident_bytes=resident, total_bytes=manifest["bytes"])
    return out
