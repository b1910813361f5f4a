"""Response bodies and server-sent events exactly as the OpenAI API sends them.

Builders return plain dicts; ``json_body`` and ``sse`` encode them (msgspec, UTF-8, no
spaces). One choice per response (``n`` is always 1), ``logprobs`` always null.

Non-streaming::

    json_body(chat_completion(id, model, created, text, finish_reason, usage(p, c)))
    json_body(completion(id, model, created, text, finish_reason, usage(p, c)))

Streaming chat (each line is ``sse(...)``)::

    chat_chunk(id, model, created, delta={"role": "assistant", "content": ""})  # first
    chat_chunk(id, model, created, delta={"content": piece})                     # text
    chat_chunk(id, model, created, delta={}, finish_reason="stop")               # last
    usage_chunk(id, model, created, usage(p, c))       # only if stream_options.include_usage
    SSE_DONE

Streaming completions: ``completion_chunk(..., text=piece)`` per piece, then
``completion_chunk(..., text="", finish_reason=...)``, then
``usage_chunk(..., chat=False)`` if asked, then ``SSE_DONE``.

An error after the stream started is sent as ``sse(error_body(err))`` followed by
``SSE_DONE``, as vLLM does; before that, as a normal JSON body with ``err.status``.

``finish_reason`` must be an OpenAI value ("stop" or "length"); the caller maps the
engine's own reasons ("abort", "error") before building a body.
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from shared.errors import MeshserveError

SSE_DONE = b"data: [DONE]\n\n"

_encode = msgspec.json.encode


def chat_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def chat_completion(
    id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str,
    usage: dict[str, Any],
) -> dict[str, Any]:
    return {
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage,
    }


def chat_chunk(
    id: str,
    model: str,
    created: int,
    *,
    delta: dict[str, Any],
    finish_reason: str | None = None,
) -> dict[str, Any]:
    return {
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }


def completion(
    id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str,
    usage: dict[str, Any],
) -> dict[str, Any]:
    return {
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage,
    }


def completion_chunk(
    id: str,
    model: str,
    created: int,
    *,
    text: str,
    finish_reason: str | None = None,
) -> dict[str, Any]:
    return {
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}],
    }


def usage_chunk(
    id: str, model: str, created: int, usage: dict[str, Any], *, chat: bool = True
) -> dict[str, Any]:
    """The last chunk before ``[DONE]`` when the client asked for
    ``stream_options.include_usage``: no choices, only usage."""
    return {
        "id": id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage,
    }


def error_body(err: MeshserveError) -> dict[str, Any]:
    return err.to_openai()


def json_body(obj: Any) -> bytes:
    return _encode(obj)


def sse(obj: Any) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"
