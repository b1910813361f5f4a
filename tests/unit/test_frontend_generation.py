"""How a generation reads one attempt's token stream (no bus: chunks go straight to its queue)."""

from __future__ import annotations

import asyncio

import pytest

from services.frontend.generation import Attempt, Generation, Inbox
from services.frontend.liveness import Liveness
from shared.errors import InstanceLost, Internal
from shared.messages.api import SamplingParams
from shared.messages.cluster import ClusterView, MemberDown, TEHeartbeat, TEState
from shared.messages.tasks import TokenChunk
from shared.settings import Settings


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
