"""How a generation reads one attempt's token stream (no bus: chunks go straight to its queue)."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.frontend.generation import Generation
from shared.errors import Internal
from shared.messages.api import SamplingParams
from shared.messages.tasks import TokenChunk
from shared.settings import Settings


def _chunk(seq: int, ids: list[int], done: int, finish: str | None = None) -> TokenChunk:
    return TokenChunk(
        request_id="r-0",
        seq=seq,
        token_ids=ids,
        completion_tokens=done,
        finish_reason=finish,
        te_id="te-1",
    )


async def _read(chunks: list[TokenChunk]) -> tuple[list[list[int]], Generation]:
    gen = Generation(
        request_id="r",
        model="m",
        prompt_token_ids=[1, 2],
        sampling=SamplingParams(max_tokens=4),
        settings=Settings(),
        router=None,
        jobs=None,
        tes=None,
        view=None,  # type: ignore[arg-type]
    )
    queue: asyncio.Queue[TokenChunk] = asyncio.Queue()
    for c in chunks:
        queue.put_nowait(c)
    got = [ids async for ids in gen._receive(queue, "te-1", time.time() + 10)]
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
    assert got == [[7], [8], [9], [10]]
    assert gen.generated == [7, 8, 9, 10] and gen.finish_reason == "length"


async def test_a_chunk_overlapping_what_was_taken_gives_only_its_new_tokens():
    got, gen = await _read(
        [_chunk(0, [7, 8], 2), _chunk(0, [7, 8, 9], 3), _chunk(1, [10], 4, "stop")]
    )
    assert got == [[7, 8], [9], [10]] and gen.finish_reason == "stop"


async def test_a_restarted_copy_that_fails_still_ends_the_attempt():
    """An error chunk carries no tokens and counts none past what was taken: not dropped."""
    chunks = [_chunk(0, [7], 1), _chunk(1, [8], 2), _chunk(0, [], 0, "error")]
    chunks[-1].error = "boom"
    with pytest.raises(Internal, match="boom"):
        await _read(chunks)
