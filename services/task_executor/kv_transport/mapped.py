"""The decode side's read-only mappings of prefill TEs' arenas (``pool.py``), kept between
pulls: a pull over shared memory reads the prefill's KV where it lies.

A prefill TE reuses its arenas, and so this side keeps the mappings it made of them: a read
through a mapping made afresh takes a page fault per 4 KiB page (new mappings are populated
up front, which costs less, but still costs). A kept mapping holds the arena's memory even
once its owner has unlinked it, so every new mapping first drops the mappings whose name is
gone (or names another file now), and the oldest go past ``budget_bytes``; a timer checks
every ``PRUNE_S`` while mappings are kept, so a prefill TE's dropped arena does not stay
resident here for long.

Only arena names of ours are opened (``shm.checked_path``), read-only, without following
links, and only regular files at least as large as the KV read from them.
"""

from __future__ import annotations

import asyncio
import collections
import mmap
import os
import stat

import numpy as np

from services.task_executor.kv_transport import shm
from services.task_executor.kv_transport.per_loop import PerLoop

DEFAULT_BUDGET_BYTES = 8 << 30
PRUNE_S = 10.0


class MappedArenas:
    """Prefill TEs' arenas mapped on this side, by name. Event-loop thread only."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.budget_bytes = budget_bytes
        # path -> (device, inode, the whole file, read-only), least recently used first
        self._maps: collections.OrderedDict[str, tuple[int, int, np.ndarray]] = (
            collections.OrderedDict()
        )
        self._pruning: asyncio.TimerHandle | None = None

    def get(self, path: str, nbytes: int) -> np.ndarray:
        """The first ``nbytes`` of the arena ``path``, read-only (``OSError`` if it cannot
        be: not an arena name, no such file, too small). A name is never used again (128
        random bits), so a mapping kept under it is the file the prefill names now."""
        cached = self._maps.get(path)
        if cached is not None and cached[2].size >= nbytes:
            self._maps.move_to_end(path)
            return cached[2][:nbytes]
        self.prune()
        p = shm.checked_path(path, shm.ARENA_PREFIX)
        if p is None:
            raise OSError(f"not a KV arena name: {path!r}")
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size < max(nbytes, 1):
                raise OSError(f"{path} is no arena for {nbytes} bytes")
            mm = mmap.mmap(
                fd, st.st_size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ
            )
        finally:
            os.close(fd)  # the mapping keeps its own reference
        whole = np.frombuffer(mm, dtype=np.uint8)  # read-only; keeps the mapping alive
        self._maps[path] = (st.st_dev, st.st_ino, whole)
        while len(self._maps) > 1 and self.mapped_bytes > self.budget_bytes:
            self._maps.popitem(last=False)
        self._prune_later()
        return whole[:nbytes]

    @property
    def mapped_bytes(self) -> int:
        return sum(a.size for _, _, a in self._maps.values())

    def prune(self) -> None:
        """Drop the mappings of arenas whose owner has unlinked them (a result still read
        keeps its view of the mapping until it is gone)."""
        for path, (dev, ino, _) in list(self._maps.items()):
            try:
                st = os.stat(path, follow_symlinks=False)
            except OSError:
                del self._maps[path]
                continue
            if (st.st_dev, st.st_ino) != (dev, ino):
                del self._maps[path]

    def _prune_later(self) -> None:
        if self._pruning is None:
            loop = asyncio.get_running_loop()
            self._pruning = loop.call_later(PRUNE_S, self._prune_tick)

    def _prune_tick(self) -> None:
        self._pruning = None
        self.prune()
        if self._maps:
            self._prune_later()

    def clear(self) -> None:
        if self._pruning is not None:
            self._pruning.cancel()
            self._pruning = None
        self._maps.clear()


_BY_LOOP = PerLoop(MappedArenas)


def default_mapped() -> MappedArenas:
    """The running event loop's mappings (a TE pulls on one loop)."""
    return _BY_LOOP.get()
