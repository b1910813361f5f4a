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
import threading
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


def memoised(model_dir: Path, memo_dir: Path) -> dict[str, str] | None:
    """The checkpoint's fingerprints where every shard's are memoised (else None: nothing
    is hashed here)."""
    out: dict[str, str] = {}
    try:
        for path in shard_files(model_dir):
            out.update(json.loads(_memo_path(path, memo_dir).read_text()))
    except (OSError, ValueError):
        return None
    return out


def remember(model_dir: Path, memo_dir: Path, fps: Mapping[str, str]) -> bool:
    """Memoise fingerprints another host computed for the same model (a fork), shard by
    shard, where they name every tensor of this host's checkpoint; False (nothing written)
    where they do not: that checkpoint is not the one they describe."""
    shards = {path: _header_names(path) for path in shard_files(model_dir)}
    if any(name not in fps for names in shards.values() for name in names):
        return False
    for path, names in shards.items():
        _write_memo(_memo_path(path, memo_dir), {n: fps[n] for n in names})
    return True


def _header_names(path: Path) -> list[str]:
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        return [n for n in json.loads(f.read(header_len)) if n != "__metadata__"]


def _write_memo(memo: Path, fps: Mapping[str, str]) -> None:
    memo.parent.mkdir(parents=True, exist_ok=True)
    # Per process and thread: two loads in one process may memoise the same file at once.
    tmp = memo.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
    tmp.write_text(json.dumps(dict(fps)))
    tmp.replace(memo)


def _memo_path(path: Path, memo_dir: Path) -> Path:
    return memo_dir / f"{xxhash.xxh3_64_hexdigest(file_identity(path).encode())}.json"


def _memoised(path: Path, memo_dir: Path | None) -> dict[str, str]:
    if memo_dir is None:
        return shard_fingerprints(path)
    memo = _memo_path(path, memo_dir)
    with contextlib.suppress(FileNotFoundError, ValueError):
        cached: dict[str, str] = json.loads(memo.read_text())
        return cached
    fps = shard_fingerprints(path)
    _write_memo(memo, fps)
    return fps
