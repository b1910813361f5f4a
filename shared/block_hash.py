"""The chained hash that names a block of prompt tokens, shared by every engine and router.

A fixed spec: a router indexes these hashes across processes and machines, so they must never
depend on the process, the platform or the Python version. For full block ``i`` of a
sequence, ``h_i = blake2b-64(le_u64(h_{i-1}) || le_i32(token ids of block i))``, read as a
little-endian unsigned 64-bit integer, with ``h_{-1} = 0``. Only full blocks have a hash. The
hash covers every token before the block, so one hash names a whole prefix: the system
prompt, every chat turn, and (with a ``root`` other than 0) the adapter or model variant the
tokens were computed under."""

from __future__ import annotations

import array
import hashlib
import struct
import sys
from collections.abc import Sequence

_LITTLE = sys.byteorder == "little"


def hash_block_tokens(parent: int | None, token_ids: Sequence[int]) -> int:
    data = (parent or 0).to_bytes(8, "little") + struct.pack(f"<{len(token_ids)}i", *token_ids)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


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
    # One conversion of the tokens to little-endian int32, then a hash per block of it.
    tokens = array.array("i", token_ids[start : start + full * block_size])
    if not _LITTLE:
        tokens.byteswap()
    data = memoryview(tokens).cast("B")
    step = block_size * 4
    parent = hashes[-1] if hashes else root
    blake2b, from_bytes = hashlib.blake2b, int.from_bytes
    for offset in range(0, full * step, step):
        head = parent.to_bytes(8, "little")
        parent = from_bytes(
            blake2b(head + data[offset : offset + step], digest_size=8).digest(), "little"
        )
        hashes.append(parent)
