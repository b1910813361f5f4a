"""One streamed request, timed: send time, TTFT, every inter-token gap, E2E.

``stream_chat`` drives ``/chat/completions`` and times the first and every later chunk that
carries content. ``stream_completion`` drives ``/completions`` (a string or token-id prompt)
and times every chunk with a choice, text or not: a server may send a chunk per token whose
text is held back (an incomplete UTF-8 sequence, a skipped special token), and the chunk
with ``finish_reason`` marks the end of generation, so the gaps span first to last token
even when the text arrives unevenly."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable

import aiohttp


@dataclasses.dataclass
class Record:
    sent_at: float
    ttft_s: float | None = None
    e2e_s: float | None = None
    gaps_s: list[float] = dataclasses.field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    status: int = 0
    error: str | None = None
    cached_tokens: int = 0
    # How the server placed it (meshserve's X-Meshserve-Pd): True disaggregated, False
    # colocated, None not said.
    disaggregated: bool | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.e2e_s is None or self.ttft_s is None or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens after the first ÷ time from the first token chunk to the last one."""
        span = sum(self.gaps_s)
        if self.completion_tokens < 2 or span <= 0:
            return None
        return (self.completion_tokens - 1) / span


def _chat_token(choice: dict) -> bool:
    return bool(choice.get("delta", {}).get("content"))


def _completion_token(choice: dict) -> bool:
    # A chunk with text, or one without text that is not the closing chunk (a token whose
    # text the detokenizer holds back); not an empty closing chunk that only carries
    # finish_reason (meshserve sends one), which would count a gap too many.
    return bool(choice.get("text")) or choice.get("finish_reason") is None


async def _stream(
    session: aiohttp.ClientSession,
    url: str,
    body: dict,
    is_token: Callable[[dict], bool],
    api_key: str,
) -> Record:
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    rec = Record(sent_at=time.time())
    t0 = last = time.perf_counter()
    try:
        async with session.post(
            url, json=body, headers={"Authorization": f"Bearer {api_key}"}
        ) as resp:
            rec.status = resp.status
            if pd := resp.headers.get("X-Meshserve-Pd"):
                rec.disaggregated = pd.startswith("disaggregated")
            if resp.status != 200:
                rec.error = (await resp.text())[:500]
                return rec
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    rec.error = event["error"].get("message", "error")
                    return rec
                now = time.perf_counter()
                if usage := event.get("usage"):
                    rec.prompt_tokens = usage["prompt_tokens"]
                    rec.completion_tokens = usage["completion_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    rec.cached_tokens = details.get("cached_tokens") or 0
                if any(is_token(c) for c in event.get("choices") or []):
                    if rec.ttft_s is None:
                        rec.ttft_s = now - t0
                    else:
                        rec.gaps_s.append(now - last)
                    last = now
        rec.e2e_s = time.perf_counter() - t0
    except (aiohttp.ClientError, TimeoutError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    return rec


async def stream_chat(
    session: aiohttp.ClientSession, url: str, body: dict, *, api_key: str = "unused"
) -> Record:
    return await _stream(session, f"{url}/chat/completions", body, _chat_token, api_key)


async def stream_completion(
    session: aiohttp.ClientSession, url: str, body: dict, *, api_key: str = "unused"
) -> Record:
    """``body["prompt"]`` may be a string or a list of token ids."""
    return await _stream(session, f"{url}/completions", body, _completion_token, api_key)
