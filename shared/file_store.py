"""Uploaded files: bytes in a directory (``MESHSERVE_FILES_DIR``, any mount the frontends and
training TEs share), metadata in Redis, each file owned by the tenant that uploaded it.

An upload streams into a hidden temporary file, is checked (size, and for ``fine-tune`` the
chat format line by line), renamed to its id, and only then recorded: the record, with the
tenant's quota taken, is one Lua script, so a file is listed only once its bytes are all
there, and a tenant never holds more than its quota even with uploads racing. A crash before
the record leaves at most an unlisted file behind (never a listed file without bytes)."""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec

from shared.errors import BadRequest, PayloadTooLarge
from shared.store import Store
from shared.subjects import Keys

PURPOSES = ("fine-tune",)
ROLES = ("system", "user", "assistant")
CHUNK = 1 << 20


class FileObject(msgspec.Struct, kw_only=True):
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    tenant: str
    examples: int = 0  # fine-tune: the training examples (lines) it holds
    created: float = 0.0  # unix seconds, to the microsecond: the order of a listing

    def openai(self) -> dict[str, Any]:
        """As OpenAI's API shows a file."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
        }


def check_chat_jsonl(path: Path) -> int:
    """The examples in a chat-format JSONL training file (OpenAI's: one JSON object a line,
    ``{"messages": [{"role": ..., "content": ...}, ...]}``, with at least one assistant
    message); ``BadRequest`` naming the first bad line and what is wrong with it."""
    examples = 0
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            problem = _chat_problem(raw)
            if problem is not None:
                raise BadRequest(
                    f"Invalid file format: line {number}: {problem}.",
                    param="file",
                    code="invalid_file_format",
                )
            examples += 1
    if not examples:
        raise BadRequest(
            "Invalid file format: the file holds no training example.",
            param="file",
            code="invalid_file_format",
        )
    return examples


def _chat_problem(raw: bytes) -> str | None:
    try:
        line = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return "not valid JSON"
    if not isinstance(line, dict):
        return "not a JSON object"
    messages = line.get("messages")
    if not isinstance(messages, list) or not messages:
        return "`messages` must be a non-empty list"
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"messages[{i}] is not an object"
        if m.get("role") not in ROLES:
            return f"messages[{i}].role must be one of {', '.join(ROLES)}"
        if not isinstance(m.get("content"), str):
            return f"messages[{i}].content must be a string"
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant message to learn from"
    return None


# KEYS: files hash, usage hash. ARGV: id, record, tenant, bytes, quota. 1, or -1 (quota).
_RECORD = """
local used = tonumber(redis.call('HGET', KEYS[2], ARGV[3]) or '0')
if used + tonumber(ARGV[4]) > tonumber(ARGV[5]) then return -1 end
redis.call('HINCRBY', KEYS[2], ARGV[3], ARGV[4])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""

# KEYS: files hash, usage hash. ARGV: id, tenant, bytes. 1 if it was there.
_FORGET = """
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[2], ARGV[2], -tonumber(ARGV[3]))
return 1
"""


class FileStore:
    def __init__(
        self, store: Store, cluster: str, directory: Path, *, max_bytes: int, quota_bytes: int
    ) -> None:
        self._redis = store.redis
        self._keys = Keys(cluster)
        self.directory = directory
        self.max_bytes, self.quota_bytes = max_bytes, quota_bytes
        self._record = self._redis.register_script(_RECORD)
        self._forget = self._redis.register_script(_FORGET)

    def path(self, file_id: str) -> Path:
        return self.directory / file_id

    async def create(
        self, *, tenant: str, purpose: str, filename: str, chunks: AsyncIterator[bytes]
    ) -> FileObject:
        """Store an upload; ``BadRequest`` (its format), ``PayloadTooLarge`` (its size, or
        the tenant's quota)."""
        if purpose not in PURPOSES:
            raise BadRequest(
                f"Invalid purpose {purpose!r}: this server keeps files for {', '.join(PURPOSES)}.",
                param="purpose",
            )
        self.directory.mkdir(parents=True, exist_ok=True)
        file_id = f"file-{secrets.token_hex(12)}"
        tmp = self.directory / f".upload-{file_id}"
        try:
            size = 0
            with tmp.open("xb") as f:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise PayloadTooLarge(
                            f"The file exceeds {self.max_bytes} bytes.", param="file"
                        )
                    f.write(chunk)
            examples = check_chat_jsonl(tmp) if purpose == "fine-tune" else 0
            now = time.time()
            obj = FileObject(
                id=file_id,
                bytes=size,
                created_at=int(now),
                created=now,
                filename=_safe_name(filename),
                purpose=purpose,
                tenant=tenant,
                examples=examples,
            )
            os.replace(tmp, self.path(file_id))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        try:
            recorded = await self._record(
                keys=[self._keys.files(), self._keys.file_usage()],
                args=[file_id, msgspec.msgpack.encode(obj), tenant, size, self.quota_bytes],
            )
        except BaseException:
            self.path(file_id).unlink(missing_ok=True)
            raise
        if int(recorded) < 0:
            self.path(file_id).unlink(missing_ok=True)
            raise PayloadTooLarge(
                f"The files of tenant {tenant!r} would exceed its quota of {self.quota_bytes} "
                "bytes; delete some first.",
                param="file",
                code="quota_exceeded",
            )
        return obj

    async def get(self, file_id: str) -> FileObject | None:
        blob = await self._redis.hget(self._keys.files(), file_id)
        return None if blob is None else _decode(blob)

    async def list(self) -> list[FileObject]:
        """Every file, newest first."""
        blobs = await self._redis.hvals(self._keys.files())
        objs = [_decode(b) for b in blobs]
        return sorted(objs, key=lambda o: (o.created, o.id), reverse=True)

    async def delete(self, obj: FileObject) -> bool:
        """Forget the file and free its bytes and quota; False if it was gone already."""
        gone = await self._forget(
            keys=[self._keys.files(), self._keys.file_usage()],
            args=[obj.id, obj.tenant, obj.bytes],
        )
        self.path(obj.id).unlink(missing_ok=True)
        return bool(int(gone))

    async def usage(self, tenant: str) -> int:
        return int(await self._redis.hget(self._keys.file_usage(), tenant) or 0)


def _safe_name(filename: str) -> str:
    """The upload's name as shown back (and in a download's Content-Disposition): its last
    part, letters, digits, spaces, dots, dashes and underscores only."""
    name = re.sub(r"[^\w. -]", "_", os.path.basename(filename.replace("\\", "/")), flags=re.ASCII)[
        :255
    ]
    return name.strip(" .") or "upload.jsonl"


def _decode(blob: bytes | str) -> FileObject:
    raw = blob.encode() if isinstance(blob, str) else blob
    return msgspec.msgpack.decode(raw, type=FileObject)
