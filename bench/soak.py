"""Soak: sustained load on a local cluster for a bounded time, with faults on a schedule,
checking that nothing accepted is lost, no token is wrong and memory stays flat.

The cluster (`meshserve up` with the demo model, two TEs) runs on a NATS and a Redis of
the soak's own, so it can restart them. First each prompt's greedy output is taken
undisturbed (the references). Then requests arrive as a Poisson process at ``--rate`` for
``--duration`` seconds, half of them streamed, each a greedy completion of one of the
prompts, and the faults of ``--faults`` happen evenly spread over the run:

- ``te``: kill -9 the busiest TE (its node pool starts another);
- ``je``: kill -9 the job executor (the launcher restarts it);
- ``redis``: restart Redis without its data;
- ``nats``: restart NATS, down for a second.

Each request ends as one of: ``ok`` (output equal to its reference), ``wrong`` (a 200 with
other text: a wrong token), ``refused`` (an error status before any output: the client
was told, nothing was accepted) or ``lost`` (a stream that had started and then failed, or
a client timeout: an accepted request lost). Goal: 0 lost, 0 wrong, memory growth < 5 %
per service between the start of the load and its end.

    scripts/soak                         # 10 minutes at 2 requests/s, all four faults
    scripts/soak --duration 60 --rate 1  # what the test suite runs

Writes bench-results/soak.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import openai

from bench.cluster import LocalCluster
from bench.common import ROOT, Col, Table, ensure_model, models_dir, write_result
from devtools.procs import module_of, processes_of, rss_bytes
from shared.embedded import EmbeddedServer

PROMPTS = [
    "Tell me about the license of this program.",
    "What does the warranty cover?",
    "Who may copy and distribute the program?",
    "Explain the terms for modified versions.",
    "What happens if you violate the license?",
    "How do you apply these terms to new programs?",
    "What is free software?",
    "Can the license be changed?",
]
FAULTS = ("te", "je", "redis", "nats")
CALL_TIMEOUT_S = 120.0


def roles(cluster: str) -> dict[str, list[int]]:
    """Service name -> its live pids (the TEs under ``te``)."""
    out: dict[str, list[int]] = {}
    for pid in processes_of(cluster):
        module = module_of(pid) or ""
        if module.startswith("services."):
            name = module.removeprefix("services.")
            name = {"task_executor.worker": "te", "cli": "launcher"}.get(name, name)
            out.setdefault(name, []).append(pid)
    return out


def memory(cluster: LocalCluster) -> dict[str, dict[int, int]]:
    """Per service, resident bytes per pid. A TE is told apart by its pid and the model it
    holds (``pid:model``): one that loads a model grows by it, which is no leak."""
    models = {te["pid"]: te.get("model") for te in cluster.health().get("task_executors", ())}
    return {
        name: {(f"{p}:{models.get(p)}" if name == "te" else p): rss_bytes(p) for p in pids}
        for name, pids in roles(cluster.cluster).items()
    }


def growth(start: dict[str, dict[Any, int]], end: dict[str, dict[Any, int]]) -> dict[str, Any]:
    """Per service: memory at start and end, and its growth over the processes that lived
    through the whole run in the same state (a process a fault replaced is new, not grown).
    """
    out: dict[str, Any] = {}
    for name in sorted(start):
        a, b = start[name], end.get(name, {})
        lived = [p for p in a if p in b]
        before, after = sum(a[p] for p in lived), sum(b[p] for p in lived)
        out[name] = {
            "start_mib": round(sum(a.values()) / 2**20, 1),
            "end_mib": round(sum(b.values()) / 2**20, 1),
            "replaced": len(set(a) - set(b)),
            "growth_pct": round(100 * (after / before - 1), 1) if before else None,
        }
    return out


async def one(
    client: openai.AsyncOpenAI, prompt: str, stream: bool, max_tokens: int
) -> tuple[str, str | None]:
    """The request's text and None, or its outcome's failure reason ("lost: ...",
    "refused: ...")."""
    args: dict[str, Any] = dict(
        model="demo",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
    )
    started = False
    try:
        if not stream:
            r = await client.chat.completions.create(**args)
            return r.choices[0].message.content or "", None
        parts = []
        s = await client.chat.completions.create(**args, stream=True)
        async for chunk in s:
            started = True
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
        return "".join(parts), None
    except openai.APIStatusError as e:
        code = (e.body or {}).get("code") if isinstance(e.body, dict) else None
        kind = "lost" if started else "refused"
        return "", f"{kind}: {e.status_code} {code or ''}".strip()
    except (openai.APIConnectionError, openai.APITimeoutError) as e:
        return "", f"lost: {type(e).__name__}"
    except openai.APIError as e:  # an error event inside a stream that had started
        return "", f"{'lost' if started else 'refused'}: {e.message[:60]}"


class Faults:
    """Runs the faults on a thread of its own that lives through the soak: a server it
    restarts is bound (die-with-parent) to the thread that started it."""

    def __init__(self, cluster: str, nats: EmbeddedServer, redis: EmbeddedServer) -> None:
        self.cluster, self.nats, self.redis = cluster, nats, redis
        self.done: list[dict[str, Any]] = []
        self._jobs: list[tuple[float, str]] = []
        self._end = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self, at: list[tuple[float, str]]) -> None:
        self._jobs = sorted(at)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.monotonic()
        for when, fault in self._jobs:
            if self._end.wait(max(0.0, when - (time.monotonic() - t0))):
                return
            t = time.monotonic()
            detail = self._do(fault)
            self.done.append(
                {
                    "fault": fault,
                    "at_s": round(t - t0, 1),
                    "took_s": round(time.monotonic() - t, 2),
                    "detail": detail,
                }
            )
            print(f"fault {fault} at {t - t0:.0f} s: {detail}", file=sys.stderr, flush=True)
        self._end.wait()  # stay alive: restarted servers live as long as this thread

    def _do(self, fault: str) -> str:
        procs = roles(self.cluster)
        if fault in ("te", "je"):
            pids = procs.get("te" if fault == "te" else "job_executor", [])
            if not pids:
                return "no process to kill"
            pid = max(pids, key=rss_bytes) if fault == "te" else pids[0]
            os.kill(pid, signal.SIGKILL)
            return f"killed pid {pid}"
        server = self.redis if fault == "redis" else self.nats
        server.restart(down_s=1.0 if fault == "nats" else 0.0)
        return "restarted"

    def stop(self) -> None:
        self._end.set()
        self._thread.join(10)


async def load(
    url: str, refs: dict[str, str], *, rate: float, duration: float, max_tokens: int, seed: int
) -> list[tuple[str, str | None, str]]:
    """Poisson arrivals for ``duration`` seconds; (prompt, failure, text) per request."""
    rng = random.Random(seed)
    client = openai.AsyncOpenAI(
        base_url=url, api_key="unused", max_retries=0, timeout=CALL_TIMEOUT_S
    )
    tasks: list[asyncio.Task[tuple[str, str | None, str]]] = []

    async def run(i: int, prompt: str) -> tuple[str, str | None, str]:
        text, failure = await one(client, prompt, i % 2 == 0, max_tokens)
        return prompt, failure, text

    t0 = time.monotonic()
    i = 0
    while (now := time.monotonic() - t0) < duration:
        tasks.append(asyncio.create_task(run(i, rng.choice(list(refs)))))
        i += 1
        await asyncio.sleep(min(rng.expovariate(rate), max(0.0, duration - now)))
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        await client.close()


def outcome(failure: str | None, text: str, ref: str) -> str:
    if failure is not None:
        return failure.split(":", 1)[0]
    return "ok" if text == ref else "wrong"


def references(url: str, max_tokens: int) -> dict[str, str]:
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=CALL_TIMEOUT_S)
    refs = {}
    for p in PROMPTS:
        r = client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": p}],
            max_tokens=max_tokens,
            temperature=0,
        )
        refs[p] = r.choices[0].message.content or ""
    return refs


def schedule(faults: list[str], duration: float) -> list[tuple[float, str]]:
    """Evenly through the run, none in its first or last tenth."""
    n = len(faults)
    return [(duration * (0.1 + 0.8 * (k + 0.5) / n), f) for k, f in enumerate(faults)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="scripts/soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    p.add_argument("--rate", type=float, default=2.0, help="requests per second (default 2)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--faults",
        default=",".join(FAULTS),
        help=f"comma-separated, in order, from {', '.join(FAULTS)} ('' for none)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "soak.json")
    args = p.parse_args(argv)
    faults = [f for f in args.faults.split(",") if f]
    if bad := set(faults) - set(FAULTS):
        p.error(f"unknown faults: {', '.join(sorted(bad))}")

    model = ensure_model("demo", models_dir())
    work = Path(tempfile.mkdtemp(prefix="meshserve-soak-"))
    with EmbeddedServer("nats") as nats, EmbeddedServer("redis") as redis:
        with LocalCluster(
            "soak",
            model.parent,
            pool_size=2,
            settings={"KEEP_ALIVE": "3600", "HEARTBEAT_INTERVAL": "0.25", "LIVENESS_TIMEOUT": "2"},
            log=work / "cluster.log",
            nats_url=nats.url,
            redis_url=redis.url,
        ) as cluster:
            print(f"cluster {cluster.cluster} up; log {work / 'cluster.log'}", file=sys.stderr)
            refs = references(cluster.url, args.max_tokens)
            mem_start = memory(cluster)
            injector = Faults(cluster.cluster, nats, redis)
            injector.start(schedule(faults, args.duration))
            t0 = time.monotonic()
            try:
                got = asyncio.run(
                    load(
                        cluster.url,
                        refs,
                        rate=args.rate,
                        duration=args.duration,
                        max_tokens=args.max_tokens,
                        seed=args.seed,
                    )
                )
                elapsed = time.monotonic() - t0
                time.sleep(2)  # restarted services settle before their memory is read
                mem_end = memory(cluster)
            finally:
                injector.stop()

    outcomes = Counter(outcome(f, text, refs[prompt]) for prompt, f, text in got)
    reasons = Counter(f for _, f, _ in got if f is not None)
    mem = growth(mem_start, mem_end)
    summary = {
        "sent": len(got),
        "ok": outcomes["ok"],
        "wrong": outcomes["wrong"],
        "refused": outcomes["refused"],
        "lost": outcomes["lost"],
        "seconds": round(elapsed, 1),
    }
    Table([Col(k, k) for k in ("sent", "ok", "wrong", "refused", "lost", "seconds")]).print(
        [summary],
        title=f"soak: {args.rate:g} req/s for {args.duration:g} s, faults {faults or 'none'}",
    )
    if reasons:
        print("failures: " + ", ".join(f"{n}× {r}" for r, n in reasons.most_common()))
    Table(
        [
            Col("service", "service", width=16, left=True),
            Col("start_mib", "start MiB"),
            Col("end_mib", "end MiB"),
            Col("replaced", "replaced"),
            Col("growth_pct", "growth %"),
        ]
    ).print(
        [{"service": k, **v} for k, v in mem.items()],
        title="memory (resident; growth over the processes that lived through the run)",
    )
    met = summary["lost"] == 0 and summary["wrong"] == 0
    flat = all(v["growth_pct"] is None or v["growth_pct"] < 5 for v in mem.values())
    print(
        f"goal: 0 lost, 0 wrong: {'met' if met else 'NOT met'}; "
        f"memory growth < 5 %: {'met' if flat else 'NOT met'}"
    )
    write_result(
        args.out,
        {
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "summary": summary,
            "failures": dict(reasons),
            "faults": injector.done,
            "memory": mem,
            "references": refs,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
