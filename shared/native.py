"""C sources compiled on the host that runs them, once, into a cache of shared libraries.

A library is keyed by its sources (and the headers they include), the flags, the compiler's
version and the CPU's feature flags, so a cache directory shared by processes, checkouts or
hosts of different CPUs never hands one a library built for another. Each flag set is tried
in order (the first that compiles wins); compiling happens beside the target and is renamed
into place, so a process never loads half a library. One process compiles a library at a
time (a lock file beside it): the pool's other TEs, starting at once on a fresh host, wait
for it and load its result instead of each running a compiler on the same cores. Loaded with ctypes by
the caller. ``Toolchain`` says which compiler and which cache: a service builds it from its
settings (``CC``, ``MESHSERVE_KERNEL_CACHE``)."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.settings import Settings

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Toolchain:
    """The C compiler, and where built libraries are kept."""

    cc: str = "cc"
    cache_dir: Path = Path.home() / ".cache" / "meshserve" / "kernels"

    @classmethod
    def of(cls, settings: Settings) -> Toolchain:
        """A service's: ``CC`` and ``MESHSERVE_KERNEL_CACHE``."""
        return cls(cc=settings.torch.cc, cache_dir=settings.torch.kernel_cache)


DEFAULT_TOOLCHAIN = Toolchain()


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _compiler_version(cc: str) -> str:
    out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    return out.stdout


@contextlib.contextmanager
def _compiling(target: Path) -> Iterator[None]:
    """Held while ``target`` is compiled: an exclusive lock on a file beside it (released by
    the kernel if the holder dies)."""
    with open(target.with_suffix(".lock"), "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(
    name: str,
    sources: Sequence[Path],
    toolchain: Toolchain,
    flag_sets: Sequence[tuple[Sequence[str], Sequence[str]]],
    headers: Sequence[Path] = (),
) -> Path:
    """The shared library ``name`` of ``sources``, compiled unless cached. ``flag_sets``:
    (compiler flags, link libraries) to try in order. Raises ``RuntimeError`` when no
    compiler is found or every flag set fails."""
    cc = toolchain.cc
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler ({cc!r} is not on PATH)")
    text = b"\0".join(source.read_bytes() for source in (*sources, *headers))
    version = _compiler_version(cc)
    errors = []
    for flags, libs in flag_sets:
        key = hashlib.sha256(
            b"\0".join(
                [text, " ".join([*flags, *libs]).encode(), version.encode(), cpu_flags().encode()]
            )
        ).hexdigest()[:24]
        target = toolchain.cache_dir / f"{name}-{key}.so"
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        with _compiling(target):
            if target.exists():  # another process compiled it while this one waited
                return target
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
            os.close(fd)
            cmd = [cc, *flags, *map(str, sources), "-o", tmp, *libs]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if out.returncode == 0:
                os.replace(tmp, target)
                log.info("compiled %s -> %s", ", ".join(p.name for p in sources), target)
                return target
            os.unlink(tmp)
        errors.append(f"{' '.join(cmd)}: {out.stderr.strip()[-2000:]}")
    names = ", ".join(p.name for p in sources)
    raise RuntimeError(f"could not compile {names}:\n" + "\n".join(errors))
