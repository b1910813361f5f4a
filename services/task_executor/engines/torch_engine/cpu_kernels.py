"""C kernels for the torch engine on CPU, compiled on the host that runs them.

One library (sources in ``csrc/``):
- ``decode_attention``: one query token per request over its paged K/V, read in place;
- ``causal_softmax``: the masked float32 softmax of a prefill query block's scores, in place
  (``attention.py`` says why);
- ``elementwise``: a layer's steps between its matrix multiplies, each one pass over its rows
  (residual add + RMSNorm, SiLU-and-multiply, rotary embedding in place), instead of torch's
  several passes and temporaries (``csrc/elementwise.c``);
- ``prefill_attention``: causal attention of a prompt (or a chunk of one) on AMX tiles, flash
  style, where the CPU has AMX (``csrc/prefill_attention.c``).

Decode attention over the paged cache is where torch's own ops fall short on CPU: gathering
every request's blocks into a padded copy, then ``scaled_dot_product_attention`` with a mask,
took 1.5-2.2 ms per layer for 8 requests of ~600 tokens (Qwen2-0.5B shape, bf16, 2-core AVX2
host), against 0.22 ms for ``csrc/decode_attention.c``, which reads the blocks in place. See
that file for what it computes.

The sources are compiled once per host with the system C compiler (``$CC``, else ``cc``),
``-march=native`` and OpenMP, into a cache directory keyed by the sources, the flags, the
compiler and the CPU's feature flags (``$MESHSERVE_KERNEL_CACHE``, else
``$XDG_CACHE_HOME/meshserve/kernels``); it takes about a second and is loaded with ctypes. The
kernel runs on torch's OpenMP runtime (the library is loaded into a process that has torch's
``libgomp`` already, whose soname it shares) with ``torch.get_num_threads()`` threads.

Without a compiler, or for a dtype or shape the kernel does not take, ``decode_attention``
(and ``causal_softmax``) return None and the engine keeps torch's ops: same results, slower.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from shared import native
from shared.native import DEFAULT_TOOLCHAIN, Toolchain

log = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name("csrc") / name
    for name in ("decode_attention.c", "causal_softmax.c", "elementwise.c", "prefill_attention.c")
)
HEADERS = (Path(__file__).with_name("csrc") / "common.h",)  # included by the sources
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
_SOFTMAX_SYMBOLS = {torch.bfloat16: "causal_softmax_bf16", torch.float32: "causal_softmax_f32"}
_SOFTMAX_ARGTYPES = [_P, _I64, _I64, _I64, _I64, _I64, _I]
_F = ctypes.c_float
# name -> argument types; one symbol per dtype, name_bf16 and name_f32 (csrc/elementwise.c)
_ELEMENTWISE = {
    "add_rms_norm": [_P, _I64, _P, _I64, _P, _P, _I64, _I64, _F, _I],
    "silu_mul": [_P, _P, _I64, _I64, _I],
    "rope": [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _I],
}
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
_PREFILL_ARGTYPES = [_P, _I64, _P, _I64, _P, _I64, _I64, _I64, _I, _I, _I, _F, _P, _I]


class KernelError(RuntimeError):
    """The compiled kernel refused its arguments (a bug: the wrapper checks them first)."""


def build(sources: Sequence[Path] = SOURCES, toolchain: Toolchain = DEFAULT_TOOLCHAIN) -> Path:
    """The shared library of ``sources`` on this host, compiled unless cached
    (``shared.native.build``). Raises ``RuntimeError`` when no compiler is found or every
    flag set fails."""
    flag_sets = list(zip(_FLAG_SETS, _LIBS, strict=True))
    return native.build("kernels", sources, toolchain, flag_sets, headers=HEADERS)


@functools.cache
def _library(toolchain: Toolchain) -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(build(SOURCES, toolchain)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("C kernels unavailable, using torch ops: %s", e)
        return None
    typed = [(symbol, _ARGTYPES) for symbol in _SYMBOLS.values()]
    typed += [(symbol, _SOFTMAX_ARGTYPES) for symbol in _SOFTMAX_SYMBOLS.values()]
    typed += [
        (f"{name}_{suffix}", argtypes)
        for name, argtypes in _ELEMENTWISE.items()
        for suffix in _SUFFIX.values()
    ]
    typed += [("prefill_attention_bf16", _PREFILL_ARGTYPES), ("prefill_attention_amx", [])]
    for symbol, argtypes in typed:
        fn = getattr(lib, symbol)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    return lib


def prewarm(toolchain: Toolchain = DEFAULT_TOOLCHAIN) -> None:
    """Compile (or find in the cache) and load the kernel library now, not on a first load."""
    _library(toolchain)


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


class CausalSoftmax:
    """Callable: ``(scores, first_len) -> scores``, in place. ``scores`` ``[kv_heads, m, group,
    cols]`` contiguous, in the kernel's dtype: row (h, i, g) is query i's scores (query head
    g of K/V head h) over ``cols`` keys, of which it sees the first ``first_len + i``. Those
    become the float32 softmax rounded to the dtype, the rest 0."""

    def __init__(self, fn: Callable[..., int], dtype: torch.dtype) -> None:
        self._fn = fn
        self.dtype = dtype

    def __call__(self, scores: torch.Tensor, first_len: int) -> torch.Tensor:
        kv_heads, m, group, cols = scores.shape
        if not scores.is_contiguous() or scores.dtype != self.dtype:
            raise ValueError(f"causal softmax needs contiguous {self.dtype} scores")
        if not 1 <= first_len <= cols:
            raise ValueError(f"first_len {first_len} outside 1..{cols}")
        rc = self._fn(
            scores.data_ptr(), kv_heads, m, group, cols, first_len, torch.get_num_threads()
        )
        if rc:
            raise KernelError(f"causal softmax kernel returned {rc}")
        return scores


def causal_softmax(
    *, dtype: torch.dtype, device: torch.device, toolchain: Toolchain = DEFAULT_TOOLCHAIN
) -> CausalSoftmax | None:
    """The C causal softmax for this dtype and device, or None where torch's ops must run."""
    if device.type != "cpu" or dtype not in _SOFTMAX_SYMBOLS:
        return None
    lib = _library(toolchain)
    if lib is None:
        return None
    return CausalSoftmax(getattr(lib, _SOFTMAX_SYMBOLS[dtype]), dtype)


class Elementwise:
    """A layer's position-wise steps for one dtype, one pass each (``csrc/elementwise.c``).
    Rows are the first dimension; within a row, elements are contiguous."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype) -> None:
        suffix = _SUFFIX[dtype]
        self._add_rms_norm = getattr(lib, f"add_rms_norm_{suffix}")
        self._silu_mul = getattr(lib, f"silu_mul_{suffix}")
        self._rope = getattr(lib, f"rope_{suffix}")
        self.dtype = dtype

    def _check(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if t.dtype != self.dtype or t.device.type != "cpu" or t.stride(-1) != 1:
                raise ValueError(f"elementwise kernels need {self.dtype} CPU rows, dense inside")

    def add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``h += delta`` in place (when given), then RMSNorm of ``h`` into a new tensor."""
        rows, dim = h.shape
        self._check(h, weight, *(() if delta is None else (delta,)))
        if delta is not None and delta.shape != h.shape:
            raise ValueError("delta must have h's shape")
        out = torch.empty(rows, dim, dtype=h.dtype)
        rc = self._add_rms_norm(
            h.data_ptr(),
            h.stride(0),
            None if delta is None else delta.data_ptr(),
            0 if delta is None else delta.stride(0),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            dim,
            eps,
            torch.get_num_threads(),
        )
        if rc:
            raise KernelError(f"add_rms_norm returned {rc}")
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a contiguous ``[rows, 2 * inter]`` gate/up output."""
        rows, width = gate_up.shape
        self._check(gate_up)
        if not gate_up.is_contiguous() or width % 2:
            raise ValueError("silu_mul needs a contiguous [rows, 2 * inter] tensor")
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        rc = self._silu_mul(
            gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads()
        )
        if rc:
            raise KernelError(f"silu_mul returned {rc}")
        return out

    def rope_(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        """Rotates ``x`` ``[rows, heads, hd]`` in place (heads dense within a row) at
        ``positions`` (int64 ``[rows]``), from ``cos``/``sin`` tables ``[max_len, hd]``."""
        rows, heads, hd = x.shape
        self._check(x, cos, sin)
        if x.stride(1) != hd or not (cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError("rope needs dense heads and contiguous tables")
        if positions.dtype != torch.int64 or not positions.is_contiguous():
            raise ValueError("positions must be contiguous int64")
        rc = self._rope(
            x.data_ptr(),
            x.stride(0),
            positions.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            rows,
            heads,
            hd,
            torch.get_num_threads(),
        )
        if rc:
            raise KernelError(f"rope returned {rc}")


def elementwise(
    *, dtype: torch.dtype, device: torch.device, toolchain: Toolchain = DEFAULT_TOOLCHAIN
) -> Elementwise | None:
    """The C position-wise kernels for this dtype and device, or None where torch's ops
    must run."""
    if device.type != "cpu" or dtype not in _SUFFIX:
        return None
    lib = _library(toolchain)
    if lib is None:
        return None
    return Elementwise(lib, dtype)


class PrefillAttention:
    """Callable: ``(q, k, v, start_pos) -> [n, heads * hd]``, causal attention of ``n`` queries
    at positions ``start_pos ..`` over ``start_pos + n`` keys, in bf16 on AMX tiles
    (``csrc/prefill_attention.c``). ``q`` ``[n, heads, hd]``, ``k``/``v`` ``[ctx, kv_heads,
    hd]``: rows may be strided (views of a fused q/k/v), heads and dims dense."""

    def __init__(self, fn: Callable[..., int]) -> None:
        self._fn = fn

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int
    ) -> torch.Tensor:
        n, heads, hd = q.shape
        ctx, kv_heads, _ = k.shape
        for t in (q, k, v):
            if t.dtype != torch.bfloat16 or t.stride(2) != 1 or t.stride(1) != hd:
                raise ValueError("prefill attention needs bf16 rows of dense heads")
        if v.shape != k.shape or ctx != start_pos + n:
            raise ValueError("k and v must be alike and cover start_pos + n keys")
        out = torch.empty(n, heads * hd, dtype=q.dtype)
        rc = self._fn(
            q.data_ptr(),
            q.stride(0),
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            n,
            start_pos,
            heads,
            kv_heads,
            hd,
            hd**-0.5,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if rc:
            raise KernelError(f"prefill attention kernel returned {rc}")
        return out


def prefill_attention(
    *,
    dtype: torch.dtype,
    device: torch.device,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    toolchain: Toolchain = DEFAULT_TOOLCHAIN,
) -> PrefillAttention | None:
    """The AMX prefill attention for this model, or None: not a CPU with AMX (and a kernel
    built for it), not bf16, or a shape it does not take."""
    if (
        device.type != "cpu"
        or dtype != torch.bfloat16
        or num_heads % num_kv_heads
        or head_dim % 32
        or head_dim > 256
    ):
        return None
    lib = _library(toolchain)
    if lib is None or not lib.prefill_attention_amx():
        return None
    return PrefillAttention(lib.prefill_attention_bf16)
