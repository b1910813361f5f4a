"""Answering one request from its generation: the text deltas (cut at the first stop string
or where the tenant's token budget runs out), sent as one JSON completion or as an SSE
stream, and the request accounted for as it ends, however it ends."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from typing import Any

from aiohttp import web
from prometheus_client import Counter

from services.frontend import responses as R
from services.frontend.accounting import account, phases
from services.frontend.generation import Generation
from services.frontend.middleware import ARRIVED
from services.frontend.openai_types import ChatCompletionRequest, CompletionRequest
from services.frontend.outcomes import Outcomes
from services.frontend.rate_limits import Lease
from services.frontend.recent import Recent
from services.frontend.stop import StopMatcher
from services.frontend.streaming import STREAM_DELAY, StallGuard
from shared.errors import MeshserveError, Unavailable
from shared.logging import get_logger
from shared.runner import Lifecycle

log = get_logger(__name__)

CLIENT_GONE = Counter("meshserve_client_disconnects", "Clients that hung up before the end")


def finish_reason(gen: Generation, stops: StopMatcher, lease: Lease) -> str:
    """The finish reason the client sees. The OpenAI schema knows only these two for a
    completed generation; a tenant's token budget running out is a length limit."""
    if stops.stopped:
        return "stop"
    if lease.exhausted or gen.finish_reason == "length":
        return "length"
    return "stop"


async def texts(
    gen: Generation, detok: Any, stops: StopMatcher, lease: Lease
) -> AsyncGenerator[str, None]:
    """Text deltas of the generation, up to (not including) the first stop string, or
    until the tenant's token budget runs out."""
    async for ids in gen.tokens():
        within = await lease.charge(len(ids))
        text, hit = stops.push(detok.push(ids))
        if text:
            yield text
        if hit or not within:
            return
    text, _ = stops.push(detok.flush())
    if text:
        yield text
    if not stops.stopped and (tail := stops.flush()):
        yield tail


class Answerer:
    """One per frontend: ``stalls`` cuts a stream whose client reads nothing, ``life`` says
    whether the frontend is stopping, ``outcomes`` gathers what the scaler is told,
    ``recent`` what an operator's status shows."""

    def __init__(
        self, *, stalls: StallGuard, life: Lifecycle, outcomes: Outcomes, recent: Recent
    ) -> None:
        self._stalls = stalls
        self._life = life
        self._outcomes = outcomes
        self._recent = recent

    async def answer(
        self,
        request: web.Request,
        req: ChatCompletionRequest | CompletionRequest,
        gen: Generation,
        tok: Any,
        lease: Lease,
        *,
        chat: bool,
    ) -> web.StreamResponse:
        """Run ``gen`` (not started yet) and answer ``request`` with it; ``tok``: the
        model's tokenizer."""
        rid, prompt = gen.request_id, gen.prompt_token_ids
        created = int(time.time())
        t0 = time.monotonic()
        detok = tok.detokenizer(prompt)
        stops = StopMatcher(req.stop_strings)
        pieces = texts(gen, detok, stops, lease)
        try:
            if req.is_stream:
                return await self._stream(
                    request, req, gen, pieces, stops, lease, rid, created, t0, chat=chat
                )
            text = "".join([p async for p in pieces])
            phases(request[ARRIVED], t0, gen)
        finally:
            await pieces.aclose()
            await gen.cancel()
            account(self._outcomes, self._recent, req.model, gen, len(prompt), t0)
            log.debug(
                "request finished",
                completion_tokens=len(gen.generated),
                finish_reason=gen.finish_reason,
                seconds=round(time.monotonic() - t0, 3),
            )
        usage = R.usage(len(prompt), len(gen.generated), gen.cached_tokens)
        build = R.chat_completion if chat else R.completion
        return web.Response(
            body=R.json_body(
                build(rid, req.model, created, text, finish_reason(gen, stops, lease), usage)
            ),
            content_type="application/json",
            headers={**lease.headers, **pd_headers(gen)},
        )

    async def _stream(
        self,
        request: web.Request,
        req: Any,
        gen: Generation,
        pieces: Any,
        stops: StopMatcher,
        lease: Lease,
        rid: str,
        created: int,
        started: float,
        *,
        chat: bool,
    ) -> web.StreamResponse:
        # Place the job before committing to a 200: a job that cannot be placed must get
        # its 404/503 as a proper status, not as an event inside a stream.
        first: str | None = None
        done = False
        try:
            first = await anext(pieces)
        except StopAsyncIteration:
            done = True
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
                **lease.headers,
                **pd_headers(gen),
            }
        )
        await resp.prepare(request)

        def chunk(text: str | None, finish: str | None = None) -> bytes:
            if chat:
                delta = {} if text is None else {"content": text}
                return R.sse(
                    R.chat_chunk(rid, req.model, created, delta=delta, finish_reason=finish)
                )
            return R.sse(
                R.completion_chunk(rid, req.model, created, text=text or "", finish_reason=finish)
            )

        # A client that reads nothing for stall_timeout is cut (streaming.StallGuard).
        with self._stalls.open(resp, request, rid) as out:
            try:
                if chat:
                    await out.write(
                        R.sse(
                            R.chat_chunk(
                                rid, req.model, created, delta={"role": "assistant", "content": ""}
                            )
                        )
                    )
                if first:
                    await out.write(chunk(first))
                    phases(request[ARRIVED], started, gen)
                if not done:
                    async for text in pieces:
                        if gen.arrived_at is not None:
                            STREAM_DELAY.observe(time.monotonic() - gen.arrived_at)
                        await out.write(chunk(text))
                await out.write(chunk(None, finish_reason(gen, stops, lease)))
                if req.include_usage:
                    usage = R.usage(
                        len(gen.prompt_token_ids), len(gen.generated), gen.cached_tokens
                    )
                    await out.write(R.sse(R.usage_chunk(rid, req.model, created, usage, chat=chat)))
                await out.write(R.SSE_DONE)
            except MeshserveError as e:
                with contextlib.suppress(ConnectionError):
                    await out.write(R.sse(R.error_body(e)))
                    await out.write(R.SSE_DONE)
            except ConnectionError:
                # The client hung up mid-stream: nothing to answer; ``answer`` cancels the
                # generation.
                log.info("client went away", request_id=rid)
                CLIENT_GONE.inc()
            except asyncio.CancelledError:
                if self._life.stopping:
                    # The frontend stops and its grace is over: the stream ends with an error
                    # event the client can act on, not with a connection cut mid-event.
                    gone = Unavailable(
                        "The server is shutting down; retry the request.", retry_after_s=1
                    )
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(
                            resp.write(R.sse(R.error_body(gone)) + R.SSE_DONE), 1.0
                        )
                raise
        return resp


PD_HEADER = "X-Meshserve-Pd"  # placed: "disaggregated" or "colocated", then why


def pd_headers(gen: Generation) -> dict[str, str]:
    """How the request was placed, for clients that split their numbers by it (the load
    generator): ``disaggregated; long uncached prompt``, ``colocated; short uncached
    prompt``. None for a request placed by a JE that decided nothing (no prefill instance
    anywhere)."""
    routed = gen.routed
    if routed is None or not routed.pd:
        return {}
    how = "disaggregated" if routed.prefill_te_id else "colocated"
    return {PD_HEADER: f"{how}; {routed.pd}"}
