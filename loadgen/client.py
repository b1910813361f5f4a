"""One streamed chat request, timed: send time, TTFT, every inter-token gap, E2E."""

from __future__ import annotations

import dataclasses
import json
import time

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

    @property
    def tpot_s(self) -> float | None:
        if self.e2e_s is None or self.ttft_s is None or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)


async def stream_chat(
    session: aiohttp.ClientSession, url: str, body: dict, *, api_key: str = "unused"
) -> Record:
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    rec = Record(sent_at=time.time())
    t0 = last = time.perf_counter()
    try:
        async with session.post(
            f"{url}/chat/completions", json=body, headers={"Authorization": f"Bearer {api_key}"}
        ) as resp:
            rec.status = resp.status
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
                if event.get("usage"):
                    rec.prompt_tokens = event["usage"]["prompt_tokens"]
                    rec.completion_tokens = event["usage"]["completion_tokens"]
                if any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                    if rec.ttft_s is None:
                        rec.ttft_s = now - t0
                    else:
                        rec.gaps_s.append(now - last)
                    last = now
        rec.e2e_s = time.perf_counter() - t0
    except (aiohttp.ClientError, TimeoutError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    return rec
