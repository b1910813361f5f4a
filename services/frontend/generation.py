"""One generation: submit the job, receive the TE's token stream, and resubmit if the TE
dies or gives the request back, so an accepted request survives the loss of any one
process. A resubmission carries the tokens produced so far, so greedy output continues
exactly where it stopped."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable

import msgspec
from nats.aio.msg import Msg

from shared.clients import JobExecutorClient, TaskExecutorClient, ViewWatcher
from shared.errors import Internal, MeshserveError, Unavailable
from shared.logging import get_logger
from shared.messages.api import SamplingParams
from shared.messages.base import decoder_for
from shared.messages.jobs import ChatJob
from shared.messages.tasks import RETRY_ELSEWHERE, TokenChunk
from shared.settings import Settings
from shared.subjects import Subjects

log = get_logger(__name__)

MAX_ATTEMPTS = 4
# How often a waiting stream checks that its TE is still in the cluster view.
LIVENESS_POLL_S = 0.5

_chunk_decoder = decoder_for(TokenChunk)


class StreamRouter:
    """One subscription for all of this frontend's token streams; chunks are routed to the
    queue of their request."""

    def __init__(self, owner: str, subjects: Subjects) -> None:
        self.owner = owner
        self._subjects = subjects
        self._queues: dict[str, asyncio.Queue[TokenChunk]] = {}

    async def on_msg(self, m: Msg) -> None:
        try:
            chunk = _chunk_decoder.decode(m.data)
        except msgspec.DecodeError:
            log.warning("undecodable token chunk", subject=m.subject)
            return
        q = self._queues.get(chunk.request_id)
        if q is not None:
            q.put_nowait(chunk)

    def open(self, key: str) -> tuple[str, asyncio.Queue[TokenChunk]]:
        q: asyncio.Queue[TokenChunk] = asyncio.Queue()
        self._queues[key] = q
        return self._subjects.token_stream(self.owner, key), q

    def close(self, key: str) -> None:
        self._queues.pop(key, None)


@dataclasses.dataclass
class Generation:
    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    settings: Settings
    router: StreamRouter
    jobs: JobExecutorClient
    tes: TaskExecutorClient
    view: ViewWatcher
    generated: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0
    first_token_at: float | None = None
    _te_id: str | None = None
    _key: str | None = None
    on_attempt: Callable[[int, str], None] | None = None

    async def tokens(self) -> AsyncIterator[list[int]]:
        """Yield token ids as they arrive until the request finishes."""
        exclude: list[str] = []
        deadline = time.time() + self.settings.request_timeout.total_seconds()
        for attempt in range(MAX_ATTEMPTS):
            key = f"{self.request_id}-{attempt}"
            subject, queue = self.router.open(key)
            self._key = key
            try:
                remaining = self.sampling.max_tokens - len(self.generated)
                job = ChatJob(
                    request_id=key,
                    model=self.model,
                    prompt_token_ids=self.prompt_token_ids + self.generated,
                    sampling=msgspec.structs.replace(self.sampling, max_tokens=remaining),
                    reply_to=subject,
                    deadline=time.time() + self.settings.placement_timeout.total_seconds(),
                    attempt=attempt,
                    exclude_te_ids=exclude,
                )
                accepted = await self.jobs.submit(
                    job, timeout=self.settings.placement_timeout.total_seconds() + 5
                )
                self._te_id = accepted.te_id
                if self.on_attempt:
                    self.on_attempt(attempt, accepted.te_id)
                async for ids in self._receive(queue, accepted.te_id, deadline):
                    yield ids
                if self.finish_reason is not None:
                    return
                exclude.append(accepted.te_id)
                log.warning("resubmitting request", request_id=self.request_id,
                            te=accepted.te_id, generated=len(self.generated))
            finally:
                self.router.close(key)
        raise Unavailable(f"request {self.request_id} failed on {MAX_ATTEMPTS} task executors")

    async def _receive(
        self, queue: asyncio.Queue[TokenChunk], te_id: str, deadline: float
    ) -> AsyncIterator[list[int]]:
        """Chunks of one attempt. Returns without finish_reason when the attempt is lost."""
        while True:
            try:
                chunk = await asyncio.wait_for(queue.get(), LIVENESS_POLL_S)
            except TimeoutError:
                if time.time() > deadline:
                    raise Unavailable("the request timed out") from None
                if self.view.view.version >= 0 and all(
                    te.te_id != te_id for te in self.view.view.tes
                ):
                    log.warning("task executor lost", te=te_id, request_id=self.request_id)
                    return
                continue
            if chunk.finish_reason == RETRY_ELSEWHERE:
                return
            if chunk.finish_reason == "error":
                raise Internal(f"generation failed: {chunk.error}")
            if chunk.token_ids:
                if self.first_token_at is None:
                    self.first_token_at = time.monotonic()
                self.generated.extend(chunk.token_ids)
                self.cached_tokens = max(self.cached_tokens, chunk.cached_tokens)
                yield chunk.token_ids
            if chunk.finish_reason is not None:
                self.finish_reason = chunk.finish_reason
                return

    async def cancel(self) -> None:
        """Stop the generation on its TE (the client left, or a stop string was hit)."""
        if self.finish_reason is None and self._te_id and self._key:
            with contextlib.suppress(MeshserveError):
                await self.tes.cancel(self._te_id, self._key)
