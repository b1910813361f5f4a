"""TTFT of a disaggregated request against a colocated one on an idle cluster: the cost of
PD's extra hop (a prefill task, the KV streamed to the decode TE while the prompt computes,
the import) where nothing else runs. A real cluster (``meshserve up``, the Qwen2-0.5B-shaped
bench model): first with one colocated instance only, then with a prefill instance loaded
beside it (``LoadModel(role=prefill)``), the same number of fresh prompts of each length
(distinct, so nothing is cached), streamed through ``/v1/completions`` with token-id
prompts, ``MESHSERVE_PD=always``. Prints a table, writes bench-results/pd-ttft.json.

    python -m bench.pd_ttft [--tokens 1024,4096] [--requests 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.cluster import LocalCluster, instances
from bench.common import ROOT, ensure_model, host_info, models_dir, numbers, write_result
from loadgen.client import stream_completion
from shared.bus import Bus
from shared.clients import TaskExecutorClient
from shared.embedded import EmbeddedServer
from shared.messages.scaling import LoadModel
from shared.messages.tasks import TaskMode
from shared.settings import Settings
from shared.subjects import Subjects

MODEL = "bench-qwen2-0.5b"


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 3900 + 100 for i in range(n)]


async def _ttfts(
    url: str, lengths: list[int], requests: int, seed: int, *, disaggregated: bool
) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    async with aiohttp.ClientSession() as http:
        for n in lengths:
            for r in range(requests):
                body = {
                    "model": MODEL,
                    "prompt": _prompt(n, seed + 1000 * n + r),
                    "max_tokens": 4,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                rec = await stream_completion(http, url, body)
                if rec.error or rec.ttft_s is None:
                    raise RuntimeError(f"request failed: {rec.status} {rec.error}")
                if bool(rec.disaggregated) != disaggregated:
                    raise RuntimeError(f"placed otherwise than meant: {rec.disaggregated}")
                out.setdefault(n, []).append(rec.ttft_s)
    return out


def _cluster(
    models: Path, settings: dict[str, str], log: Path, stack: contextlib.ExitStack
) -> LocalCluster:
    """The cluster, on the NATS and Redis the settings name, or on servers of its own
    (without credentials, unlike the ones ``meshserve up`` embeds: this bench talks to the
    TEs over NATS itself)."""
    s = Settings.load()
    nats_url, redis_url = s.nats_url, s.redis_url
    if not nats_url:
        nats_url = stack.enter_context(EmbeddedServer("nats")).url
    if not redis_url:
        redis_url = stack.enter_context(EmbeddedServer("redis")).url
    return LocalCluster(
        "pd-ttft",
        models,
        pool_size=2,
        settings=settings,
        log=log,
        nats_url=nats_url,
        redis_url=redis_url,
    )


async def _load_prefill(cluster: LocalCluster) -> str:
    bus = await Bus.connect(cluster.nats_url, name="bench-pd", cluster=cluster.cluster)
    try:
        idle = [t["id"] for t in cluster.health()["task_executors"] if t["state"] == "idle"]
        te_id = idle[0]
        client = TaskExecutorClient(bus, Subjects(cluster.cluster), timeout=30)
        path = str(cluster.models / MODEL)
        ack = await client.control(te_id, LoadModel(model=MODEL, path=path, role=TaskMode.PREFILL))
        if not ack.ok:
            raise RuntimeError(f"the prefill load was refused: {ack.error}")
        return te_id
    finally:
        await bus.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", default="1024,4096", help="prompt lengths")
    ap.add_argument("--requests", type=int, default=3, help="requests per length and mode")
    ap.add_argument("--out", type=Path, default=ROOT / "bench-results" / "pd-ttft.json")
    args = ap.parse_args(argv)
    lengths = numbers(args.tokens)
    models = models_dir()
    ensure_model(MODEL, models)
    work = ROOT / "bench-results"
    work.mkdir(exist_ok=True)
    settings = {
        "PD": "always",
        "MIN_REPLICAS": "1",
        "MAX_REPLICAS": "1",
        "KEEP_ALIVE": "3600",
        "ENGINE": "torch",
    }
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        c = stack.enter_context(_cluster(models, settings, work / "pd-ttft.log", stack))
        c.wait(lambda h: instances(h).get(MODEL, 0) >= 1)
        colocated = asyncio.run(_ttfts(c.url, lengths, args.requests, 1, disaggregated=False))
        te_id = asyncio.run(_load_prefill(c))
        c.wait(
            lambda h: any(
                t["id"] == te_id and t["state"] == "ready" and t["role"] == "prefill"
                for t in h["task_executors"]
            )
        )
        disaggregated = asyncio.run(_ttfts(c.url, lengths, args.requests, 2, disaggregated=True))
    print(f"{'tokens':>7} {'colocated TTFT ms':>18} {'disaggregated TTFT ms':>22} {'ratio':>6}")
    for n in lengths:
        a, b = statistics.median(colocated[n]), statistics.median(disaggregated[n])
        rows.append(
            {
                "tokens": n,
                "colocated_ttft_s": colocated[n],
                "disaggregated_ttft_s": disaggregated[n],
                "ratio_median": b / a,
            }
        )
        print(f"{n:>7} {a * 1000:>18.0f} {b * 1000:>22.0f} {b / a:>6.2f}")
    write_result(args.out, {"host": host_info(), "when": time.time(), "rows": rows})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
