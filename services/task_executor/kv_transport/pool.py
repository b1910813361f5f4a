"""The decode side's shared-memory segments: a pull over shared memory lands in a segment of
this process's, which the result tensor maps without a copy, and which goes back to the pool
(to be written again by the next pull) when that tensor and every view of it are gone.

Reuse is the point: the first write of a tmpfs page allocates and zeroes it, which on this
project's VMs is slower than the copy that fills it (a 200 MB KV pulled on a 2-core VM: 125 to
290 ms into new pages, 25 to 33 ms into pages written before). The pool keeps up to ``idle_bytes`` of idle segments;
sizes are powers of two (at least ``MIN_SEGMENT``), so KV of similar lengths share segments.
A tmpfs file's pages exist only where written, so a segment's cost is what pulls used of it.

A segment is only reused after a pull that completed: the server wrote everything before it
sent ``Done`` and writes nothing after. One whose pull failed may still be written by a
server that has not noticed yet, so it is discarded (its name unlinked) instead.

Segments come back from whatever thread drops the last view of a result (a finalizer), so a
return only queues the segment; the pool's own calls take the queue in. The pool unlinks its
segments when it is closed (``default_pool`` does at exit); a process that dies leaves them
to ``shm.sweep``, which the default pool runs when it is made.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import fcntl
import functools
import mmap
import os
import threading
import weakref

import numpy as np
import torch

from services.task_executor.kv_transport import shm

DEFAULT_IDLE_BYTES = 1 << 30
MIN_SEGMENT = 1 << 20


class _Segment:
    def __init__(self, size: int) -> None:
        self.path = shm.new_name(shm.SEGMENT_PREFIX)
        self.size = size
        self.used = 0  # the most bytes a pull has written: its resident memory
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # alive (shm.sweep)
            os.ftruncate(fd, size)
            self.mm: mmap.mmap | None = mmap.mmap(
                fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        except OSError:
            os.close(fd)
            shm.remove(self.path)
            raise
        self.fd: int | None = fd

    def drop(self) -> None:
        """Unlink it and let its memory go (the mapping goes with the last view of it)."""
        shm.remove(self.path)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        mm, self.mm = self.mm, None
        if mm is not None:
            with contextlib.suppress(BufferError):  # a view still exists: it unmaps later
                mm.close()


class Lent:
    """A segment lent to one pull: ``path`` for the server, ``buffer`` to receive into;
    then ``result`` (the pull completed) or ``discard`` (it did not)."""

    def __init__(self, pool: SegmentPool, segment: _Segment, nbytes: int) -> None:
        assert segment.mm is not None
        self._pool, self._segment = pool, segment
        self.path = str(segment.path)
        self.nbytes = nbytes
        self._array: np.ndarray | None = np.frombuffer(segment.mm, dtype=np.uint8, count=nbytes)
        self._used_before = segment.used
        segment.used = max(segment.used, nbytes)

    def buffer(self) -> memoryview:
        assert self._array is not None
        return self._array.data

    def result(self) -> torch.Tensor:
        """The segment's first ``nbytes`` as a uint8 tensor; the segment returns to the pool
        when it (and every view of it) is gone."""
        array, self._array = self._array, None
        assert array is not None
        weakref.finalize(array, self._pool._give_back, self._segment)
        return torch.from_numpy(array)

    def fit(self, nbytes: int) -> None:
        """The pull's KV is ``nbytes`` (at most the segment's size), not what it was lent
        for."""
        if nbytes > self._segment.size:
            raise ValueError(f"{nbytes} bytes in a segment of {self._segment.size}")
        assert self._segment.mm is not None
        self.nbytes = nbytes
        self._segment.used = max(self._used_before, nbytes)
        self._array = np.frombuffer(self._segment.mm, dtype=np.uint8, count=nbytes)

    def unused(self) -> None:
        """Nobody wrote it (the server did not take it): back to the pool as it was."""
        if self._array is not None:
            self._array = None
            self._segment.used = self._used_before
            self._pool._give_back(self._segment)

    def discard(self) -> None:
        if self._array is not None:
            self._array = None
            self._pool._discard(self._segment)


class SegmentPool:
    """The segments this process's pulls land in. Thread-safe."""

    def __init__(self, *, idle_bytes: int = DEFAULT_IDLE_BYTES) -> None:
        self.idle_bytes_max = idle_bytes
        self._lock = threading.Lock()
        self._idle: list[_Segment] = []  # least recently returned first
        self._lent: set[_Segment] = set()
        # Returns from finalizers (any thread, possibly inside this pool's own calls): a
        # deque's append needs no lock.
        self._returned: collections.deque[_Segment] = collections.deque()
        self._closed = False
        self.created = self.reused = 0

    def lend(self, nbytes: int) -> Lent:
        """A segment of at least ``nbytes`` (``OSError`` if /dev/shm has no room)."""
        with self._lock:
            if self._closed:
                raise OSError("the segment pool is closed")
            self._take_returns()
            fits = [s for s in self._idle if s.size >= nbytes]
            if fits:
                segment = min(fits, key=lambda s: s.size)
                self._idle.remove(segment)
                self.reused += 1
            else:
                segment = _Segment(max(MIN_SEGMENT, 1 << (nbytes - 1).bit_length()))
                self.created += 1
            self._lent.add(segment)
        return Lent(self, segment, nbytes)

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            self._take_returns()
            return sum(s.used for s in self._idle)

    def close(self) -> None:
        """Unlink every segment: idle ones go now, lent ones when their results do."""
        with self._lock:
            self._closed = True
            self._take_returns()
            for segment in self._idle:
                segment.drop()
            self._idle.clear()
            for segment in self._lent:
                shm.remove(segment.path)

    def _give_back(self, segment: _Segment) -> None:
        """A result died (any thread, maybe inside this pool's own calls: no lock here)."""
        self._returned.append(segment)
        if self._closed:  # nobody will take it in: drop what is queued
            while self._returned:
                with contextlib.suppress(IndexError):
                    self._returned.popleft().drop()

    def _discard(self, segment: _Segment) -> None:
        with self._lock:
            self._lent.discard(segment)
        segment.drop()

    def _take_returns(self) -> None:
        """Queued returns into the idle list, then the oldest idle ones out past the budget
        (the caller holds the lock)."""
        while self._returned:
            segment = self._returned.popleft()
            self._lent.discard(segment)
            if self._closed or segment.mm is None:
                segment.drop()
            else:
                self._idle.append(segment)
        while self._idle and sum(s.used for s in self._idle) > self.idle_bytes_max:
            self._idle.pop(0).drop()


@functools.cache
def default_pool(idle_bytes: int = DEFAULT_IDLE_BYTES) -> SegmentPool:
    """This process's pool (keeping up to ``idle_bytes`` idle: a TE's
    ``MESHSERVE_KV_SEGMENT_POOL_BYTES``), made on first use; it first removes what dead
    processes left in /dev/shm, and unlinks its own segments at exit."""
    shm.sweep()
    pool = SegmentPool(idle_bytes=idle_bytes)
    atexit.register(pool.close)
    return pool
