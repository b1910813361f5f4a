"""Types shared by the API-facing families: sampling parameters and error replies."""

from __future__ import annotations

import msgspec

from shared.messages.base import Message


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to pick tokens. temperature 0 means greedy."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False


class ErrorReply(Message):
    """A request failed. status is the HTTP status the frontend returns for it; kind is the
    error's class (shared.errors), which the receiver raises again."""

    status: int
    code: str
    message: str
    retryable: bool = False
    retry_after_s: float | None = None
    param: str | None = None
    kind: str = ""
