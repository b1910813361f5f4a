"""Jobs: what the frontend hands a job executor."""

from __future__ import annotations

import msgspec

from shared.messages.api import SamplingParams
from shared.messages.base import Message


class ChatJob(Message):
    """One chat or completion request, tokenized. The JE places it as tasks; tokens flow
    from the TE straight to reply_to."""

    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_to: str
    deadline: float  # unix seconds by which the job must be placed
    attempt: int = 0  # >0 when the frontend resubmits after its TE died
    exclude_te_ids: list[str] = msgspec.field(default_factory=list)


class JobAccepted(Message):
    request_id: str
    te_id: str
    je_id: str
