"""Tasks placed on task executors, and the token stream they send back."""

from __future__ import annotations

import enum

from shared.messages.api import SamplingParams
from shared.messages.base import Message


class TaskMode(enum.StrEnum):
    """What part of a job a task runs. Only colocated exists in the skeleton; prefill and
    decode arrive with PD disaggregation, stage with layer-range pipelines."""

    COLOCATED = "colocated"
    PREFILL = "prefill"
    DECODE = "decode"
    STAGE = "stage"


class ChatTask(Message):
    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_to: str  # the frontend's inbox; the TE streams TokenChunk messages there
    deadline: float  # unix seconds; a TE drops work that can no longer be useful
    mode: TaskMode = TaskMode.COLOCATED


class TaskAccepted(Message):
    request_id: str
    te_id: str


class CancelTask(Message):
    request_id: str


# finish_reason of a last chunk whose TE gave the request up (unloading, shutting down):
# the frontend resubmits it, with the tokens it has so far, to another TE.
RETRY_ELSEWHERE = "retry"


class TokenChunk(Message):
    """New tokens of one request. seq counts chunks from 0 so a reader can spot a gap.
    finish_reason is set on the last chunk: "stop", "length", "error" (see error) or
    RETRY_ELSEWHERE."""

    request_id: str
    seq: int
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    te_id: str = ""  # the sender: a frontend drops chunks of a TE its attempt did not land on
