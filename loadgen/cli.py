"""meshserve-loadgen: drive an OpenAI-compatible endpoint and report latencies.

  meshserve-loadgen run --url http://127.0.0.1:8080/v1 --model demo \
      --requests 32 --concurrency 4 --max-tokens 64 --out runs/smoke

Closed-loop load (a fixed number of requests in flight). Trace replay, synthetic
workloads and SLO reports arrive with issue 4."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path

import aiohttp

from loadgen.client import Record, stream_chat
from loadgen.stats import summary


async def run_closed_loop(args: argparse.Namespace) -> list[Record]:
    prompt = args.prompt
    body = {"model": args.model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": args.max_tokens, "temperature": args.temperature,
            "ignore_eos": args.ignore_eos}
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


def report(records: list[Record], wall_s: float) -> dict:
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="meshserve-loadgen", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="closed-loop load with one prompt")
    r.add_argument("--url", default="http://127.0.0.1:8080/v1")
    r.add_argument("--model", required=True)
    r.add_argument("--prompt", default="Tell me a story about a lighthouse keeper.")
    r.add_argument("--requests", type=int, default=16)
    r.add_argument("--concurrency", type=int, default=4)
    r.add_argument("--max-tokens", type=int, default=64)
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--ignore-eos", action="store_true")
    r.add_argument("--timeout", type=float, default=600)
    r.add_argument("--out", type=Path, help="directory for summary.json and requests.jsonl")
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    records = asyncio.run(run_closed_loop(args))
    result = report(records, time.perf_counter() - t0)
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "summary.json").write_text(json.dumps(result, indent=2))
        with open(args.out / "requests.jsonl", "w") as f:
            for rec in records:
                f.write(json.dumps(dataclasses.asdict(rec)) + "\n")
    sys.exit(1 if result["failed"] else 0)


if __name__ == "__main__":
    main()
