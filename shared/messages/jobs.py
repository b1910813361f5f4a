"""Jobs: what the frontend hands a job executor."""

from __future__ import annotations

import msgspec

from shared.messages.api import SamplingParams
from shared.messages.base import Message
from shared.messages.tasks import attempt_key


class ChatJob(Message):
    """One chat or completion request, tokenized. The JE places it as tasks; tokens flow
    from the TE straight to reply_to."""

    request_id: str  # the client's request, the same in every attempt
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_to: str
    deadline: float  # unix seconds by which the job must be placed
    attempt: int = 0  # >0 when the frontend resubmits after its TE died
    exclude_te_ids: list[str] = msgspec.field(default_factory=list)
    # A fine-tuned model: the LoRA adapter of ``model`` it runs under, and its directory.
    adapter: str = ""
    adapter_path: str = ""
    age_s: float = 0.0  # seconds since the request reached its frontend, when it was sent
    # A KV preemption handed the request back having validated it on this TE
    # (``TokenChunk.move_to``): placed there when it is ready, else wherever routing says.
    prefer_te_id: str = ""

    @property
    def key(self) -> str:
        return attempt_key(self.request_id, self.attempt)


class JobAccepted(Message):
    request_id: str
    te_id: str
    je_id: str
    attempt: int = 0
    matched_tokens: int = 0  # leading prompt tokens the prompt index says the TE holds
    best_matched_tokens: int = 0  # the most any ready TE of the model held (an oracle's hit)
    routing: str = ""  # the routing branch that chose the TE (routing.route)
    je_s: float = 0.0  # the JE's time on it: the job received to the TE's answer
    prefill_te_id: str = ""  # disaggregated: the TE that prefills it (te_id decodes it)
    pd: str = ""  # why it was or was not disaggregated (disaggregation.decide)


class JobTaken(Message):
    """Sent by a JE to the job's reply_to the moment it receives the job, before it places
    it: from then on the frontend follows that JE's liveness, so a JE that dies while
    placing the job (before its answer) costs one liveness deadline, not the bus request's
    timeout. Once the JE answers, the attempt follows the TE instead."""

    request_id: str
    je_id: str
    attempt: int = 0

    @property
    def key(self) -> str:
        return attempt_key(self.request_id, self.attempt)


class JobHeld(Message):
    """Sent by a JE to the job's reply_to when it starts holding a job it cannot place yet
    (waiting for a scale-up): the frontend times how long the job waits for capacity. It
    follows the JE's liveness already (JobTaken), and does so again here."""

    request_id: str
    je_id: str
    attempt: int = 0

    @property
    def key(self) -> str:
        return attempt_key(self.request_id, self.attempt)
