"""Tasks placed on task executors, and the token stream they send back."""

from __future__ import annotations

import enum

import msgspec

from shared.messages.api import ErrorReply, SamplingParams
from shared.messages.base import Message


class TaskMode(enum.StrEnum):
    """What part of a job a task runs: all of it (colocated), or, with PD disaggregation, its
    prefill or its decode. A TE refuses a mode its engine does not declare
    (``EngineCapabilities.modes``)."""

    COLOCATED = "colocated"
    PREFILL = "prefill"
    DECODE = "decode"


def attempt_key(request_id: str, attempt: int) -> str:
    """One placement of a request (the frontend places it again after losing an instance):
    what a token stream, a task on a TE and a cancel are keyed by."""
    return f"{request_id}-{attempt}"


def task_key(request_id: str, attempt: int, mode: TaskMode) -> str:
    """One task of an attempt: the attempt's key for the task that streams tokens (colocated
    or decode), with a suffix for the prefill task of a disaggregated attempt."""
    key = attempt_key(request_id, attempt)
    return f"{key}/prefill" if mode == TaskMode.PREFILL else key


class KvSource(msgspec.Struct, frozen=True, kw_only=True):
    """Where a decode task pulls its prompt's KV from: the prefill TE's KV server, and the
    prefill task's key there (``task_key``). The bytes go TE to TE, never over NATS."""

    te_id: str
    address: str  # host:port of the prefill TE's KV server
    key: str


class ChatTask(Message):
    request_id: str  # the client's request, the same in every attempt (and in every log line)
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_to: str  # the frontend's inbox; the TE streams TokenChunk messages there
    deadline: float  # unix seconds; a TE drops work that can no longer be useful
    mode: TaskMode = TaskMode.COLOCATED
    attempt: int = 0
    # Leading prompt tokens the router's prompt index says this TE holds: the TE counts the
    # rest as its queued prefill work until the engine starts the prompt.
    matched_tokens: int = 0
    # The job executor that placed it: the TE tells it when the task starts decoding and when
    # it ends (TaskProgress), and reports its share of the TE's load (TEHeartbeat.shares).
    je_id: str = ""
    # A decode task: where its prompt's KV comes from (None: any other mode).
    kv_source: KvSource | None = None
    # A fine-tuned model: the LoRA adapter it runs under (the TE loads it on first use from
    # ``adapter_path``), "": the base model.
    adapter: str = ""
    adapter_path: str = ""
    # Seconds since the request reached its frontend, when the task was sent: its deadlines
    # (``shared.headroom``) count from then, on the TE's clock.
    age_s: float = 0.0

    @property
    def key(self) -> str:
        return task_key(self.request_id, self.attempt, self.mode)


class TaskAccepted(Message):
    request_id: str
    te_id: str
    attempt: int = 0
    # The TE's number for this placement (1, 2, ...): TEHeartbeat.placements says which
    # placements a heartbeat's figures had seen.
    seq: int = 0


class TaskProgress(Message):
    """A TE tells the job executor that placed some tasks (by attempt key) that they produced
    their first token (their prompt is done) or ended (finished, failed, cancelled or handed
    back). The JE's count of each TE's work (``services/job_executor/ledger.py``) is exact by
    these, at any request rate, instead of waiting for the TE's next heartbeat."""

    te_id: str
    prefilled: list[str] = msgspec.field(default_factory=list)
    ended: list[str] = msgspec.field(default_factory=list)
    # Of those ended, the ones that finished (stop or length): the tokens each produced, for
    # the JE's output-length predictor (``services/job_executor/output_length.py``).
    outputs: dict[str, int] = msgspec.field(default_factory=dict)


class CancelTask(Message):
    request_id: str
    attempt: int = 0
    mode: TaskMode = TaskMode.COLOCATED  # PREFILL: the attempt's prefill task

    @property
    def key(self) -> str:
        return task_key(self.request_id, self.attempt, self.mode)


class KvTransferNote(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How a decode task's prompt KV came from its prefill TE (on the task's first chunk):
    for the request's metrics and the load generator's split."""

    prefill_te: str
    transport: str = ""  # "shm" or "tcp"; "" when it did not arrive
    bytes: int = 0  # KV bytes moved (the tokens the decode TE held are not sent)
    seconds: float = 0.0  # the pull, from the decode task's start to the KV in hand
    held_tokens: int = 0  # prompt tokens the decode TE's cache held already
    fallback: str = ""  # why the decode TE prefilled itself instead ("": it did not)


class TokenChunk(Message):
    """New tokens of one attempt of a request. seq counts chunks from 0 so a reader can spot
    a gap. The last chunk has finish_reason set: "stop" or "length", or "error" with
    ``failure`` saying what went wrong (a retryable failure moves the request to another
    instance after its retry_after_s; any other ends it with that error)."""

    request_id: str
    seq: int
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None  # failure's message (kept for readers that predate failure)
    te_id: str = ""  # the sender: a frontend drops chunks of a TE its attempt did not land on
    attempt: int = 0
    failure: ErrorReply | None = None
    te_s: float = 0.0  # on an attempt's first chunk: the TE's time, task accepted to sent
    kv: KvTransferNote | None = None  # on a decode task's first chunk
    # On a retryable failure: the TE a KV preemption validated the request on (shadow
    # validation): its resubmission asks for that TE first (``ChatJob.prefer_te_id``).
    move_to: str = ""

    @property
    def key(self) -> str:
        return attempt_key(self.request_id, self.attempt)
