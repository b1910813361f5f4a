"""Concurrent SSE streams held by one frontend: 1k, 2k, 5k slow readers at once.

A local cluster (``meshserve up``: one frontend, one TE of a demo-shaped model with untrained
weights, its batch as large as the largest row so that every stream decodes at once) and, in
this process, N clients on raw sockets (HTTP/1.1 by hand: the client must cost the 2-core
host as little as it can) that each ask for ``--tokens`` tokens with ``ignore_eos`` and read
their stream slowly: an event, then ``--read-pause``. The TE's step time bounds the token
rate: with N streams decoding together each gets one token per step.

Per row: streams completed and errors by kind; tokens received per stream against what was
asked (``usage.completion_tokens``); the inter-token latency at the client (gaps between
content events, p50/p99); the part the frontend adds, from its
``meshserve_stream_delay_seconds`` (a token's arrival from the TE until its event is handed to
the client's connection; p50/p99 interpolated in the histogram's buckets); the frontend's RSS
before the streams open (idle), at its peak and after they closed, and (peak - idle) / N.

A stall row per N with ``--stalled`` of the clients stopping to read after their first
events, on sockets with a 4 KiB receive buffer and a stall-guard timeout of
``--stall-timeout``: the others' latencies should match the row without stalls; a stalled
stream either ends in the buffers between the frontend and its client (its answer fits in
them) or is cut by the guard (counted in ``meshserve_stalled_streams``).

    scripts/bench-concurrency [--streams 1000,2000,5000] [--tokens 64] [--stalled 0.1]

Needs NATS and Redis (``MESHSERVE_NATS_URL`` / ``MESHSERVE_REDIS_URL``; the wrapper uses
local ones where they answer). Writes bench-results/concurrency.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import resource
import socket
import tempfile
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench.cluster import LocalCluster
from bench.common import RESULTS, Col, Table, numbers, write_result

MODEL = "demo"
PROMPT = "Tell me a long story about a lighthouse."
DELAY = "meshserve_stream_delay_seconds"
STALLED = "meshserve_stalled_streams_total"


# --- the frontend, seen from outside --------------------------------------------------------


def frontend_pid(cluster: LocalCluster) -> int:
    """The frontend process among the cluster's children (``python -m services.frontend``)."""
    assert cluster.up is not None
    root = cluster.up.proc.pid
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            if ppid == root and b"services.frontend" in cmd:
                return int(d.name)
    raise RuntimeError("no frontend process under the cluster's launcher")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


def histogram(metrics: str, name: str) -> dict[float, float]:
    """Cumulative bucket counts of a histogram without labels: upper bound -> count."""
    out: dict[float, float] = {}
    for line in metrics.splitlines():
        if line.startswith(f"{name}_bucket{{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[math.inf if le == "+Inf" else float(le)] = float(line.rsplit(" ", 1)[1])
    return out


def gauge(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def bucket_quantile(before: Mapping[float, float], after: Mapping[float, float], q: float) -> float:
    """The q-quantile of what was observed between two scrapes, interpolated linearly within
    its bucket (as Prometheus' histogram_quantile does)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return math.nan
    rank, lower, below = q * total, 0.0, 0.0
    for bound, cum in zip(bounds, counts, strict=True):
        if cum >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / max(cum - below, 1e-12)
        lower, below = bound, cum
    return lower


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return math.nan
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# --- the clients ------------------------------------------------------------------------------


class Run:
    """What the clients of one row saw."""

    def __init__(self) -> None:
        self.open = 0
        self.peak_open = 0
        self.outcomes: Counter[str] = Counter()  # of the clients that kept reading
        self.stalled: Counter[str] = Counter()  # of those that stopped
        self.gaps: list[float] = []
        self.ttft: list[float] = []
        self.short: int = 0  # completed with fewer tokens than asked
        self.done = asyncio.Event()


async def one_stream(
    run: Run, host: str, port: int, body: bytes, tokens: int, pause: float, stall_after: int
) -> None:
    sock = socket.socket()
    if stall_after:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    t0 = time.monotonic()
    writer = None
    kind = "completed"
    got_tokens, events, last = None, 0, None
    try:
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
        # A small reader buffer: a client that stops reading stops the socket soon.
        reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 14)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json"
            b"\r\nContent-Length: %d\r\n\r\n%s" % (host.encode(), len(body), body)
        )
        status = await reader.readline()
        if b" 200 " not in status:
            kind = f"http {status.split(b' ')[1].decode() if b' ' in status else '?'}"
            return
        while await reader.readline() not in (b"\r\n", b""):
            pass
        run.open += 1
        run.peak_open = max(run.peak_open, run.open)
        try:
            finished = False
            while not finished:
                size = int(await reader.readline(), 16)
                if size == 0:
                    break
                data = await reader.readexactly(size + 2)
                now = time.monotonic()
                for event in data.split(b"\n\n"):
                    if not event.startswith(b"data: "):
                        continue
                    if event.startswith(b"data: [DONE]"):
                        finished = True
                    elif b'"usage"' in event and b'"completion_tokens"' in event:
                        got_tokens = json.loads(event[6:])["usage"]["completion_tokens"]
                    elif b'"error"' in event:
                        kind = "error event"
                    elif b'"content":"' in event and b'"content":""' not in event:
                        if last is None:
                            run.ttft.append(now - t0)
                        elif not stall_after:
                            run.gaps.append(now - last)
                        last = now
                        events += 1
                if stall_after and events >= stall_after:
                    stall_after = -1  # stop reading until every other client is done
                    await run.done.wait()
                elif pause:
                    await asyncio.sleep(pause)
            if not finished and kind == "completed":
                kind = "eof before [DONE]"
            elif got_tokens is not None and got_tokens != tokens:
                run.short += 1
        finally:
            run.open -= 1
    except (ConnectionError, asyncio.IncompleteReadError) as e:
        kind = "reset" if isinstance(e, ConnectionResetError) else type(e).__name__
    except (OSError, ValueError) as e:
        kind = type(e).__name__
    finally:
        (run.stalled if stall_after else run.outcomes)[kind] += 1
        if writer is not None:
            writer.close()
        else:
            sock.close()


async def hold(
    url: str,
    n: int,
    *,
    tokens: int,
    pause: float,
    stalled: float,
    ramp_s: float,
    seed: int,
    sample: Any,
) -> Run:
    host, port = url.removeprefix("http://").removesuffix("/v1").split(":")
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    rng = random.Random(seed)
    stall = set(rng.sample(range(n), round(n * stalled)))
    run = Run()
    readers: list[asyncio.Task[None]] = []
    stallers: list[asyncio.Task[None]] = []
    sampler = asyncio.create_task(sample(run))
    for i in range(n):
        task = asyncio.create_task(
            one_stream(run, host, int(port), body, tokens, pause, 3 if i in stall else 0)
        )
        (stallers if i in stall else readers).append(task)
        if ramp_s:
            await asyncio.sleep(ramp_s / n)
    await asyncio.gather(*readers)
    run.done.set()
    await asyncio.gather(*stallers)
    sampler.cancel()
    return run


# --- one row ----------------------------------------------------------------------------------


def measure(cluster: LocalCluster, pid: int, n: int, args: argparse.Namespace, stalled: float):
    idle = rss_mib(pid)
    before = cluster.metrics()
    peak = [idle]
    open_fe = [0.0]

    async def sample(run: Run) -> None:
        loop = asyncio.get_running_loop()
        while True:
            peak[0] = max(peak[0], rss_mib(pid))
            with contextlib.suppress(OSError):
                text = await loop.run_in_executor(None, cluster.metrics)
                open_fe[0] = max(open_fe[0], gauge(text, "meshserve_open_streams"))
            await asyncio.sleep(1.0)

    t0 = time.monotonic()
    run = asyncio.run(
        hold(
            cluster.url,
            n,
            tokens=args.tokens,
            pause=args.read_pause,
            stalled=stalled,
            ramp_s=args.ramp * n / 1000,
            seed=n,
            sample=sample,
        )
    )
    seconds = time.monotonic() - t0
    peak[0] = max(peak[0], rss_mib(pid))
    time.sleep(2)  # the frontend's cleanup of the last streams
    after = cluster.metrics()
    end = rss_mib(pid)
    h0, h1 = histogram(before, DELAY), histogram(after, DELAY)
    readers = n - sum(run.stalled.values())
    errors = {k: v for k, v in run.outcomes.items() if k != "completed"}
    return {
        "streams": n,
        "stalled_share": stalled,
        "readers": readers,
        "completed": run.outcomes["completed"],
        "errors": errors,
        "error_count": sum(errors.values()),
        "short_streams": run.short,
        "stalled_outcomes": dict(run.stalled),
        "cut_by_guard": gauge(after, STALLED) - gauge(before, STALLED),
        "peak_open_client": run.peak_open,
        "peak_open_frontend": open_fe[0],
        "seconds": seconds,
        "tokens_per_s": readers * args.tokens / seconds,
        "ttft_p50_s": pct(run.ttft, 0.5),
        "ttft_p99_s": pct(run.ttft, 0.99),
        "itl_p50_ms": 1000 * pct(run.gaps, 0.5),
        "itl_p99_ms": 1000 * pct(run.gaps, 0.99),
        "fe_delay_p50_ms": 1000 * bucket_quantile(h0, h1, 0.5),
        "fe_delay_p99_ms": 1000 * bucket_quantile(h0, h1, 0.99),
        "rss_idle_mib": idle,
        "rss_peak_mib": peak[0],
        "rss_end_mib": end,
        "kib_per_stream": 1024 * (peak[0] - idle) / n,
    }


COLS = [
    Col("streams", "streams"),
    Col(lambda r: f"{100 * r['stalled_share']:.0f}%", "stalled"),
    Col("completed", "done"),
    Col("error_count", "errors"),
    Col("short_streams", "short"),
    Col("cut_by_guard", "cut", ".0f"),
    Col("peak_open_client", "held"),
    Col("tokens_per_s", "tok/s", ".0f"),
    Col("ttft_p99_s", "ttft p99 s", ".1f"),
    Col("itl_p50_ms", "itl p50 ms", ".0f"),
    Col("itl_p99_ms", "itl p99 ms", ".0f"),
    Col("fe_delay_p50_ms", "fe p50 ms", ".1f"),
    Col("fe_delay_p99_ms", "fe p99 ms", ".1f"),
    Col("rss_idle_mib", "rss idle", ".0f"),
    Col("rss_peak_mib", "rss peak", ".0f"),
    Col("rss_end_mib", "rss end", ".0f"),
    Col("kib_per_stream", "KiB/stream", ".1f"),
]


def kv_cache_bytes(n: int, tokens: int) -> int:
    """Room for every stream's prompt and answer at once (the demo shape: 4 layers, 2 KV
    heads of 32, float32: 2 KiB per token), with slack for block rounding."""
    per_token = 2 * 4 * 2 * 32 * 4
    return max(256 << 20, int(1.5 * n * (tokens + 48) * per_token))


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--streams", type=numbers, default=[1000, 2000, 5000], help="N per row")
    p.add_argument(
        "--tokens",
        type=int,
        default=160,
        help="tokens asked per stream (long enough that "
        "the first streams still run when the last start)",
    )
    p.add_argument(
        "--read-pause", type=float, default=0.05, help="a reader's sleep after each event (s)"
    )
    p.add_argument(
        "--stalled", type=float, default=0.1, help="share of clients that stop reading (0: none)"
    )
    p.add_argument("--stall-timeout", type=float, default=5.0, help="frontend.stall_timeout")
    p.add_argument("--ramp", type=float, default=1.0, help="seconds to open each 1000 streams")
    p.add_argument("--out", type=Path, default=RESULTS / "concurrency.json")
    args = p.parse_args()

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    top = max(args.streams)
    rows: list[dict[str, Any]] = []
    table = Table(COLS)
    with tempfile.TemporaryDirectory(prefix="bench-concurrency-") as tmp:
        from devtools.modelgen import make_demo_model

        models = Path(tmp) / "models"
        make_demo_model(models / MODEL, train_steps=0)  # the demo's shape; the weights: moot
        settings = {
            "POOL_SIZE": "1",
            "MAX_NUM_SEQS": str(top),
            "KV_CACHE_BYTES": str(kv_cache_bytes(top, args.tokens)),
            "MAX_QUEUED_PER_SLOT": "0",
            "KEEP_ALIVE": "3600",
            "TORCH_THREADS": "1",
            # A fixed prefill budget: paced (the default) it shrinks to keep the TPOT of the
            # thousands already decoding under the SLO, and the last streams start minutes late.
            "MAX_PREFILL_TOKENS": "2048",
            "STALL_TIMEOUT": str(args.stall_timeout),
        }
        log = Path(tmp) / "cluster.log"
        for n in args.streams:
            # A fresh cluster per N: its frontend's idle RSS is the baseline of that N.
            with LocalCluster("concurrency", models, pool_size=1, settings=settings, log=log) as c:
                pid = frontend_pid(c)
                asyncio.run(hold(c.url, 1, tokens=4, pause=0, stalled=0, ramp_s=0, seed=0,
                                 sample=_idle))  # fmt: skip
                for stalled in (0.0, args.stalled) if args.stalled else (0.0,):
                    row = measure(c, pid, n, args, stalled)
                    rows.append(row)
                    table.row(row)
        log_tail = log.read_text()[-4000:]
    result = {
        "tokens": args.tokens,
        "read_pause_s": args.read_pause,
        "stall_timeout_s": args.stall_timeout,
        "open_files_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        "rows": rows,
        "cluster_log_tail": log_tail,
    }
    write_result(args.out, result)


async def _idle(run: Run) -> None:
    await asyncio.Event().wait()


if __name__ == "__main__":
    main()
