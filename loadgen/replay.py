"""Open-loop replay: every request goes out at its planned time, whether or not earlier ones
have finished, as real users' traffic does. A closed loop (a fixed number in flight) would
slow its own arrivals down exactly when the server is slow and hide the queueing that
users see.

Each request streams; ``client`` times the first token, every gap after it and the end.
How late the sender itself was against the schedule is recorded per request
(``sent_s - scheduled_s``), so an overloaded load generator shows up in the results instead
of silently bending the arrival process."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Mapping, Sequence

import aiohttp

from loadgen.client import Record, stream_chat, stream_completion
from loadgen.plan import Planned
from loadgen.progress import Progress
from loadgen.prompts import TokenPool, make_prompt
from loadgen.results import Result


class EndpointError(RuntimeError):
    """The endpoint cannot be used: unreachable, not OpenAI-compatible, or lacks a model."""


@dataclasses.dataclass(frozen=True)
class SendOptions:
    url: str
    api: str = "completions"  # or "chat"
    prompt_format: str = "text"  # or "ids" (completions only)
    ignore_eos: bool = True
    temperature: float = 0.0
    api_key: str = "unused"
    seed: int = 0
    timeout_s: float = 600.0


async def list_models(
    url: str, *, api_key: str = "unused", timeout_s: float = 10.0
) -> dict[str, int | None]:
    """``GET {url}/models``: served model ids and, where the server says (meshserve and vLLM
    do, as ``max_model_len``), their context length."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as s,
            s.get(f"{url}/models", headers={"Authorization": f"Bearer {api_key}"}) as r,
        ):
            if r.status != 200:
                raise EndpointError(
                    f"GET {url}/models answered HTTP {r.status}: {(await r.text())[:200]}"
                )
            body = await r.json(content_type=None)
    except (aiohttp.ClientError, OSError, TimeoutError) as e:
        raise EndpointError(f"cannot reach {url}: {type(e).__name__}: {e}") from e
    except ValueError as e:
        raise EndpointError(f"GET {url}/models did not return JSON: {e}") from e
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise EndpointError(f"GET {url}/models is not an OpenAI model list")
    out: dict[str, int | None] = {}
    for m in data:
        if isinstance(m, dict) and "id" in m:
            ctx = m.get("max_model_len") or m.get("context_length") or m.get("max_context")
            out[str(m["id"])] = int(ctx) if isinstance(ctx, int | float) else None
    return out


def request_body(p: Planned, pool: TokenPool, opts: SendOptions) -> tuple[dict, int | None]:
    """The JSON body for ``p`` and the prompt length the server should count."""
    prompt = make_prompt(
        pool,
        opts.api,
        opts.prompt_format,
        p.input_tokens,
        p.hash_ids,
        p.block_size,
        p.key,
        opts.seed,
    )
    body = {
        "model": p.model,
        **prompt.body,
        "max_tokens": p.output_tokens,
        "temperature": opts.temperature,
    }
    if opts.ignore_eos:
        body["ignore_eos"] = True
    return body, prompt.tokens


def _result(p: Planned, sent_s: float, expected: int | None, rec: Record) -> Result:
    completion = rec.completion_tokens
    gaps = rec.gaps_s
    if not completion and rec.ttft_s is not None:
        completion = len(gaps) + 1  # no usage from the server: count the chunks
    elif 0 < completion < len(gaps) + 1:
        # The client times every chunk with a choice; a server that ends with an empty
        # chunk carrying only finish_reason (meshserve, vLLM) gives one more than there
        # were tokens, and that last "gap" is no inter-token gap.
        gaps = gaps[: completion - 1]
    return Result(
        index=p.index,
        model=p.model,
        scheduled_s=p.arrival_s,
        sent_s=sent_s,
        input_tokens=expected if expected is not None else p.input_tokens,
        output_tokens=p.output_tokens,
        trace_input_tokens=p.trace_input_tokens,
        trace_output_tokens=p.trace_output_tokens,
        clipped_prompt=p.clipped_prompt,
        clipped_output=p.clipped_output,
        prompt_tokens=rec.prompt_tokens,
        completion_tokens=completion,
        cached_tokens=rec.cached_tokens,
        disaggregated=rec.disaggregated,
        ttft_s=rec.ttft_s,
        e2e_s=rec.e2e_s if rec.error is None else None,
        gaps_s=gaps,
        status=rec.status,
        error=rec.error,
        trace_model=p.trace_model,
        session_id=p.session_id,
    )


async def replay(
    planned: Sequence[Planned],
    pools: Mapping[str, TokenPool],
    opts: SendOptions,
    progress: Progress | None = None,
) -> list[Result]:
    """Send every planned request at ``start + arrival_s``; the results in plan order."""
    progress = progress or Progress(len(planned), enabled=False)
    send = stream_chat if opts.api == "chat" else stream_completion
    timeout = aiohttp.ClientTimeout(total=opts.timeout_s)
    connector = aiohttp.TCPConnector(limit=0)  # open loop: never queue in the client
    results: list[Result | None] = [None] * len(planned)

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start = time.perf_counter()

        async def one(i: int, p: Planned, body: dict, expected: int | None) -> None:
            sent_s = time.perf_counter() - start
            try:
                rec = await send(session, opts.url, body, api_key=opts.api_key)
            except Exception as e:  # a malformed stream must cost one request, not the run
                rec = Record(sent_at=time.time(), error=f"{type(e).__name__}: {e}")
            results[i] = r = _result(p, sent_s, expected, rec)
            progress.update(done=1, failed=0 if r.ok else 1)

        tasks = []
        for i, p in enumerate(planned):
            # Always yield, even when late: the tasks already created start sending now,
            # not after the whole burst is built.
            await asyncio.sleep(max(0.0, start + p.arrival_s - time.perf_counter()))
            body, expected = request_body(p, pools[p.model], opts)
            tasks.append(asyncio.create_task(one(i, p, body, expected)))
            progress.update(sent=1)
        await asyncio.gather(*tasks)
    progress.close()
    return [r for r in results if r is not None]
