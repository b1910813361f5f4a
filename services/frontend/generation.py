"""One generation: submit the job, receive the TE's token stream, and resubmit if the JE
holding it or the TE running it dies or gives it back, so an accepted request survives
the loss of any one process. A resubmission carries the tokens produced so far, so greedy
output continues exactly where it stopped."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Iterable

import msgspec
from nats.aio.msg import Msg

from shared.clients import JobExecutorClient, TaskExecutorClient, ViewWatcher
from shared.errors import Internal, MeshserveError, Unavailable
from shared.logging import get_logger
from shared.messages.api import SamplingParams
from shared.messages.base import decoder_for
from shared.messages.jobs import ChatJob, JobAccepted, JobHeld
from shared.messages.tasks import RETRY_ELSEWHERE, TokenChunk
from shared.settings import Settings
from shared.subjects import Subjects

log = get_logger(__name__)

MAX_ATTEMPTS = 4
# How often a waiting generation checks that its JE or TE is still in the cluster view.
LIVENESS_POLL_S = 0.25

# How long a cancelled request waits for a placement in flight, to cancel it on its TE.
CANCEL_WAIT_S = 5.0

_stream_decoder = decoder_for(TokenChunk, JobHeld)


class StreamRouter:
    """One subscription for all of this frontend's token streams; chunks are routed to the
    queue of their attempt, JobHeld notices to its holder slot."""

    def __init__(self, owner: str, subjects: Subjects) -> None:
        self.owner = owner
        self._subjects = subjects
        self._queues: dict[str, asyncio.Queue[TokenChunk]] = {}
        self.holders: dict[str, str] = {}  # attempt key -> id of the JE holding it

    async def on_msg(self, m: Msg) -> None:
        try:
            msg = _stream_decoder.decode(m.data)
        except msgspec.DecodeError:
            log.warning("undecodable message on a token stream", subject=m.subject)
            return
        if isinstance(msg, JobHeld):
            if msg.request_id in self._queues:
                self.holders[msg.request_id] = msg.je_id
            return
        q = self._queues.get(msg.request_id)
        if q is not None:
            q.put_nowait(msg)

    def open(self, key: str) -> tuple[str, asyncio.Queue[TokenChunk]]:
        q: asyncio.Queue[TokenChunk] = asyncio.Queue()
        self._queues[key] = q
        return self._subjects.token_stream(self.owner, key), q

    def close(self, key: str) -> None:
        self._queues.pop(key, None)
        self.holders.pop(key, None)


class AbsenceClock:
    """Whether a member has been missing from the cluster view for longer than a grace
    period. The grace keeps a view that is briefly incomplete (a cluster manager that has
    just restarted) from reading as the death of every member."""

    def __init__(self, grace_s: float) -> None:
        self._grace = grace_s
        self._missing_since: dict[str, float] = {}

    def gone(self, member: str, present: Iterable[str]) -> bool:
        now = time.monotonic()
        if member in present:
            self._missing_since.pop(member, None)
            return False
        return now - self._missing_since.setdefault(member, now) > self._grace


class _Lost(Exception):
    """The JE holding the job died before placing it."""


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
    on_attempt: Callable[[int, str], None] | None = None
    _attempt: tuple[str, str] | None = None  # (te_id, key) of the attempt now streaming

    def __post_init__(self) -> None:
        self._absence = AbsenceClock(2 * self.settings.heartbeat_interval.total_seconds())

    async def tokens(self) -> AsyncIterator[list[int]]:
        """Yield token ids as they arrive until the request finishes."""
        exclude: list[str] = []
        deadline = time.time() + self.settings.request_timeout.total_seconds()
        for attempt in range(MAX_ATTEMPTS):
            key = f"{self.request_id}-{attempt}"
            subject, queue = self.router.open(key)
            try:
                try:
                    accepted = await self._submit(key, subject, attempt, exclude)
                except _Lost:
                    continue
                self._attempt = (accepted.te_id, key)
                if self.on_attempt:
                    self.on_attempt(attempt, accepted.te_id)
                async for ids in self._receive(queue, accepted.te_id, deadline):
                    yield ids
                if self.finish_reason is not None:
                    return
                # Lost or handed back. If the TE is in fact alive, it must stop before the
                # request runs elsewhere.
                await self.cancel()
                self._attempt = None
                exclude.append(accepted.te_id)
                log.warning(
                    "resubmitting request",
                    request_id=self.request_id,
                    te=accepted.te_id,
                    generated=len(self.generated),
                )
            finally:
                self.router.close(key)
        raise Unavailable(
            f"The request failed on {MAX_ATTEMPTS} task executors; retry later.",
            retry_after_s=self.settings.retry_after.total_seconds(),
        )

    async def _submit(
        self, key: str, subject: str, attempt: int, exclude: list[str]
    ) -> JobAccepted:
        placement = self.settings.placement_timeout.total_seconds()
        job = ChatJob(
            request_id=key,
            model=self.model,
            prompt_token_ids=self.prompt_token_ids + self.generated,
            sampling=msgspec.structs.replace(
                self.sampling, max_tokens=self.sampling.max_tokens - len(self.generated)
            ),
            reply_to=subject,
            deadline=time.time() + placement,
            attempt=attempt,
            exclude_te_ids=exclude,
        )
        submit = asyncio.create_task(self.jobs.submit(job, timeout=placement + 5))
        try:
            while True:
                try:
                    done, _ = await asyncio.wait({submit}, timeout=LIVENESS_POLL_S)
                except asyncio.CancelledError:
                    await self._cancel_placed(submit, key)
                    raise
                if done:
                    break
                holder = self.router.holders.get(key)
                if holder and self._member_gone(holder, (je.je_id for je in self.view.view.jes)):
                    log.warning(
                        "job executor lost while holding the job",
                        je=holder,
                        request_id=self.request_id,
                    )
                    raise _Lost
            return submit.result()
        except Unavailable as e:
            if e.code == "unavailable":  # the bus's own failure, not a JE's verdict
                raise Unavailable(
                    "No job executor answered in time; retry later.",
                    retry_after_s=self.settings.retry_after.total_seconds(),
                ) from e
            raise
        finally:
            submit.cancel()

    async def _cancel_placed(self, submit: asyncio.Task[JobAccepted], key: str) -> None:
        """The client left while the job was being placed. The TE may already be running
        it: wait a moment for the placement's answer, then cancel it there."""
        try:
            accepted = await asyncio.wait_for(asyncio.shield(submit), CANCEL_WAIT_S)
        except (TimeoutError, MeshserveError, asyncio.CancelledError):
            return
        with contextlib.suppress(MeshserveError):
            await self.tes.cancel(accepted.te_id, key)

    def _member_gone(self, member: str, present: Iterable[str]) -> bool:
        return self.view.view.version >= 0 and self._absence.gone(member, set(present))

    async def _receive(
        self, queue: asyncio.Queue[TokenChunk], te_id: str, deadline: float
    ) -> AsyncIterator[list[int]]:
        """Chunks of one attempt. Returns without finish_reason when the attempt is lost.

        Tokens taken already are dropped (a chunk's completion_tokens says where its tokens
        end): a JE that got the TE's answer too late cancels the task and places it again,
        and if the first copy had started, the TE streams the task again from its first
        token after what the first copy sent. Greedy and seeded copies repeat the same
        tokens; an unseeded one's continuation follows its own."""
        have = 0  # tokens of this attempt taken so far
        while True:
            try:
                chunk = await asyncio.wait_for(queue.get(), LIVENESS_POLL_S)
            except TimeoutError:
                if time.time() > deadline:
                    raise Unavailable("the request timed out") from None
                if self._member_gone(te_id, (te.te_id for te in self.view.view.tes)):
                    log.warning("task executor lost", te=te_id, request_id=self.request_id)
                    return
                continue
            if chunk.te_id and chunk.te_id != te_id:
                continue  # a TE the JE gave up on after all started: not this attempt's
            start = chunk.completion_tokens - len(chunk.token_ids)
            if start > have:
                log.warning(
                    "tokens lost", request_id=self.request_id, te=te_id, expected=have, got=start
                )
            ids = chunk.token_ids[max(0, have - start) :]
            have = max(have, chunk.completion_tokens)
            if chunk.finish_reason == RETRY_ELSEWHERE:
                return
            if chunk.finish_reason == "error":
                raise Internal(f"generation failed: {chunk.error}")
            if ids:
                if self.first_token_at is None:
                    self.first_token_at = time.monotonic()
                self.generated.extend(ids)
                self.cached_tokens = max(self.cached_tokens, chunk.cached_tokens)
                yield ids
            if chunk.finish_reason is not None:
                self.finish_reason = chunk.finish_reason
                return

    async def cancel(self) -> None:
        """Stop the generation on its TE (the client left, a stop string was hit, or the
        attempt is being abandoned)."""
        if self.finish_reason is None and self._attempt is not None:
            te_id, key = self._attempt
            with contextlib.suppress(MeshserveError):
                await self.tes.cancel(te_id, key)
