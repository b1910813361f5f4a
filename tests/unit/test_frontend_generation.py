"""How a generation reads one attempt's token stream (no bus: chunks go straight to its queue)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from datetime import timedelta

import pytest

from services.frontend.generation import Attempt, Generation, Inbox, StreamRouter
from services.frontend.liveness import Liveness
from shared.errors import InstanceLost, Internal, NoResponder
from shared.messages.api import SamplingParams
from shared.messages.base import Message, encode
from shared.messages.cluster import ClusterView, MemberDown, TEHeartbeat, TEState
from shared.messages.jobs import ChatJob, JobAccepted, JobTaken
from shared.messages.tasks import TokenChunk
from shared.settings import Settings
from shared.subjects import Subjects


def _chunk(seq: int, ids: list[int], done: int, finish: str | None = None) -> TokenChunk:
    return TokenChunk(
        request_id="r",
        seq=seq,
        token_ids=ids,
        completion_tokens=done,
        finish_reason=finish,
        te_id="te-1",
    )


async def _read(chunks: list[TokenChunk]) -> tuple[list[int], Generation]:
    """The tokens the generation yields for ``chunks``, all queued before it reads (so
    those that continue each other arrive coalesced)."""
    gen = Generation(
        request_id="r",
        model="m",
        prompt_token_ids=[1, 2],
        sampling=SamplingParams(max_tokens=4),
        settings=Settings(),
        router=None,  # type: ignore[arg-type]
        jobs=None,  # type: ignore[arg-type]
        tes=None,  # type: ignore[arg-type]
    )
    attempt = Attempt("r", 0, "inbox", Liveness(grace_s=1))
    for c in chunks:
        attempt.events.put_nowait(c)
    got = [t async for ids in gen._receive(attempt, "te-1") for t in ids]
    return got, gen


async def test_a_copy_restarted_on_the_same_te_does_not_repeat_tokens():
    """The JE cancelled and placed the task again after the first copy had sent two tokens:
    the second copy streams from its first token again."""
    got, gen = await _read(
        [
            _chunk(0, [7], 1),
            _chunk(1, [8], 2),  # the first copy
            _chunk(0, [7], 1),
            _chunk(1, [8], 2),
            _chunk(2, [9], 3),
            _chunk(3, [10], 4, "length"),
        ]
    )
    assert got == [7, 8, 9, 10]
    assert gen.generated == [7, 8, 9, 10] and gen.finish_reason == "length"


async def test_a_chunk_overlapping_what_was_taken_gives_only_its_new_tokens():
    got, gen = await _read(
        [_chunk(0, [7, 8], 2), _chunk(0, [7, 8, 9], 3), _chunk(1, [10], 4, "stop")]
    )
    assert got == [7, 8, 9, 10] and gen.finish_reason == "stop"


async def test_every_token_after_the_first_has_an_inter_token_latency():
    """The first token came with the next two (coalesced on a busy loop): those two count
    as gaps of nothing, so the latencies number the output tokens less one, as vLLM's do."""
    got, gen = await _read([_chunk(0, [7, 8, 9], 3, "length")])
    assert got == [7, 8, 9] and gen.token_gaps == [(0.0, 2)]


async def test_a_restarted_copy_that_fails_still_ends_the_attempt():
    """An error chunk carries no tokens and counts none past what was taken: not dropped."""
    chunks = [_chunk(0, [7], 1), _chunk(1, [8], 2), _chunk(0, [], 0, "error")]
    chunks[-1].failure = Internal("boom").to_reply()
    with pytest.raises(Internal, match="boom"):
        await _read(chunks)


async def test_a_retryable_failure_ends_the_attempt_for_a_move_elsewhere():
    """A TE giving the request back (draining): the attempt ends without a finish reason, so
    the generation resubmits it with the tokens it has."""
    chunks = [_chunk(0, [7], 1), _chunk(1, [], 1, "error")]
    chunks[-1].failure = InstanceLost("te stopping", retry_after_s=0).to_reply()
    got, gen = await _read(chunks)
    assert got == [7] and gen.finish_reason is None and gen.generated == [7]


async def test_chunks_waiting_for_a_reader_that_is_behind_coalesce():
    """What waits for a slow client is one list of token ids, not a message per token; a
    chunk that does not continue the one waiting (a restarted copy, a failure) stays apart."""
    inbox = Inbox()
    for i in range(100):
        inbox.put_nowait(_chunk(i, [i], i + 1))
    inbox.put_nowait(_chunk(0, [0], 1))  # a copy restarted from its first token
    failed = _chunk(1, [], 1, "error")
    failed.failure = Internal("boom").to_reply()
    inbox.put_nowait(failed)
    assert len(inbox) == 3
    _, first = await inbox.get()
    assert isinstance(first, TokenChunk)
    assert first.token_ids == list(range(100)) and first.completion_tokens == 100
    assert first.seq == 99
    _, restarted = await inbox.get()
    assert isinstance(restarted, TokenChunk) and restarted.token_ids == [0]
    assert (await inbox.get())[1] is failed


async def test_a_finishing_chunk_coalesces_and_ends_the_stream():
    got, gen = await _read([_chunk(0, [7], 1), _chunk(1, [8], 2), _chunk(2, [9], 3, "length")])
    assert got == [7, 8, 9] and gen.finish_reason == "length"


async def test_every_attempt_on_a_lost_member_hears_it_at_once():
    liveness = Liveness(grace_s=30)
    on_a = [Attempt(f"r{i}", 0, "inbox", liveness) for i in range(8)]
    on_b = Attempt("s", 0, "inbox", liveness)
    for a in on_a:
        a.depend_on("te-a")
    on_b.depend_on("te-b")
    assert liveness.watched == 9
    liveness.on_member_down(MemberDown(member_id="te-a", reason="no heartbeat"))
    assert all(a.lost.is_set() for a in on_a) and not on_b.lost.is_set()
    assert liveness.watched == 1


async def test_a_member_missing_from_the_view_is_lost_after_the_grace_only():
    """A cluster manager that just restarted pushes a view without members it has not heard
    from yet: within the grace that is no death."""
    liveness = Liveness(grace_s=0.2)
    a = Attempt("r", 0, "inbox", liveness)
    a.depend_on("te-a")
    te = TEHeartbeat(te_id="te-a", pool_id="p", host="h", pid=1, state=TEState.READY, started_at=0)
    liveness.on_view(ClusterView(cluster="c", version=1, generated_at=0.0))
    await asyncio.sleep(0.1)
    liveness.on_view(ClusterView(cluster="c", version=2, generated_at=0.0, tes=[te]))
    await asyncio.sleep(0.2)
    assert not a.lost.is_set()
    liveness.on_view(ClusterView(cluster="c", version=3, generated_at=0.0))
    await asyncio.wait_for(a.lost.wait(), 1)


# -- a job executor lost while it places the job ---------------------------------------------


@dataclasses.dataclass
class _Msg:
    data: bytes
    subject: str = "inbox"


class _Jobs:
    """A JE per attempt: ``answer(job)`` says what that JE sends to the job's token stream
    and its answer, or None for a JE that dies before it answers."""

    def __init__(self, answer: Callable[[ChatJob], tuple[list[Message], JobAccepted | None]]):
        self.answer, self.jobs = answer, []  # type: list[ChatJob]
        self.router: StreamRouter | None = None
        self.unanswered = asyncio.Event()  # a JE is placing a job and will never answer

    async def submit(self, job: ChatJob, *, timeout: float) -> JobAccepted:
        self.jobs.append(job)
        sent, accepted = self.answer(job)
        for m in sent:
            await self.deliver(m)
        if accepted is None:
            self.unanswered.set()
            await asyncio.Event().wait()
        assert accepted is not None
        return accepted

    async def deliver(self, m: Message) -> None:
        assert self.router is not None
        await self.router.on_msg(_Msg(encode(m)))  # type: ignore[arg-type]

    def deliver_later(self, delay: float, m: Message) -> None:
        asyncio.get_running_loop().call_later(delay, lambda: asyncio.ensure_future(self.deliver(m)))


class _TEs:
    def __init__(self) -> None:
        self.cancelled: list[tuple[str, str, int]] = []

    async def cancel(self, te_id: str, request_id: str, attempt: int) -> None:
        self.cancelled.append((te_id, request_id, attempt))


def _generation(
    jobs: _Jobs, liveness: Liveness, settings: Settings | None = None
) -> tuple[Generation, _TEs]:
    router = StreamRouter("fe", Subjects("c"), liveness)
    jobs.router = router
    tes = _TEs()
    gen = Generation(
        request_id="r",
        model="m",
        prompt_token_ids=[1, 2],
        sampling=SamplingParams(max_tokens=2),
        settings=settings or Settings(),
        router=router,
        jobs=jobs,  # type: ignore[arg-type]
        tes=tes,  # type: ignore[arg-type]
    )
    return gen, tes


async def _tokens(gen: Generation) -> list[int]:
    """Every token the generation streams (chunks a reader is behind on coalesce: flat)."""
    return [t async for ids in gen.tokens() for t in ids]


def _te_chunk(te_id: str, attempt: int, seq: int, ids: list[int], done: int) -> TokenChunk:
    return TokenChunk(
        request_id="r",
        seq=seq,
        token_ids=ids,
        completion_tokens=done,
        finish_reason="length" if done == 2 else None,
        te_id=te_id,
        attempt=attempt,
    )


async def test_a_job_executor_lost_while_placing_the_job_is_left_at_once():
    """je-1 says it took the job (JobTaken), starts it on te-x, and dies before it answers:
    the frontend hears je-1 is gone and resubmits at once (not after its request to je-1
    times out), and stops te-x, which nobody will read."""
    liveness = Liveness(grace_s=30)

    def answer(job: ChatJob) -> tuple[list[Message], JobAccepted | None]:
        je = f"je-{job.attempt + 1}"
        taken = JobTaken(request_id="r", je_id=je, attempt=job.attempt)
        if job.attempt == 0:  # je-1 starts it on te-x and dies before it answers
            return [taken, _te_chunk("te-x", 0, 0, [7], 1)], None
        chunks = [_te_chunk("te-y", 1, 0, [7], 1), _te_chunk("te-y", 1, 1, [8], 2)]
        return [taken, *chunks], JobAccepted(request_id="r", te_id="te-y", je_id=je, attempt=1)

    jobs = _Jobs(answer)
    gen, tes = _generation(jobs, liveness)
    out: list[int] = []

    async def read() -> None:
        async for ids in gen.tokens():
            out.extend(ids)

    reading = asyncio.create_task(read())
    await jobs.unanswered.wait()
    assert liveness.watched == 1  # on je-1, from its JobTaken on
    liveness.on_member_down(MemberDown(member_id="je-1", reason="no heartbeat"))
    await asyncio.wait_for(reading, 1)
    assert out == [7, 8] and gen.finish_reason == "length"
    assert [j.attempt for j in jobs.jobs] == [0, 1]
    assert tes.cancelled == [("te-x", "r", 0)]
    assert liveness.watched == 0


async def test_a_job_executor_lost_after_its_answer_does_not_move_the_stream():
    """je-1 answered, then was declared gone before the frontend took the answer in: the
    attempt depends on the TE the answer names, not on je-1, and streams on; a JobTaken
    read after the answer does not bind it to je-1 again."""
    liveness = Liveness(grace_s=30)
    loop = asyncio.get_running_loop()

    def answer(job: ChatJob) -> tuple[list[Message], JobAccepted | None]:
        loop.call_soon(liveness.lost, "je-1", "no heartbeat")  # before tokens() resumes
        jobs.deliver_later(0.01, JobTaken(request_id="r", je_id="je-1", attempt=0))
        jobs.deliver_later(0.02, _te_chunk("te-y", 0, 0, [7], 1))
        jobs.deliver_later(0.03, _te_chunk("te-y", 0, 1, [8], 2))
        taken = JobTaken(request_id="r", je_id="je-1", attempt=0)
        return [taken], JobAccepted(request_id="r", te_id="te-y", je_id="je-1", attempt=0)

    jobs = _Jobs(answer)
    gen, tes = _generation(jobs, liveness)

    out = await asyncio.wait_for(_tokens(gen), 2)
    assert out == [7, 8]
    assert [j.attempt for j in jobs.jobs] == [0] and tes.cancelled == []


def _accepted_on_te_y(job: ChatJob) -> tuple[list[Message], JobAccepted | None]:
    taken = JobTaken(request_id="r", je_id="je-2", attempt=job.attempt)
    chunks = [_te_chunk("te-y", job.attempt, 0, [7], 1), _te_chunk("te-y", job.attempt, 1, [8], 2)]
    return [taken, *chunks], JobAccepted(
        request_id="r", te_id="te-y", je_id="je-2", attempt=job.attempt
    )


async def test_an_offer_no_job_executor_says_it_took_moves_on_after_a_liveness_deadline():
    """The JE that received the job was killed before its JobTaken left it: nobody will
    ever answer, and no member the frontend follows is lost. Within a liveness deadline of
    the offer the job is offered again, not after the request's timeout."""

    def answer(job: ChatJob) -> tuple[list[Message], JobAccepted | None]:
        if job.attempt == 0:
            return [], None  # received by a JE that is already dying
        return _accepted_on_te_y(job)

    jobs = _Jobs(answer)
    settings = Settings(liveness_timeout=timedelta(seconds=0.2))
    gen, _ = _generation(jobs, Liveness(grace_s=30), settings)

    t0 = time.monotonic()
    assert await asyncio.wait_for(_tokens(gen), 2) == [7, 8]
    assert 0.2 <= time.monotonic() - t0 < 1
    assert [j.attempt for j in jobs.jobs] == [0, 1]


async def test_offers_nobody_serves_do_not_use_up_attempts():
    """While no JE serves the subject (the only one restarting) the same attempt is
    offered again, for longer than a liveness deadline: each offer nobody received has no
    JobTaken to wait for."""
    offers = 0

    def answer(job: ChatJob) -> tuple[list[Message], JobAccepted | None]:
        nonlocal offers
        offers += 1
        if offers <= 4:  # 4 x NO_JE_RETRY_S: past the liveness deadline below
            raise NoResponder("nobody serves the subject")
        return _accepted_on_te_y(job)

    jobs = _Jobs(answer)
    settings = Settings(liveness_timeout=timedelta(seconds=0.3))
    gen, _ = _generation(jobs, Liveness(grace_s=30), settings)

    assert await asyncio.wait_for(_tokens(gen), 3) == [7, 8]
    assert [j.attempt for j in jobs.jobs] == [0] * 5
