"""Shared memory between a prefill TE and a decode TE on one host: the probe that tells the
two share /dev/shm, and the rules for the arena files the KV is written into.

Same-host detection asks the file system itself, so it holds whatever the network looks like
(two TEs in network namespaces that share /dev/shm, or ones that do not): the puller writes
a probe file of random bytes and sends its name and bytes; the server uses shared memory only
if it reads the same bytes under that name.

Arenas belong to the prefill side (``pool.ArenaPool``), which writes each outbox's KV into
one and reuses them: a tmpfs page is new memory the first time it is written, and on this
project's VMs that costs more than the copy itself (fresh pages take a 200 MB KV at ~2 GB/s,
pages written before at memcpy speed). A puller maps the arena read-only and reads the KV
where it lies (``mapped.MappedArenas``).

Names only ever come from these prefixes, and each side only opens names that match them:
a peer cannot make this side read any other file. A pool holds a shared ``flock`` on each of
its arenas for as long as it lives, so an arena whose owner died (the lock is free) can be
told from one in use and removed (``sweep``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import time
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PROBE_PREFIX = "meshserve-kvprobe-"
ARENA_PREFIX = "meshserve-kvarena-"
_PROBE_BYTES = 16
_NAME = re.compile(r"[0-9a-f]{32}")
# A file younger than this is never swept: its owner may not have locked it yet.
SWEEP_MIN_AGE_S = 60.0


def checked_path(path: str, prefix: str) -> Path | None:
    """``path`` if it names a file of ours of that kind in /dev/shm, else None."""
    p = Path(path)
    if p.parent != SHM_DIR or not p.name.startswith(prefix):
        return None
    if not _NAME.fullmatch(p.name.removeprefix(prefix)):
        return None
    return p


def new_name(prefix: str) -> Path:
    return SHM_DIR / f"{prefix}{secrets.token_hex(16)}"


def remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


# --- the probe ------------------------------------------------------------------------------


def make_probe() -> tuple[Path, bytes] | None:
    """A new probe file and its bytes (the caller removes it); None without /dev/shm."""
    path, data = new_name(PROBE_PREFIX), secrets.token_bytes(_PROBE_BYTES)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    try:
        os.write(fd, data)
    except OSError:
        remove(path)
        return None
    finally:
        os.close(fd)
    return path, data


def probe_matches(path: str, data: bytes) -> bool:
    """Whether the probe file ``path`` holds ``data`` here (the puller shares /dev/shm)."""
    p = checked_path(path, PROBE_PREFIX)
    if p is None or len(data) != _PROBE_BYTES:
        return False
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return os.read(fd, _PROBE_BYTES + 1) == data
    except OSError:
        return False
    finally:
        os.close(fd)


# --- leftovers of dead processes ------------------------------------------------------------


def sweep() -> int:
    """Remove arenas whose owner died (nobody holds their lock) and stray probes, if older
    than ``SWEEP_MIN_AGE_S``; how many went."""
    removed = 0
    now = time.time()
    with contextlib.suppress(OSError):
        for p in SHM_DIR.iterdir():
            if p.name.startswith(PROBE_PREFIX) and checked_path(str(p), PROBE_PREFIX):
                with contextlib.suppress(OSError):
                    if now - p.stat().st_ctime > SWEEP_MIN_AGE_S:
                        remove(p)
                        removed += 1
            elif p.name.startswith(ARENA_PREFIX) and checked_path(str(p), ARENA_PREFIX):
                removed += _sweep_arena(p, now)
    return removed


def _sweep_arena(p: Path, now: float) -> int:
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        if now - os.fstat(fd).st_ctime <= SWEEP_MIN_AGE_S:
            return 0
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return 0  # its pool is alive
        remove(p)
        return 1
    finally:
        os.close(fd)
