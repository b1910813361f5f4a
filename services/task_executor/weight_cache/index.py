"""The host cache's ``index.json`` read without torch: what a TE reports in its heartbeat
(which models the host's cache holds, and how much of each) and the store's bookkeeping.

``{"entries": {key: {first_seen, last_use, uses, hits, misses, alpha}},
"models": {model: {keys, bytes, fingerprints}}}``, written by ``store`` under the
directory's lock (by rename: readers never see half of it)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from shared.messages.cluster import CachedWeights
from shared.settings import Settings

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


def used_bytes(root: Path) -> int:
    return sum(entry_size(p) for p in (root / "tensors").glob(f"*{SUFFIX}"))


def budget_bytes(settings: Settings) -> int:
    """The cache's budget: ``MESHSERVE_HOST_CACHE_BYTES``, else a quarter of the host's
    memory, at most half of what the cache directory's filesystem has free (a tmpfs's size
    is its own limit: half the host's memory by default). The directory must exist."""
    hc = settings.host_cache
    if hc.bytes is not None:
        return hc.bytes
    st = os.statvfs(hc.dir)
    free = st.f_bavail * st.f_frsize
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(memory // 4, free // 2)


def metadata(root: Path) -> tuple[dict[str, dict[str, Any]], dict[str, CachedWeights]]:
    """The cache's reuse-store metadata: every entry present with its size and statistics,
    and every model's residency (what ``Keys.host_cache`` publishes)."""
    index = read_index(root)
    tensors = {}
    for path in (root / "tensors").glob(f"*{SUFFIX}"):
        key = path.name.removesuffix(SUFFIX)
        tensors[key] = {"size": entry_size(path), **index["entries"].get(key, {})}
    return tensors, residencies(root)
