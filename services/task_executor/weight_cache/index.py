"""The host cache's ``index.json`` read without torch: what a TE reports in its heartbeat
(which models the host's cache holds, and how much of each) and the store's bookkeeping.

``{"entries": {key: {first_seen, last_use, uses, hits, misses, alpha}},
"models": {model: {keys, bytes, fingerprints}}}``, written by ``store`` under the
directory's lock (by rename: readers never see half of it)."""

from __future__ import annotations

import dataclasses
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
    return read_state(root, 0).models


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


@dataclasses.dataclass(frozen=True, slots=True)
class CacheState:
    """The cache as its TEs report it: every entry present with its size and statistics,
    every model's residency, the room left (what ``Keys.host_cache`` publishes and the
    heartbeats carry)."""

    tensors: dict[str, dict[str, Any]]
    models: dict[str, CachedWeights]
    free_bytes: int


def read_state(root: Path, budget: int) -> CacheState:
    """One read of the index and one stat of each entry."""
    index = read_index(root)
    sizes = {
        p.name.removesuffix(SUFFIX): entry_size(p) for p in (root / "tensors").glob(f"*{SUFFIX}")
    }
    tensors = {k: {"size": n, **index["entries"].get(k, {})} for k, n in sizes.items()}
    models = {
        model: CachedWeights(
            resident_bytes=sum(sizes.get(k, 0) for k in manifest["keys"]),
            total_bytes=manifest["bytes"],
        )
        for model, manifest in index["models"].items()
    }
    return CacheState(tensors, models, max(budget - sum(sizes.values()), 0))
