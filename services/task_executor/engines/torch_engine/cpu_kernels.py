"""C kernels for the torch engine on CPU, compiled on the host that runs them.

Decode attention over the paged cache is where torch's own ops fall short on CPU: gathering
every request's blocks into a padded copy, then ``scaled_dot_product_attention`` with a mask,
took 1.5-2.2 ms per layer for 8 requests of ~600 tokens (Qwen2-0.5B shape, bf16, 2-core AVX2
host), against 0.22 ms for ``csrc/decode_attention.c``, which reads the blocks in place. See
that file for what it computes.

The source is compiled once per host with the system C compiler (``$CC``, else ``cc``),
``-march=native`` and OpenMP, into a cache directory keyed by the source, the flags, the
compiler and the CPU's feature flags (``$MESHSERVE_KERNEL_CACHE``, else
``$XDG_CACHE_HOME/meshserve/kernels``); it takes about a second and is loaded with ctypes. The
kernel runs on torch's OpenMP runtime (the library is loaded into a process that has torch's
``libgomp`` already, whose soname it shares) with ``torch.get_num_threads()`` threads.

Without a compiler, or for a dtype or shape the kernel does not take, ``decode_attention``
returns None and the engine keeps torch's ops: same results, slower.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.c"
MAX_GROUP = 16  # query heads per K/V head, as in the source
MAX_HEAD_DIM = 256
_SYMBOLS = {torch.bfloat16: "decode_attention_bf16", torch.float32: "decode_attention_f32"}
# Tried in order: vectorized expf from glibc's libmvec first; a plain build where that is absent.
_FLAG_SETS = (
    ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-shared"),
    ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"),
)
_LIBS = (("-lmvec", "-lm"), ("-lm",))
_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_ARGTYPES = [_P, _I64, _P, _P, _P, _I64, _P, _P, _I64, _I, _I, _I, _I, ctypes.c_float, _I]


class KernelError(RuntimeError):
    """The compiled kernel refused its arguments (a bug: the wrapper checks them first)."""


@dataclasses.dataclass(frozen=True)
class Toolchain:
    """How kernels are built here: the C compiler, and where built libraries are kept (one
    per source, flags, compiler version and CPU). A TE's come from its settings
    (``MESHSERVE_KERNEL_CACHE``, ``CC``)."""

    cc: str = "cc"
    cache_dir: Path = Path.home() / ".cache" / "meshserve" / "kernels"


DEFAULT_TOOLCHAIN = Toolchain()


def _cpu_flags() -> str:
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


def build(source: Path = SOURCE, toolchain: Toolchain = DEFAULT_TOOLCHAIN) -> Path:
    """The shared library for ``source`` on this host, compiled unless cached. Raises
    ``RuntimeError`` when no compiler is found or every flag set fails."""
    cc = toolchain.cc
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler ({cc!r} is not on PATH)")
    text = source.read_bytes()
    version = _compiler_version(cc)
    errors = []
    for flags, libs in zip(_FLAG_SETS, _LIBS, strict=True):
        key = hashlib.sha256(
            b"\0".join(
                [text, " ".join(flags + libs).encode(), version.encode(), _cpu_flags().encode()]
            )
        ).hexdigest()[:24]
        target = toolchain.cache_dir / f"{source.stem}-{key}.so"
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        # Compiled beside the target and renamed: processes building at once never see half a
        # library.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        cmd = [cc, *flags, str(source), "-o", tmp, *libs]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if out.returncode == 0:
            os.replace(tmp, target)
            log.info("compiled %s -> %s", source.name, target)
            return target
        os.unlink(tmp)
        errors.append(f"{' '.join(cmd)}: {out.stderr.strip()[-2000:]}")
    raise RuntimeError("could not compile " + source.name + ":\n" + "\n".join(errors))


@functools.cache
def _library(toolchain: Toolchain) -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(build(SOURCE, toolchain)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("C decode attention unavailable, using torch ops: %s", e)
        return None
    for symbol in _SYMBOLS.values():
        fn = getattr(lib, symbol)
        fn.argtypes = _ARGTYPES
        fn.restype = ctypes.c_int
    return lib


class DecodeAttention:
    """Callable: ``(q, k_cache, v_cache, block_tables, lens) -> [batch, heads * hd]``.

    ``q`` ``[batch, heads, hd]`` (rows may be strided, heads and dims contiguous), the caches
    ``[num_blocks, block_size, kv_heads, hd]`` contiguous, ``block_tables`` ``[batch, width]``
    and ``lens`` ``[batch]`` int64 contiguous, every length >= 1."""

    def __init__(self, fn: Callable[..., int], dtype: torch.dtype) -> None:
        self._fn = fn
        self.dtype = dtype

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        lens: torch.Tensor,
    ) -> torch.Tensor:
        batch, heads, hd = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        if q.stride(2) != 1 or q.stride(1) != hd:
            q = q.contiguous()
        for t in (k_cache, v_cache, block_tables, lens):
            if not t.is_contiguous():
                raise ValueError("decode attention needs contiguous caches, tables and lengths")
        if block_tables.dtype != torch.int64 or lens.dtype != torch.int64:
            raise ValueError("block tables and lengths must be int64")
        out = torch.empty(batch, heads * hd, dtype=q.dtype)
        rc = self._fn(
            q.data_ptr(),
            q.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            block_tables.shape[1],
            lens.data_ptr(),
            out.data_ptr(),
            batch,
            heads,
            kv_heads,
            hd,
            block_size,
            hd**-0.5,
            torch.get_num_threads(),
        )
        if rc:
            raise KernelError(f"decode attention kernel returned {rc}")
        return out


def decode_attention(
    *,
    dtype: torch.dtype,
    device: torch.device,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    toolchain: Toolchain = DEFAULT_TOOLCHAIN,
) -> DecodeAttention | None:
    """The C kernel for this model and device, or None where torch's ops must run (not a CPU,
    a dtype or shape the kernel does not take, no compiler)."""
    if (
        device.type != "cpu"
        or dtype not in _SYMBOLS
        or num_heads % num_kv_heads
        or num_heads // num_kv_heads > MAX_GROUP
        or head_dim > MAX_HEAD_DIM
    ):
        return None
    lib = _library(toolchain)
    if lib is None:
        return None
    return DecodeAttention(getattr(lib, _SYMBOLS[dtype]), dtype)
