"""Large CPU tensors reuse the heap instead of page-faulting fresh memory on every forward.

torch's CPU allocator is glibc's malloc. glibc serves a request above its mmap threshold
(dynamic, at most 32 MiB) with a fresh ``mmap`` and gives it back to the kernel on ``free``;
the next forward's tensor of that size page-faults all of it in again (zero-filled, one fault
per 4 KiB page). Prefill makes such tensors in every layer: the scores of a 128-query block
over 8k keys (58 MiB in float32), the MLP's activations for a 4k-token chunk (40 MiB). On a
2-core host a float32 softmax of 58 MiB took 37 ms against 7 ms from the heap, and a
prompt of 8,192 tokens prefilled in 49 s against 34 s with the thresholds below (Qwen2-0.5B
shape, bf16, AVX-512 host): what vLLM's CPU guide gets from preloading tcmalloc.

``keep_large_allocations`` raises the mmap threshold to ``MMAP_THRESHOLD`` and the trim
threshold to ``TRIM_THRESHOLD``: requests up to 256 MiB come from the heap, and freed heap
memory stays mapped for the next forward. The cost is resident memory: the process keeps its
largest prefill's transient tensors (bounded by the prefill budget). Allocations above the
threshold, such as the paged KV cache, still come from ``mmap`` and stay lazily zeroed.
glibc only (Linux); elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 256 << 20
TRIM_THRESHOLD = 1 << 30


@functools.cache
def keep_large_allocations() -> bool:
    """Sets glibc's thresholds for this process (once); False where there is no glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    if not ok:
        log.warning("mallopt refused the thresholds: large tensors page-fault on every forward")
    return ok
