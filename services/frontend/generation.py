"""One generation: submit the job, receive the TE's token stream, and resubmit if the JE
placing it or the TE running it dies or gives it back, so an accepted request survives
the loss of any one process. A resubmission carries the tokens produced so far, so greedy
output continues exactly where it stopped.

Nothing here polls. An attempt waits on its inbox, which receives the TE's chunks, and one
of three notices: its member declared gone (``liveness.Liveness``, for every attempt on that
member at once), the bus connection lost (``StreamRouter.interrupt_all``) or the request's
deadline (a timer).

A client that reads slower than its tokens come (or not at all) leaves them waiting in the
inbox. There they coalesce: a chunk that continues the one still waiting is appended to it,
so what waits is one list of token ids, not a message per token; it is bounded by the
request's max_tokens, and in time by ``frontend.stall_timeout`` (``streaming.StallGuard``
ends a stream whose client reads nothing for that long). The inbox cannot refuse a chunk:
the one subscription that feeds every stream must never wait on a single slow one."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

import msgspec
from nats.aio.msg import Msg

from services.frontend.liveness import Liveness, Watch
from shared.clients import JobExecutorClient, TaskExecutorClient
from shared.errors import MeshserveError, NoResponder, PeerUnreachable, Unavailable, from_reply
from shared.logging import get_logger
from shared.messages.api import SamplingParams
from shared.messages.base import decoder_for
from shared.messages.jobs import ChatJob, JobAccepted, JobHeld, JobTaken
from shared.messages.tasks import KvTransferNote, TokenChunk, attempt_key
from shared.settings import Settings
from shared.subjects import Subjects

log = get_logger(__name__)

MAX_ATTEMPTS = 4

# How long a cancelled request waits for a placement in flight, to cancel it on its TE.
CANCEL_WAIT_S = 5.0

# How often a job is offered again while no job executor serves the subject at all.
NO_JE_RETRY_S = 0.2

_stream_decoder = decoder_for(TokenChunk, JobTaken, JobHeld)


class _Lost:
    """The member the attempt depended on was declared gone (``member``), or the bus lost
    what the attempt was waiting for (``member`` None): moved elsewhere; or, with ``error``,
    failed with it."""

    def __init__(self, member: str | None, error: MeshserveError | None = None) -> None:
        self.member, self.error = member, error


class _Deadline:
    """The request's deadline passed."""


Event = TokenChunk | _Lost | _Deadline


def _continues(last: TokenChunk, chunk: TokenChunk) -> bool:
    """``chunk`` holds the tokens right after ``last``'s, from the same TE, and neither ends
    anything: appending it to ``last`` loses nothing a reader looks at."""
    return (
        last.finish_reason is None
        and last.failure is None
        and chunk.failure is None
        and chunk.te_id == last.te_id
        and chunk.completion_tokens - len(chunk.token_ids) == last.completion_tokens
    )


class Inbox:
    """An attempt's events in arrival order, with the chunks that wait for a reader that is
    behind coalesced into one. Each entry keeps the arrival time of its oldest token."""

    def __init__(self) -> None:
        self._items: deque[tuple[float, Event]] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def __len__(self) -> int:
        return len(self._items)

    def put_nowait(self, event: Event) -> None:
        items = self._items
        if items and isinstance(event, TokenChunk):
            last = items[-1][1]
            if isinstance(last, TokenChunk) and _continues(last, event):
                # The decoded chunk is this inbox's own: extended in place, never copied.
                last.token_ids.extend(event.token_ids)
                last.seq = event.seq
                last.completion_tokens = event.completion_tokens
                last.cached_tokens = max(last.cached_tokens, event.cached_tokens)
                last.finish_reason = event.finish_reason
                return
        items.append((time.monotonic(), event))
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def pending(self) -> list[Event]:
        """The events waiting, oldest first."""
        return [event for _, event in self._items]

    def drop(self, unwanted: Callable[[Event], bool]) -> None:
        """Remove the waiting events ``unwanted`` says so of."""
        self._items = deque(item for item in self._items if not unwanted(item[1]))

    async def get(self) -> tuple[float, Event]:
        """The oldest entry: (when it arrived, the event)."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


class Attempt:
    """One placement of a request: its token stream and the member it depends on now."""

    def __init__(self, request_id: str, attempt: int, subject: str, liveness: Liveness) -> None:
        self.request_id, self.attempt, self.subject = request_id, attempt, subject
        self.key = attempt_key(request_id, attempt)
        self.events = Inbox()
        self.lost = asyncio.Event()
        self.error: MeshserveError | None = None  # the attempt failed with it, not moved
        self.lost_member: str | None = None  # the member whose loss ended it
        self.held_at: float | None = None  # monotonic time a JE said it holds the job
        self.placed_on: str | None = None  # the TE the JE's answer named
        self.taken = False  # a JE said it has the job (or its TE streams it)
        self.untaken = False  # no JE said it took the job within a liveness deadline
        self._liveness = liveness
        self._watch: Watch | None = None

    def depend_on(self, member: str) -> None:
        """From now on the attempt fails over when ``member`` is declared gone."""
        if self._watch is not None:
            if self._watch.member == member:
                return
            self._watch.cancel()
        elif self.lost_member is not None and self.lost_member != member and self.error is None:
            self._forget_loss()
        self._watch = self._liveness.watch(member, self._on_lost)

    def _forget_loss(self) -> None:
        """The member the attempt depended on was declared gone just as the attempt moved
        past it (the JE's answer came first, then the notice of its death): that loss no
        longer concerns the attempt, which now depends on another member."""
        self.lost.clear()
        self.lost_member = None
        self.events.drop(lambda event: isinstance(event, _Lost))

    def streaming_from(self) -> set[str]:
        """The TEs whose chunks wait in the inbox (read before the attempt is abandoned)."""
        return {
            event.te_id
            for event in self.events.pending()
            if isinstance(event, TokenChunk) and event.te_id
        }

    def _on_lost(self, member: str) -> None:
        self._watch = None
        self.lost_member = member
        self.lost.set()
        self.events.put_nowait(_Lost(member))

    def not_taken(self) -> None:
        """Nobody said it took the job within a liveness deadline of its offer: the JE that
        received it died before it could say so, or stalled as long as a dead one. The
        attempt moves on."""
        if self.taken or self.lost.is_set():
            return
        self.untaken = True
        self.lost.set()
        self.events.put_nowait(_Lost(None))

    def interrupt(self, error: MeshserveError | None) -> None:
        """The bus dropped messages the attempt waits for (a chunk, the JE's answer): it
        moves on as if its member were lost, or fails with ``error``."""
        if self.lost.is_set():
            return
        self.error = error
        self.lost.set()
        self.events.put_nowait(_Lost(None, error))

    def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None


class StreamRouter:
    """One subscription for all of this frontend's token streams; chunks go to the queue of
    their attempt, a JobTaken or JobHeld notice makes the attempt depend on the JE placing
    it (until its answer names the TE)."""

    def __init__(self, owner: str, subjects: Subjects, liveness: Liveness) -> None:
        self.owner = owner
        self._subjects = subjects
        self.liveness = liveness
        self._attempts: dict[str, Attempt] = {}

    async def on_msg(self, m: Msg) -> None:
        try:
            msg = _stream_decoder.decode(m.data)
        except msgspec.DecodeError:
            log.warning("undecodable message on a token stream", subject=m.subject)
            return
        attempt = self._attempts.get(msg.key)
        if attempt is None:
            return
        attempt.taken = True
        if isinstance(msg, JobTaken):
            if attempt.placed_on is None:  # never after the answer: it depends on the TE then
                attempt.depend_on(msg.je_id)
        elif isinstance(msg, JobHeld):
            if attempt.held_at is None:
                attempt.held_at = time.monotonic()
            if attempt.placed_on is None:
                attempt.depend_on(msg.je_id)
        else:
            attempt.events.put_nowait(msg)

    def open(self, request_id: str, attempt: int) -> Attempt:
        key = attempt_key(request_id, attempt)
        a = Attempt(
            request_id, attempt, self._subjects.token_stream(self.owner, key), self.liveness
        )
        self._attempts[key] = a
        return a

    def close(self, attempt: Attempt) -> None:
        attempt.close()
        self._attempts.pop(attempt.key, None)

    def interrupt_all(self, error: MeshserveError | None) -> None:
        """Every attempt in flight may have lost messages (the bus connection dropped, and
        core NATS does not deliver again): each is resubmitted with the tokens it has, which
        continues greedy output exactly; or, with ``error``, fails with it."""
        if self._attempts:
            log.warning(
                "bus interrupted the attempts in flight",
                attempts=len(self._attempts),
                error=None if error is None else error.message,
            )
        for attempt in list(self._attempts.values()):
            attempt.interrupt(error)


@dataclasses.dataclass
class Generation:
    request_id: str
    model: str  # as the client named it (a fine-tuned model: the adapter's name)
    prompt_token_ids: list[int]
    sampling: SamplingParams
    settings: Settings
    router: StreamRouter
    jobs: JobExecutorClient
    tes: TaskExecutorClient
    base_model: str = ""  # the model whose TEs serve it ("": ``model``)
    adapter: str = ""  # a fine-tuned model: its LoRA adapter, and where its files are
    adapter_path: str = ""
    tenant: str = ""  # whose request (the metrics' label)
    arrived: float = dataclasses.field(default_factory=time.monotonic)  # reached this frontend
    generated: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    # (seconds since the tokens before, how many came): each arrival after the first token's
    token_gaps: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    # When the oldest of the tokens yielded last reached this frontend (monotonic): what the
    # frontend adds to a token's latency is measured from here.
    arrived_at: float | None = None
    held_s: float | None = None  # how long JEs held the job for capacity (None: never held)
    routed: JobAccepted | None = None  # the first placement: where routing sent it, and why
    accepted_at: float | None = None  # when the first placement's answer came (monotonic)
    te_s: float = 0.0  # the first chunk's TokenChunk.te_s
    kv: KvTransferNote | None = None  # disaggregated: how its prompt's KV came (first chunk)
    on_attempt: Callable[[int, str], None] | None = None
    _placed: tuple[str, int] | None = None  # (te_id, attempt) of the attempt now streaming
    _move_to: str = ""  # where a KV preemption validated it, for its next attempt

    async def tokens(self) -> AsyncIterator[list[int]]:
        """Yield token ids as they arrive until the request finishes."""
        exclude: list[str] = []
        loop = asyncio.get_running_loop()
        deadline_at = loop.time() + self.settings.frontend.request_timeout.total_seconds()
        for n in range(MAX_ATTEMPTS):
            attempt = self.router.open(self.request_id, n)
            deadline = loop.call_at(deadline_at, attempt.events.put_nowait, _Deadline())
            try:
                accepted = await self._submit(attempt, exclude)
                if accepted is None:  # the JE holding it was lost
                    continue
                self._placed = (accepted.te_id, n)
                if self.routed is None:
                    self.routed, self.accepted_at = accepted, time.monotonic()
                attempt.placed_on = accepted.te_id
                attempt.depend_on(accepted.te_id)  # no longer on the JE that placed it
                if self.on_attempt:
                    self.on_attempt(n, accepted.te_id)
                async for ids in self._receive(attempt, accepted.te_id):
                    yield ids
                if self.finish_reason is not None:
                    return
                # Lost or handed back. If the TE is in fact alive, it must stop before the
                # request runs elsewhere.
                await self.cancel()
                self._placed = None
                if not attempt.lost.is_set() or attempt.lost_member is not None:
                    exclude.append(accepted.te_id)  # not when only the bus dropped its chunks
                log.warning(
                    "resubmitting request",
                    request_id=self.request_id,
                    attempt=n,
                    te=accepted.te_id,
                    generated=len(self.generated),
                )
            finally:
                deadline.cancel()
                self.router.close(attempt)
        raise Unavailable(
            f"The request failed on {MAX_ATTEMPTS} task executors; retry later.",
            retry_after_s=self.settings.job_executor.retry_after.total_seconds(),
        )

    async def _submit(self, attempt: Attempt, exclude: list[str]) -> JobAccepted | None:
        """The job placed (None: the JE placing or holding it was declared gone before it
        answered, or the bus lost its answer)."""
        placement = self.settings.job_executor.placement_timeout.total_seconds()
        job = ChatJob(
            request_id=self.request_id,
            model=self.base_model or self.model,
            prompt_token_ids=self.prompt_token_ids + self.generated,
            sampling=msgspec.structs.replace(
                self.sampling, max_tokens=self.sampling.max_tokens - len(self.generated)
            ),
            reply_to=attempt.subject,
            deadline=time.time() + placement,
            attempt=attempt.attempt,
            exclude_te_ids=exclude,
            adapter=self.adapter,
            adapter_path=self.adapter_path,
            age_s=time.monotonic() - self.arrived,
            prefer_te_id=self._move_to,
        )
        self._move_to = ""  # asked once: a later attempt is routed as any
        submit = asyncio.create_task(self._offer(job, attempt))
        lost = asyncio.create_task(attempt.lost.wait())
        try:
            try:
                await asyncio.wait({submit, lost}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                await self._cancel_placed(submit, attempt.attempt)
                raise
            if attempt.held_at is not None:
                self.held_s = (self.held_s or 0.0) + time.monotonic() - attempt.held_at
            if not submit.done():
                if attempt.error is not None:
                    raise attempt.error
                log.warning(
                    "job executor lost while placing the job"
                    if attempt.lost_member is not None
                    else "no job executor said it took the job"
                    if attempt.untaken
                    else "the bus lost the job's answer",
                    request_id=self.request_id,
                    attempt=attempt.attempt,
                    je=attempt.lost_member,
                )
                # It may have placed the task before it died: stop whatever TE streams it.
                for te_id in attempt.streaming_from():
                    with contextlib.suppress(MeshserveError):
                        await self.tes.cancel(te_id, self.request_id, attempt.attempt)
                return None
            return submit.result()
        except PeerUnreachable as e:  # the bus's own failure, not a JE's verdict
            raise Unavailable(
                "No job executor answered in time; retry later.",
                retry_after_s=self.settings.job_executor.retry_after.total_seconds(),
            ) from e
        finally:
            submit.cancel()
            lost.cancel()

    async def _offer(self, job: ChatJob, attempt: Attempt) -> JobAccepted:
        """Submit the job to a JE. While no JE serves the subject at all (the only one was
        killed and is restarting), nobody received it, so it is offered again until its
        placement deadline, as a JE holding it would wait: a JE's restart must not fail the
        requests that arrive meanwhile.

        The JE that receives the job says so first of all (JobTaken), and from then on the
        attempt follows that JE's liveness. One that does not say so within a liveness
        deadline of the offer died with the job before it could (a kill between the job's
        delivery and that notice), or stalled as long as a dead member: the attempt moves
        on (``Attempt.not_taken``) rather than wait out the request's timeout."""
        taken_within = self.settings.membership.liveness_timeout.total_seconds()
        loop = asyncio.get_running_loop()
        while True:
            check = loop.call_later(taken_within, attempt.not_taken)
            try:
                return await self.jobs.submit(job, timeout=max(job.deadline - time.time(), 0) + 5)
            except NoResponder:
                if time.time() + NO_JE_RETRY_S >= job.deadline:
                    raise
            finally:
                check.cancel()
            await asyncio.sleep(NO_JE_RETRY_S)

    async def _cancel_placed(self, submit: asyncio.Task[JobAccepted], attempt: int) -> None:
        """The client left while the job was being placed. The TE may already be running
        it: wait a moment for the placement's answer, then cancel it there."""
        try:
            accepted = await asyncio.wait_for(asyncio.shield(submit), CANCEL_WAIT_S)
        except (TimeoutError, MeshserveError, asyncio.CancelledError):
            return
        with contextlib.suppress(MeshserveError):
            await self.tes.cancel(accepted.te_id, self.request_id, attempt)

    async def _receive(self, attempt: Attempt, te_id: str) -> AsyncIterator[list[int]]:
        """Chunks of one attempt. Returns without finish_reason when the attempt is lost.

        Tokens taken already are dropped (a chunk's completion_tokens says where its tokens
        end): a JE that got the TE's answer too late cancels the task and places it again,
        and if the first copy had started, the TE streams the task again from its first
        token after what the first copy sent. Greedy and seeded copies repeat the same
        tokens; an unseeded one's continuation follows its own."""
        have = 0  # tokens of this attempt taken so far
        while True:
            arrived, event = await attempt.events.get()
            if isinstance(event, _Lost):
                if event.error is not None:
                    raise event.error
                log.warning(
                    "task executor lost" if event.member is not None else "token stream lost",
                    te=te_id,
                    request_id=self.request_id,
                    attempt=attempt.attempt,
                )
                return
            if isinstance(event, _Deadline):
                raise Unavailable("the request timed out")
            chunk = event
            if chunk.te_id and chunk.te_id != te_id:
                continue  # a TE the JE gave up on after all started: not this attempt's
            start = chunk.completion_tokens - len(chunk.token_ids)
            if start > have:
                # Chunks went missing on the bus: the output would have a hole. The attempt
                # moves on like a lost one; the resubmission continues from what arrived.
                log.warning(
                    "tokens lost",
                    request_id=self.request_id,
                    te=te_id,
                    expected=have,
                    got=start,
                )
                attempt.interrupt(None)
                return
            ids = chunk.token_ids[max(0, have - start) :]
            have = max(have, chunk.completion_tokens)
            if chunk.kv is not None and self.kv is None:
                self.kv = chunk.kv
            if chunk.failure is not None:
                error = from_reply(chunk.failure)
                if not error.retryable:
                    raise error
                self._move_to = chunk.move_to
                if error.retry_after_s:
                    await asyncio.sleep(error.retry_after_s)
                return
            if ids:
                self.arrived_at = arrived
                now = time.monotonic()
                if self.last_token_at is not None:
                    self.token_gaps.append((now - self.last_token_at, len(ids)))
                elif len(ids) > 1:
                    # Tokens that came with the first one: a gap of nothing each, so every
                    # token after the first has its inter-token latency (vLLM's count).
                    self.token_gaps.append((0.0, len(ids) - 1))
                self.last_token_at = now
                if self.first_token_at is None:
                    self.first_token_at, self.te_s = self.last_token_at, chunk.te_s
                self.generated.extend(ids)
                self.cached_tokens = max(self.cached_tokens, chunk.cached_tokens)
                yield ids
            if chunk.finish_reason is not None:
                self.finish_reason = chunk.finish_reason
                return

    async def cancel(self) -> None:
        """Stop the generation on its TE (the client left, a stop string was hit, or the
        attempt is being abandoned)."""
        if self.finish_reason is None and self._placed is not None:
            te_id, attempt = self._placed
            with contextlib.suppress(MeshserveError):
                await self.tes.cancel(te_id, self.request_id, attempt)
