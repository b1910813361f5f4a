"""meshserve over several hosts: network namespaces joined by veth links to a bridge, each
link shaped with ``tc`` (``devtools/netns_hosts.py``), the cluster laid out as the
multi-host test lays it out (``devtools/multihost.py``: NATS clustered over the hosts, Redis
primary and replica under three Sentinels, two of each control-plane service).

- ``scale``: the same slice of the Azure conversation trace (``meshserve-loadgen replay``)
  through node pools on 1, 2 and 3 hosts (two TEs each, every TE an instance of the demo
  model; the control plane where the layout puts it): requests/s, latencies, SLO, the
  token totals (equal in every row, or the rows do not compare).
- ``cut``: 20 streams on three hosts' pools; the host whose instances produced the most of
  them is cut (its link down: no reset): the time until the cluster's view drops its TEs
  (detected) and until every stream ended (recovered, each with its whole output), against
  the liveness timeout.
- ``fork``: node pools of one TE on two hosts, the model's weights in one host's cache; a
  burst makes the scaler add the second instance, whose TE forks the weights from the other
  host's weight server across the shaped link: bytes over the load's fetch time, against
  the link's rate.

Every host here shares this machine's cores: adding hosts adds TEs, not compute, so the
``scale`` rows measure what crossing hosts costs, not how a real fleet grows. Needs root
and ``ip netns``. Writes bench-results/multihost.json (``--out DIR``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import openai

from bench.common import RESULTS, ROOT, Col, Table, ensure_model, replay_row, write_result
from devtools.chat import stream_greedy
from devtools.multihost import LAYOUT, MultiHostCluster
from devtools.netns_hosts import Hosts, Shaping, available

TRACE = ROOT / "traces" / "azure_llm_2023_conv.csv"
SETTINGS = {
    "max_num_seqs": "8",
    "keep_alive": "600",
    "stable_window": "600",
    "log_format": "json",
}
LIVENESS_S = 2.0  # devtools.multihost's MESHSERVE_LIVENESS_TIMEOUT


def _layout(pool_hosts: int) -> dict[int, tuple[str, ...]]:
    """The multi-host test's layout with node pools on the first ``pool_hosts`` hosts."""
    return {
        i: tuple(s for s in services if s != "task_executor" or i < pool_hosts)
        for i, services in LAYOUT.items()
    }


def _only(model: str, least: int, most: int) -> dict[str, str]:
    """Scaling settings that keep ``least`` to ``most`` instances of ``model`` and none of
    the other models in the directory (with ``--fork-model`` there are two)."""
    return {
        "min_replicas": "0",
        "max_replicas": str(most),
        "model_scaling": json.dumps({model: {"min_replicas": least, "max_replicas": most}}),
    }


def _up(hosts: Hosts, models: Path, layout: dict[int, tuple[str, ...]], **settings: str) -> Any:
    """The cluster, up once every pool's TEs are in the view (``MultiHostCluster.start``)."""
    return MultiHostCluster(hosts, models, layout=layout, **{**SETTINGS, **settings}).start()


def _ready(cluster: MultiHostCluster, n: int, model: str = "demo") -> None:
    cluster.wait(
        f"{n} instances ready",
        lambda: sum(s == "ready" for s in cluster.instances(0, model).values()) >= n,
        240,
    )


def scale(hosts: Hosts, models: Path, work: Path, args: argparse.Namespace) -> list[dict]:
    rows = []
    for k in (1, 2, 3):
        n = 2 * k
        cluster = _up(hosts, models, _layout(k), pool_size="2", **_only("demo", n, n))
        try:
            _ready(cluster, n)
            out = work / f"scale-{k}"
            t0 = time.monotonic()
            subprocess.run(
                [sys.executable, "-m", "loadgen.cli", "replay", str(TRACE), "--url",
                 cluster.url(0), "--model", "demo", "--tokenizer", str(models / "demo"),
                 "--max-requests", str(args.requests), "--rate-scale", str(args.rate_scale),
                 "--max-output-tokens", "128", "--no-plots", "--quiet", "--out", str(out)],
                check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
            )  # fmt: skip
            wall = time.monotonic() - t0
            summary = json.loads((out / "summary.json").read_text())
            row = replay_row(f"{k} host{'s' if k > 1 else ''}", summary)
            row["instances"] = n
            row["rps"] = summary["requests"] / summary["duration_s"]
            row["wall_s"] = wall
            rows.append(row)
            print(f"scale: {row}", flush=True)
        finally:
            cluster.stop()
    return rows


async def _cut(cluster: MultiHostCluster) -> dict[str, Any]:
    client = openai.AsyncOpenAI(base_url=cluster.url(0), api_key="none", max_retries=0)
    prompts = [
        f"Write the log of ship {i} crossing the bay at dawn, hour by hour." for i in range(20)
    ]
    before, seen = cluster.produced(0), [0]
    streams = [asyncio.create_task(stream_greedy(client, p, seen=seen)) for p in prompts]
    deadline = time.monotonic() + 60
    while seen[0] < 10 * len(prompts):  # mid-stream: ten chunks a stream, on average
        if time.monotonic() > deadline:
            raise RuntimeError("the streams did not start")
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.5)
    now = cluster.produced(0)
    load = {h: now[h] - before.get(h, 0) for h in now if h != 0}
    victim = max(load, key=lambda h: load[h])
    cluster.hosts.cut(victim)
    t0 = time.monotonic()
    detected = None
    while not all(s.done() for s in streams) or detected is None:
        tes = (cluster.health(0) or {"task_executors": [{"pool": "?"}]})["task_executors"]
        if detected is None and all(te["pool"] != f"pool-h{victim}" for te in tes):
            detected = time.monotonic() - t0
        if time.monotonic() - t0 > 120:
            raise RuntimeError("the streams did not end within 120 s of the cut")
        await asyncio.sleep(0.05)
    results = [s.result() for s in streams]
    recovered = time.monotonic() - t0
    cluster.hosts.heal(victim)
    reference = [await stream_greedy(client, p) for p in prompts]
    return {
        "host_cut": victim,
        "streams": len(prompts),
        "its_tokens_at_the_cut": load[victim],
        "detected_s": detected,
        "recovered_s": recovered,
        "liveness_timeout_s": LIVENESS_S,
        "outputs_equal_undisturbed": results == reference,
    }


def cut(hosts: Hosts, models: Path) -> dict[str, Any]:
    cluster = _up(hosts, models, LAYOUT, pool_size="2", **_only("demo", 4, 4))
    try:
        _ready(cluster, 4)
        return asyncio.run(_cut(cluster))
    finally:
        cluster.stop()


def fork(hosts: Hosts, models: Path, model: str) -> dict[str, Any]:
    layout = _layout(2)
    cluster = _up(
        hosts, models, layout, pool_size="1", max_num_seqs="1", preload_window="0",
        **_only(model, 1, 2),
    )  # fmt: skip
    try:
        _ready(cluster, 1, model)
        cluster.wait(
            "the first pool's cache holds the model",
            lambda: cluster.holds_weights(0, model),
            120,
        )

        async def burst() -> None:
            client = openai.AsyncOpenAI(base_url=cluster.url(0), api_key="none", max_retries=0)
            while sum(s == "ready" for s in cluster.instances(0, model).values()) < 2:
                await asyncio.gather(*(_ask(client, model) for _ in range(4)))

        asyncio.run(asyncio.wait_for(burst(), 240))
        loads = cluster.loads()
        forked = cluster.fork(model)
        if forked is None:
            raise RuntimeError(f"no load forked its weights: {loads}")
        return {**forked, "loads": loads}
    finally:
        cluster.stop()


async def _ask(client: openai.AsyncOpenAI, model: str) -> None:
    await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Tell me a long story about the sea."}],
        max_tokens=64,
        temperature=0,
        extra_body={"ignore_eos": True},
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="scripts/bench-multihost",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--parts", default="scale,cut,fork", help="which parts, comma-separated")
    p.add_argument("--requests", type=int, default=80, help="the trace slice (scale)")
    p.add_argument("--rate-scale", type=float, default=2.0, help="the slice's arrival rate x")
    p.add_argument("--link", default="10gbit", help="each host's link rate (tc tbf)")
    p.add_argument("--delay-ms", type=float, default=0.2, help="round trip (where netem is)")
    p.add_argument("--fork-model", default="demo", help="demo or bench-qwen2-0.5b (fork)")
    p.add_argument("--out", type=Path, default=RESULTS, help="directory for multihost.json")
    args = p.parse_args(argv)
    if why := available():
        raise SystemExit(f"bench-multihost: {why}")
    parts = set(args.parts.split(","))
    work = Path(tempfile.mkdtemp(prefix="bench-multihost-"))
    models = work / "models"
    models.mkdir()
    from bench.common import models_dir

    for name in {"demo", args.fork_model}:
        (models / name).symlink_to(ensure_model(name, models_dir()))
    result: dict[str, Any] = {"link": args.link, "delay_ms": args.delay_ms}
    # Stopped with SIGTERM, it still takes its hosts down (the finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    hosts = Hosts(3, work, Shaping(rate=args.link, delay_ms=args.delay_ms))
    try:
        hosts.up()
        result["delay_shaped"] = hosts.shaping.delayed
        # A part that fails is recorded with its error; the others' results are kept.
        for part, run in (
            ("scale", lambda: scale(hosts, models, work, args)),
            ("cut", lambda: cut(hosts, models)),
            ("fork", lambda: fork(hosts, models, args.fork_model)),
        ):
            if part not in parts:
                continue
            try:
                result[part] = run()
            except Exception as e:
                result[f"{part}_error"] = f"{type(e).__name__}: {e}"
                print(f"{part} failed: {e!r}", flush=True)
    finally:
        hosts.down()
    if rows := result.get("scale"):
        Table(
            [
                Col("config", "hosts", left=True),
                Col("instances", "TEs"),
                Col("requests", "reqs"),
                Col("prompt_tokens", "prompt tok"),
                Col("output_tokens", "output tok"),
                Col("rps", "req/s", ".2f"),
                Col("ttft_p50", "TTFT p50 ms", ".0f"),
                Col("tpot_p90", "TPOT p90 ms", ".1f"),
                Col("slo", "SLO %", ".1f"),
                Col("failed", "failed"),
            ]
        ).print(rows, title=f"the same {args.requests} requests of {TRACE.name}")
    if c := result.get("cut"):
        print(
            f"host {c['host_cut']} cut with {c['streams']} streams: dropped from the view "
            f"{c['detected_s']:.1f} s later (liveness {c['liveness_timeout_s']:g} s), every "
            f"stream ended {c['recovered_s']:.1f} s later, outputs equal to the undisturbed "
            f"run: {c['outputs_equal_undisturbed']}"
        )
    if f := result.get("fork"):
        print(
            f"fork of {f['model']} across a {args.link} link: {f['checkpoint_bytes'] / 1e6:.1f} MB "
            f"in {f['fetch_s']:.3f} s = {f['rate_bytes_s'] / 1e6:.0f} MB/s, "
            f"{100 * f['of_link']:.0f}% of the link"
        )
    write_result(args.out / "multihost.json", result)


if __name__ == "__main__":
    main()
