"""Closed-loop load: a fixed number of requests in flight, one prompt (``run``).

Good for a quick smoke test and for peak throughput; for latency under realistic traffic
use ``replay``, which is open-loop."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import aiohttp

from loadgen.client import Record, stream_chat
from loadgen.stats import summary


async def run_closed_loop(args: argparse.Namespace) -> list[Record]:
    body = {
        "model": args.model,
        "messages": [{"role": "user", "content": args.prompt}],
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "ignore_eos": args.ignore_eos,
    }
    records: list[Record] = []
    todo = iter(range(args.requests))
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        try:
            async with session.get(f"{args.url}/models") as r:
                r.raise_for_status()
        except (aiohttp.ClientError, OSError) as e:
            raise SystemExit(f"meshserve-loadgen: cannot reach {args.url}: {e}") from e

        async def worker() -> None:
            for _ in todo:
                records.append(await stream_chat(session, args.url, body))

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return records


def report(records: list[Record], wall_s: float) -> dict[str, Any]:
    ok = [r for r in records if r.error is None]
    ms = lambda xs: {k: round(v * 1000, 2) for k, v in summary(xs).items()}  # noqa: E731
    out_tokens = sum(r.completion_tokens for r in ok)
    return {
        "requests": len(records),
        "failed": len(records) - len(ok),
        "ttft_ms": ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": ms([t for r in ok if (t := r.tpot_s) is not None]),
        "e2e_ms": ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        "throughput_tok_s": round(out_tokens / wall_s, 2) if wall_s > 0 else 0.0,
        "wall_s": round(wall_s, 3),
        "errors": sorted({r.error for r in records if r.error})[:5],
    }
