"""A request's KV cache as a self-describing value: what a prefill instance hands to a decode
instance in PD disaggregation (the bytes travel peer to peer; only control messages use NATS).

The serialized form is a safetensors buffer: one tensor ``kv`` and the metadata as JSON under
the header's ``__metadata__``, so any safetensors reader can open it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from services.task_executor.checkpoint import shard_files
from services.task_executor.dtypes import DTYPES

FORMAT = "meshserve-kv/1"
_META_KEY = "meshserve_kv"
# Weight bytes read per shard for the fingerprint: enough to tell two trainings of one
# architecture apart (full-file hashing of a multi-GB checkpoint would slow every engine start).
_SAMPLES, _SAMPLE_BYTES = 16, 1 << 16


def model_fingerprint(model_dir: Path | str) -> str:
    """A name for "these exact weights": config.json, and each shard's name, size and bytes
    sampled at fixed offsets. Copies of a checkpoint in different places agree."""
    model_dir = Path(model_dir)
    h = hashlib.blake2b(digest_size=16)
    h.update((model_dir / "config.json").read_bytes())
    for path in shard_files(model_dir):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            for i in range(_SAMPLES):
                f.seek(size * i // _SAMPLES)
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


@dataclasses.dataclass(frozen=True, slots=True)
class KvLayout:
    """The shape of one token's KV in an engine: what a peer receiving it must allocate."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def token_bytes(self) -> int:
        """One token's K and V over all layers, in bytes: what PD moves per prompt token."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * itemsize


@dataclasses.dataclass(slots=True, eq=False)
class KvExport:
    """The KV of a request's tokens ``[first_token, num_computed_tokens)`` and the request's
    tokens.

    ``kv`` is ``[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]`` on the
    host, its first block starting at ``first_token``; slots past ``num_computed_tokens`` in
    the last block are zero. ``token_ids`` is the whole sequence so far (prompt, then
    generated tokens); the tokens past ``num_computed_tokens`` (the last sampled one) are the
    input of the next step. ``first_token`` > 0: the importer already holds the KV of the
    tokens before it (PD sends only the blocks the decode side lacks).
    """

    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32", "bfloat16", "float16"
    model_fingerprint: str
    kv: torch.Tensor
    first_token: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}")
        if not 0 <= self.first_token <= self.num_computed_tokens:
            raise ValueError("first_token must lie within the computed tokens")
        nb = -(-(self.num_computed_tokens - self.first_token) // self.block_size)
        want = (self.num_layers, 2, nb, self.block_size, self.num_kv_heads, self.head_dim)
        if tuple(self.kv.shape) != want:
            raise ValueError(f"kv has shape {tuple(self.kv.shape)}, metadata implies {want}")
        if self.kv.dtype != DTYPES[self.dtype]:
            raise ValueError(f"kv is {self.kv.dtype}, metadata says {self.dtype}")
        if not 0 < self.num_computed_tokens < len(self.token_ids):
            raise ValueError("an export covers at least one token and leaves the next input")
        if not 0 < self.num_prompt_tokens <= self.num_computed_tokens:
            raise ValueError("the prompt must be computed before its KV is exported")

    def token_kv(self) -> torch.Tensor:
        """``[num_layers, 2, num_computed_tokens - first_token, num_kv_heads, head_dim]``:
        blocks flattened, so an importer with another block size can lay the tokens out its
        own way."""
        L, _, nb, bs, kvh, hd = self.kv.shape
        n = self.num_computed_tokens - self.first_token
        return self.kv.reshape(L, 2, nb * bs, kvh, hd)[:, :, :n]

    def to_bytes(self) -> bytes:
        meta = {
            "format": FORMAT,
            "token_ids": self.token_ids,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_computed_tokens": self.num_computed_tokens,
            "block_size": self.block_size,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "model_fingerprint": self.model_fingerprint,
            "first_token": self.first_token,
        }
        return st_save({"kv": self.kv.contiguous()}, metadata={_META_KEY: json.dumps(meta)})

    @classmethod
    def from_bytes(cls, data: bytes) -> KvExport:
        try:
            header_len = int.from_bytes(data[:8], "little")
            header = json.loads(data[8 : 8 + header_len])
            meta = json.loads(header["__metadata__"][_META_KEY])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"not a meshserve KV export: {e}") from e
        if meta.pop("format", None) != FORMAT:
            raise ValueError("not a meshserve KV export of a known format version")
        try:
            return cls(**meta, kv=st_load(data)["kv"])
        except TypeError as e:  # fields missing or unknown
            raise ValueError(f"malformed KV export metadata: {e}") from e
