"""Content fingerprints of a checkpoint's tensors, read straight from its safetensors files.

A tensor's fingerprint is xxh3-128 over its dtype, its shape and its bytes, as the checkpoint
stores them: two checkpoints holding the same tensor (a fine-tuned variant's frozen layers, a
base model under adapters, tied embeddings saved twice) give it the same fingerprint whatever
the tensor is called, and the host cache stores it once. xxh3 is not a cryptographic hash: the
cache trusts whoever writes checkpoints onto the host (as the engines do); collisions of 128
bits between honest tensors are not a practical concern. It hashes at 9-10 GB/s on one core
(2-core Sapphire Rapids host), so a 1 GB checkpoint costs about 0.1 s once.

Hashing reads the whole checkpoint, so the result is memoised per shard file, under the file's
identity (path, size, modification time and inode): a later load of an unchanged checkpoint
reads only the memo. A checkpoint rewritten in place gets a new identity and is hashed again.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import xxhash

from services.task_executor.checkpoint import shard_files


def file_identity(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"


def shard_fingerprints(path: Path) -> dict[str, str]:
    """Every tensor of one safetensors file: name -> fingerprint."""
    out: dict[str, str] = {}
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        size = os.fstat(f.fileno()).st_size
        if size == 8 + header_len:  # no tensor data at all
            return {name: _fp(meta, b"") for name, meta in header.items() if name != "__metadata__"}
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            data = memoryview(mm)[8 + header_len :]
            try:
                for name, meta in header.items():
                    if name == "__metadata__":
                        continue
                    start, end = meta["data_offsets"]
                    out[name] = _fp(meta, data[start:end])
            finally:
                data.release()
    return out


def _fp(meta: Mapping[str, object], data: memoryview | bytes) -> str:
    h = xxhash.xxh3_128()
    h.update(f"{meta['dtype']}|{meta['shape']}|".encode())
    h.update(data)
    return h.hexdigest()


def checkpoint_fingerprints(model_dir: Path, memo_dir: Path | None) -> dict[str, str]:
    """Every tensor of the checkpoint in ``model_dir``: name -> fingerprint; memoised in
    ``memo_dir`` (None: hashed every time)."""
    out: dict[str, str] = {}
    for path in shard_files(model_dir):
        out.update(_memoised(path, memo_dir))
    return out


def _memoised(path: Path, memo_dir: Path | None) -> dict[str, str]:
    if memo_dir is None:
        return shard_fingerprints(path)
    memo = memo_dir / f"{xxhash.xxh3_64_hexdigest(file_identity(path).encode())}.json"
    with contextlib.suppress(FileNotFoundError, ValueError):
        cached: dict[str, str] = json.loads(memo.read_text())
        return cached
    fps = shard_fingerprints(path)
    memo_dir.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(fps))
    tmp.replace(memo)
    return fps
