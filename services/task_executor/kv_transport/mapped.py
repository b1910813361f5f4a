"""The prefill side's mappings of pullers' segments (``pool.py``), kept between pulls.

A puller reuses its segments, and so the server keeps the mappings it made of them: a write
into a mapping made afresh takes a page fault per 4 KiB page, which costs more than the copy
(a 200 MB KV on this project's VMs: ~40 ms mapped afresh, ~17 ms into a kept mapping). A
kept mapping holds the segment's memory even once its owner has unlinked it, so every lookup
first drops the mappings whose name is gone (or names another file now), and the oldest go
past ``budget_bytes``.

Only segment names of ours are opened (``shm.checked_path``), without following links, and
only regular files at least as large as the KV that goes into them.
"""

from __future__ import annotations

import collections
import mmap
import os
import stat

import torch

from services.task_executor.kv_transport import shm

DEFAULT_BUDGET_BYTES = 8 << 30


class MappedSegments:
    """Pullers' segments mapped on this side, by name. Event-loop thread only."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.budget_bytes = budget_bytes
        # path -> (device, inode, the whole file as a uint8 tensor), least recently used first
        self._maps: collections.OrderedDict[str, tuple[int, int, torch.Tensor]] = (
            collections.OrderedDict()
        )

    def get(self, path: str, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of the segment ``path``, writable (``OSError`` if it cannot
        be: not a segment name, no such file, too small)."""
        self.prune()
        p = shm.checked_path(path, shm.SEGMENT_PREFIX)
        if p is None:
            raise OSError(f"not a KV segment name: {path!r}")
        cached = self._maps.get(path)
        if cached is not None and cached[2].numel() >= nbytes:
            self._maps.move_to_end(path)
            return cached[2][:nbytes]
        fd = os.open(p, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size < nbytes:
                raise OSError(f"{path} is no segment for {nbytes} bytes")
            mm = mmap.mmap(
                fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        finally:
            os.close(fd)  # the mapping keeps its own reference
        whole = torch.frombuffer(mm, dtype=torch.uint8)  # keeps the mapping alive
        self._maps[path] = (st.st_dev, st.st_ino, whole)
        while len(self._maps) > 1 and self.mapped_bytes > self.budget_bytes:
            self._maps.popitem(last=False)
        return whole[:nbytes]

    @property
    def mapped_bytes(self) -> int:
        return sum(t.numel() for _, _, t in self._maps.values())

    def prune(self) -> None:
        """Drop the mappings of segments whose owner has unlinked them (a write in flight
        keeps its view of the mapping until it ends)."""
        for path, (dev, ino, _) in list(self._maps.items()):
            try:
                st = os.stat(path, follow_symlinks=False)
            except OSError:
                del self._maps[path]
                continue
            if (st.st_dev, st.st_ino) != (dev, ino):
                del self._maps[path]

    def clear(self) -> None:
        self._maps.clear()
