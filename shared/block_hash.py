"""The chained hash that names a block of prompt tokens, shared by every engine and router.

A fixed spec: a router indexes these hashes across processes and machines, so they must never
depend on the process, the platform or the Python version. For full block ``i`` of a
sequence, ``h_i = blake2b-64(le_u64(h_{i-1}) || le_i32(token ids of block i))``, read as a
little-endian unsigned 64-bit integer, with ``h_{-1} = 0``. Only full blocks have a hash. The
hash covers every token before the block, so one hash names a whole prefix: the system
prompt, every chat turn, and (with a ``root`` other than 0) the adapter or model variant the
tokens were computed under.

``use_native`` compiles the same function in C (``csrc/block_hash.c``) once per host and
uses it from then on: a 32k-token prompt's 2,048 hashes in about a tenth of hashlib's time
(one Python call per block dominates there). Services turn it on as they start; without a C
compiler this module's Python stays, with the same results."""

from __future__ import annotations

import array
import ctypes
import hashlib
import logging
import struct
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from shared import native
from shared.native import DEFAULT_TOOLCHAIN, Toolchain

log = logging.getLogger(__name__)

_LITTLE = sys.byteorder == "little"
_SOURCE = Path(__file__).with_name("csrc") / "block_hash.c"
_FLAG_SETS = ((("-O3", "-fPIC", "-shared"), ()),)
_MIN_NATIVE_BLOCKS = 4  # below this a ctypes call costs more than hashlib
_native: list[Callable[..., int]] = []  # the C function, once use_native found it


def use_native(toolchain: Toolchain = DEFAULT_TOOLCHAIN) -> bool:
    """Hash with the C implementation from now on, in this process; False (and Python's
    stays) where it cannot be compiled or loaded."""
    if _native:
        return True
    try:
        path = str(native.build("block_hash", [_SOURCE], toolchain, _FLAG_SETS))
        lib, with_gil = ctypes.CDLL(path), ctypes.PyDLL(path)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("block hashes in Python (no C build): %s", e)
        return False
    i64, u64, ptr = ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p
    of_array = lib.chain_hashes
    of_array.argtypes = [ptr, i64, i64, u64, ptr]
    of_array.restype = ctypes.c_int
    # Called with the GIL held: it reads the list's items through the C API.
    of_list = with_gil.chain_hashes_list
    of_list.argtypes = [ctypes.py_object, i64, i64, i64, u64, ptr]
    of_list.restype = ctypes.c_int
    _native.extend((of_array, of_list))
    return True


def native_in_use() -> bool:
    return bool(_native)


def hash_block_tokens(parent: int | None, token_ids: Sequence[int]) -> int:
    data = (parent or 0).to_bytes(8, "little") + struct.pack(f"<{len(token_ids)}i", *token_ids)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def adapter_root(adapter: str) -> int:
    """The ``root`` of the chain of tokens computed under a LoRA adapter: blake2b-64 of
    ``b"lora\\0" || utf-8(name)`` (never 0); the base model's (``""``) is 0, so its hashes are
    those of a chain without a root. KV computed under one adapter then never matches a
    prefix of another adapter or of the base model."""
    if not adapter:
        return 0
    digest = hashlib.blake2b(b"lora\0" + adapter.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


def chain_hashes(token_ids: Sequence[int], block_size: int, root: int = 0) -> list[int]:
    """The hashes of every full block of ``token_ids``."""
    hashes: list[int] = []
    extend_chain(hashes, token_ids, block_size, root)
    return hashes


def extend_chain(
    hashes: list[int], token_ids: Sequence[int], block_size: int, root: int = 0
) -> None:
    """Append the hashes of the full blocks of ``token_ids`` that ``hashes`` lacks (a growing
    sequence pays for each block once)."""
    start = len(hashes) * block_size
    full = (len(token_ids) - start) // block_size
    if full <= 0:
        return
    parent = hashes[-1] if hashes else root
    if _native and full >= _MIN_NATIVE_BLOCKS and block_size <= 4096:
        out = array.array("Q", bytes(8 * full))
        out_at, _ = out.buffer_info()
        if type(token_ids) is list:
            done = _native[1](token_ids, start, full, block_size, parent, out_at)
        else:
            tokens = array.array("i", token_ids[start : start + full * block_size])
            done = _native[0](tokens.buffer_info()[0], full, block_size, parent, out_at)
        if done == 0:
            hashes.extend(out)
            return
    # One conversion of the tokens to int32, then a hash per block of it.
    tokens = array.array("i", token_ids[start : start + full * block_size])
    if not _LITTLE:
        tokens.byteswap()
    data = memoryview(tokens).cast("B")
    step = block_size * 4
    blake2b = hashlib.blake2b
    head = parent.to_bytes(8, "little")  # each digest is the next block's head as it is
    digests = []
    for offset in range(0, full * step, step):
        head = blake2b(head + data[offset : offset + step], digest_size=8).digest()
        digests.append(head)
    hashes.extend(struct.unpack(f"<{full}Q", b"".join(digests)))
