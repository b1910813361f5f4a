"""The prefill side's shared-memory arenas: an outbox's KV is written into a file in /dev/shm
of this process's, which a puller on this host maps and reads in place (``mapped.py``): the
KV moves between the two TEs with no copy of the transport's own; the decode TE's import is
the one copy, out of this arena into its KV cache.

Reuse is the point: the first write of a tmpfs page allocates and zeroes it, which on this
project's VMs is slower than the copy that fills it, and a puller that keeps its mapping of
an arena reads it again without a page fault. The pool keeps up to ``idle_bytes`` of idle
arenas; sizes are powers of two (at least ``MIN_ARENA``), so KV of similar lengths share
arenas. Each arena's pages are reserved when it is made (``posix_fallocate``): a /dev/shm
without room fails there (the outbox then keeps its KV on the heap and pullers get it over
TCP) rather than with a SIGBUS at the first write into a page the file system cannot give.

An arena is reused only after its lease ended ``released``: the puller read everything it
will read (it releases once the last view of its result is gone). An arena whose lease ended
any other way may still be read by a puller that has not noticed, so it is dropped instead
(its name unlinked: a puller's mapping keeps its pages, intact, for as long as it reads).

The pool unlinks its arenas when it is closed (``default_pool`` does at exit); a process
that dies leaves them to ``shm.sweep``, which the default pool runs when it is made.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import mmap
import os
import threading

import torch

from services.task_executor.kv_transport import shm

DEFAULT_IDLE_BYTES = 1 << 30
MIN_ARENA = 1 << 20


class Arena:
    """One file in /dev/shm, mapped here: ``path`` for pullers, ``tensor`` (uint8, the whole
    file) to write into."""

    def __init__(self, size: int) -> None:
        self.path = shm.new_name(shm.ARENA_PREFIX)
        self.size = size
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # alive (shm.sweep)
            os.posix_fallocate(fd, 0, size)  # the pages exist (ENOSPC here, not SIGBUS later)
            mm = mmap.mmap(
                fd,
                size,
                flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
            )
        except OSError:
            os.close(fd)
            shm.remove(self.path)
            raise
        self.fd: int | None = fd
        self.tensor: torch.Tensor | None = torch.frombuffer(mm, dtype=torch.uint8)

    def drop(self) -> None:
        """Unlink it and let this side's mapping go (a puller's keeps the pages it reads)."""
        shm.remove(self.path)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.tensor = None  # the mapping goes with the last view of it


class ArenaPool:
    """The arenas this process's outboxes write into. Thread-safe."""

    def __init__(self, *, idle_bytes: int = DEFAULT_IDLE_BYTES) -> None:
        self.idle_bytes_max = idle_bytes
        self._lock = threading.Lock()
        self._idle: list[Arena] = []  # least recently returned first
        self._lent: set[Arena] = set()
        self._closed = False
        self.created = self.reused = 0

    def lend(self, nbytes: int) -> Arena:
        """An arena of at least ``nbytes`` (``OSError`` if /dev/shm has no room)."""
        with self._lock:
            if self._closed:
                raise OSError("the arena pool is closed")
            fits = [a for a in self._idle if a.size >= nbytes]
            if fits:
                arena = min(fits, key=lambda a: a.size)
                self._idle.remove(arena)
                self.reused += 1
                self._lent.add(arena)
                return arena
        arena = Arena(max(MIN_ARENA, 1 << (nbytes - 1).bit_length()))  # (outside the lock)
        with self._lock:
            self.created += 1
            if self._closed:
                arena.drop()
                raise OSError("the arena pool is closed")
            self._lent.add(arena)
        return arena

    def give_back(self, arena: Arena, *, reuse: bool) -> None:
        """The outbox is done with ``arena``: ``reuse`` once nobody reads it any more (its
        lease ended released), else it is dropped."""
        with self._lock:
            self._lent.discard(arena)
            if not reuse or self._closed or arena.tensor is None:
                arena.drop()
                return
            self._idle.append(arena)
            while self._idle and sum(a.size for a in self._idle) > self.idle_bytes_max:
                self._idle.pop(0).drop()

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(a.size for a in self._idle)

    def close(self) -> None:
        """Unlink every arena: idle ones now, lent ones (still being written or read) keep
        their pages until they are given back."""
        with self._lock:
            self._closed = True
            for arena in self._idle:
                arena.drop()
            self._idle.clear()
            for arena in self._lent:
                shm.remove(arena.path)


@functools.cache
def default_pool(idle_bytes: int = DEFAULT_IDLE_BYTES) -> ArenaPool:
    """This process's pool (keeping up to ``idle_bytes`` idle: a TE's
    ``MESHSERVE_KV_ARENA_POOL_BYTES``), made on first use; it first removes what dead
    processes left in /dev/shm, and unlinks its own arenas at exit."""
    shm.sweep()
    pool = ArenaPool(idle_bytes=idle_bytes)
    atexit.register(pool.close)
    return pool


def try_lend(pool: ArenaPool | None, nbytes: int) -> Arena | None:
    """An arena of ``pool`` for ``nbytes``, or None (no pool, or no room in /dev/shm)."""
    if pool is None or nbytes <= 0:
        return None
    with contextlib.suppress(OSError):
        return pool.lend(nbytes)
    return None
