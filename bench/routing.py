"""KV-aware routing against round-robin and least-loaded, three ways:

- ``index``: the prompt index alone, in this process: the match of a 32k-token prompt (its
  chained block hashes, then the walk) against an index of ~1M blocks over 100 TEs, p50/p99;
  event batches applied per second to a job executor's replica, and written per second to
  the durable copy in Redis (the script each TE runs before it publishes a batch).
- ``cluster``: a local cluster with three TEs of the demo model (``MESHSERVE_MODEL_SCALING``
  pins it at 3) for each ``MESHSERVE_ROUTING`` policy in turn, replaying the same window of
  the Mooncake conversation trace (``meshserve-loadgen replay``; its ``hash_ids`` carry the
  real sharing). The trace's prompts (14k tokens on average in its first ten minutes) are
  scaled by ``--prompt-scale`` with their blocks (0.125: 64-token blocks of the trace's 512),
  so that a 2-core host serves them; the share of each prompt that is shared stays the
  trace's. Hit rates: ``cached`` is what the engines took from their prefix caches
  (``usage.prompt_tokens_details.cached_tokens``); ``routed`` what the prompt index said the
  chosen TE held when the job executor placed the request; ``oracle`` what the TE holding the
  most held at that moment (the best any router could have reused, from the frontend's
  ``meshserve_routing_prompt_tokens``); ``bound`` what an unbounded cache shared by every
  TE would hold (the trace's own sharing).
- ``sim``: ``meshserve-loadgen simulate --routing all`` on the whole trace with 16 devices
  and the demo model's profile, at the trace's own rate and faster (``--sim-time-scales``).

    scripts/bench-routing [--window 300] [--time-scales 0.4,0.3] [--skip-sim] [--skip-cluster]

Needs NATS and Redis for the cluster and the store (``MESHSERVE_NATS_URL`` /
``MESHSERVE_REDIS_URL``; the wrapper uses local ones where they answer). Writes
bench-results/routing.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.cluster import LocalCluster, counter, instances
from bench.common import (
    RESULTS,
    ROOT,
    Col,
    Table,
    ensure_model,
    models_dir,
    names,
    replay_row,
    write_result,
)
from loadgen.prefix_sim import reuse_bound
from services.job_executor.prompt_index import ModelIndex
from services.job_executor.routing import POLICIES
from shared import block_hash
from shared.block_hash import chain_hashes
from shared.messages.kv import KvBlocksRemoved, KvBlocksStored, KvEventBatch
from shared.native import Toolchain
from shared.settings import Settings

TRACE = ROOT / "traces" / "mooncake_conversation.jsonl"
MODEL = "demo"
CLUSTER = {  # three TEs of one model, each on one thread (two cores for all three)
    "TORCH_THREADS": "1",
    "HEARTBEAT_INTERVAL": "0.5",
}


# --- the index ------------------------------------------------------------------------------


def bench_index(tes: int, blocks: int, prompt_tokens: int, reps: int) -> dict[str, Any]:
    block = 16
    rng = random.Random(0)
    index = ModelIndex(block)
    prompt = list(range(prompt_tokens))
    hashes = chain_hashes(prompt, block)
    own_per_te = (blocks - len(hashes)) // tes  # so that the index holds ``blocks`` in all
    # Each TE holds a prefix of the probe prompt (TE i: i/tes of it, so the walk goes to the
    # end for the last ones) and its own conversations' blocks.
    batches = []
    for i in range(tes):
        held = hashes[: len(hashes) * i // tes]
        own = [rng.getrandbits(64) for _ in range(own_per_te)]
        mine = held + own
        for seq, start in enumerate(range(0, len(mine), 512)):
            stored = KvBlocksStored(block_hashes=mine[start : start + 512])
            batches.append(
                KvEventBatch(te_id=f"te{i}", model="m", seq=seq, block_size=block, events=[stored])
            )
    t0 = time.perf_counter()
    for b in batches:
        index.apply(b)
    build_s = time.perf_counter() - t0
    te_ids = [f"te{i}" for i in range(tes)]
    # Steady state: small batches (a prompt's blocks stored, an eviction's removed).
    churn = []
    seqs = {te: index.seq(te) for te in te_ids}
    for k in range(2000):
        te = te_ids[k % tes]
        seqs[te] += 1
        new = [rng.getrandbits(64) for _ in range(32)]
        churn.append(
            KvEventBatch(
                te_id=te,
                model="m",
                seq=seqs[te],
                block_size=block,
                events=[KvBlocksStored(block_hashes=new), KvBlocksRemoved(block_hashes=new[:16])],
            )
        )
    t0 = time.perf_counter()
    for b in churn:
        assert not index.apply(b).gap
    churn_s = time.perf_counter() - t0

    def timed(fn: Any) -> list[float]:
        out = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1000)
        return sorted(out)

    python_hash_ms = timed(lambda: chain_hashes(prompt, block))
    native = block_hash.use_native(Toolchain.of(Settings.load()))  # as the JE does
    hash_ms = timed(lambda: chain_hashes(prompt, block))
    match_ms = timed(lambda: index.match(hashes, te_ids))
    total_ms = timed(lambda: index.match(chain_hashes(prompt, block), te_ids))
    miss = chain_hashes([t + 1 for t in prompt], block)
    miss_ms = timed(lambda: index.match(miss, te_ids))

    def pct(xs: list[float], q: float) -> float:
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    got = index.match(hashes, te_ids)
    assert got[te_ids[-1]] == len(hashes) * (tes - 1) // tes
    return {
        "tes": tes,
        "blocks": len(index),
        "prompt_tokens": prompt_tokens,
        "prompt_blocks": len(hashes),
        "native_hash": native,
        "hash_ms": {"p50": pct(hash_ms, 0.5), "p99": pct(hash_ms, 0.99)},
        "python_hash_ms": {"p50": pct(python_hash_ms, 0.5), "p99": pct(python_hash_ms, 0.99)},
        "match_ms": {"p50": pct(match_ms, 0.5), "p99": pct(match_ms, 0.99)},
        "hash_and_match_ms": {"p50": pct(total_ms, 0.5), "p99": pct(total_ms, 0.99)},
        "miss_ms": {"p50": pct(miss_ms, 0.5), "p99": pct(miss_ms, 0.99)},
        "build_blocks_per_s": len(index) / build_s,
        "churn_batches_per_s": len(churn) / churn_s,
        "churn_blocks_per_s": len(churn) * 48 / churn_s,
    }


async def _bench_store(url: str, batches: int) -> dict[str, Any]:
    """A TE's writes to the durable copy: one script call per batch of 32 stored and 16
    removed blocks."""
    from shared.kv_index_store import KvIndexStore
    from shared.store import Store

    store = await Store.connect(url)
    cluster = f"bench-routing-{random.getrandbits(32):08x}"
    kv = KvIndexStore(store, cluster)
    rng = random.Random(1)
    try:
        lat = []
        t0 = time.perf_counter()
        for seq in range(batches):
            new = [rng.getrandbits(64) for _ in range(32)]
            batch = KvEventBatch(
                te_id="te0",
                model="m",
                seq=seq,
                block_size=16,
                events=[KvBlocksStored(block_hashes=new), KvBlocksRemoved(block_hashes=new[:16])],
            )
            t = time.perf_counter()
            assert await kv.apply(batch)
            lat.append((time.perf_counter() - t) * 1000)
        wall = time.perf_counter() - t0
        t = time.perf_counter()
        got = await kv.read("m", "te0")
        read_ms = (time.perf_counter() - t) * 1000
        assert got is not None and len(got[2]["device"]) == 16 * batches
        await kv.forget("m", "te0")
    finally:
        await store.close()
    lat.sort()
    return {
        "batches_per_s": batches / wall,
        "write_ms": {"p50": lat[len(lat) // 2], "p99": lat[int(0.99 * len(lat))]},
        "resync_read_ms": read_ms,
        "resync_blocks": 16 * batches,
    }


# --- a cluster per policy -------------------------------------------------------------------


def run_policy(
    policy: str,
    models: Path,
    tokenizer: Path,
    work: Path,
    replay_args: list[str],
    log_level: str = "warning",
) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    settings = {
        **CLUSTER,
        "ROUTING": policy,
        "MODEL_SCALING": json.dumps({MODEL: {"min_replicas": 3, "max_replicas": 3}}),
    }
    with LocalCluster(
        policy,
        models,
        pool_size=3,
        settings=settings,
        log=work / f"{policy}.log",
        log_level=log_level,
    ) as cluster:
        cluster.wait(lambda h: instances(h).get(MODEL, 0) >= 3)
        run_dir = work / policy
        t0 = time.monotonic()
        subprocess.run(
            [sys.executable, "-m", "loadgen.cli", "replay", str(TRACE), "--url", cluster.url,
             "--model", MODEL, "--tokenizer", str(tokenizer), "--prompt-format", "ids",
             "--no-plots", "--quiet", "--out", str(run_dir), *replay_args],
            check=True,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        wall = time.monotonic() - t0
        metrics = cluster.metrics()
    summary = json.loads((run_dir / "summary.json").read_text())
    tokens = {
        kind: counter(metrics, "meshserve_routing_prompt_tokens", model=MODEL, kind=kind)
        for kind in ("prompt", "matched", "best", "cached")
    }
    branches = {
        b: int(counter(metrics, "meshserve_routing_decisions", model=MODEL, branch=b))
        for b in ("locality", "load", "least-loaded", "round-robin")
    }
    prompt = summary.get("input_tokens") or 0
    return {
        "policy": policy,
        "summary": summary,
        "wall_s": wall,
        "routing_tokens": tokens,
        "branches": branches,
        "row": replay_row(policy, summary)
        | {
            "cached": 100 * (summary.get("cached_tokens") or 0) / max(prompt, 1),
            "routed": 100 * tokens["matched"] / max(tokens["prompt"], 1),
            "oracle": 100 * tokens["best"] / max(tokens["prompt"], 1),
        },
    }


def trace_bound(window_s: float, time_scale: float, prompt_scale: float, context: int) -> float:
    """The sharing an unbounded cache would find in the replayed window."""
    from loadgen import transforms
    from loadgen.plan import plan
    from loadgen.traces import read_trace

    reqs = transforms.scale_time(read_trace(TRACE), time_scale)
    reqs = transforms.scale_prompts(reqs, prompt_scale)
    reqs = transforms.limit(reqs, duration_s=window_s * time_scale)
    planned = plan(reqs, model=MODEL, max_context={MODEL: context})
    return reuse_bound(planned)


# --- the simulator --------------------------------------------------------------------------


def run_sim(devices: int, time_scale: float, work: Path) -> dict[str, Any]:
    out = work / f"sim-{time_scale:g}"
    subprocess.run(
        [sys.executable, "-m", "loadgen.cli", "simulate", str(TRACE),
         "--profile", str(ROOT / "loadgen" / "profiles" / "demo-torch-cpu.json"),
         "--profile-for", MODEL, "--model", MODEL, "--devices", str(devices),
         "--min-replicas", str(devices), "--time-scale", str(time_scale),
         "--routing", "all", "--no-gaps", "--no-plots", "--out", str(out)],
        check=True,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    rows = json.loads((out / "routing.json").read_text())
    return {
        policy: {
            "config": f"{policy} (sim, {1 / time_scale:g}x)",
            "requests": r["requests"],
            "ttft_p50": r["ttft_ms"]["p50"],
            "ttft_p90": r["ttft_ms"]["p90"],
            "tpot_p90": r["tpot_ms"]["p90"],
            "goodput": r["goodput_rps"],
            "slo": 100 * (r["slo_attainment"] or 0.0),
            "failed": r["failed"],
            "prompt_tokens": r["prompt_tokens"],
            "cached": 100 * r["hit_rate"],
            "routed": 100 * r["matched_rate"],
            "oracle": 100 * r["oracle_hit_rate"],
        }
        for policy, r in rows.items()
    }


# --- main -----------------------------------------------------------------------------------


TABLE = [
    Col("config", "policy", width=26, left=True),
    Col("requests", "reqs"),
    Col("prompt_tokens", "prompt tok"),
    Col("ttft_p50", "TTFT p50 ms", ".0f"),
    Col("ttft_p90", "TTFT p90 ms", ".0f"),
    Col("tpot_p90", "TPOT p90 ms", ".0f"),
    Col("goodput", "goodput/s", ".3f"),
    Col("slo", "SLO %", ".1f"),
    Col("failed", "refused"),
    Col("cached", "cached %", ".1f"),
    Col("routed", "routed %", ".1f"),
    Col("oracle", "oracle %", ".1f"),
]


def _ratios(rows: dict[str, dict[str, Any]]) -> dict[str, float]:
    c, rr = rows.get("combined"), rows.get("round-robin")
    if not c or not rr:
        return {}
    return {
        "ttft_p50_vs_round_robin": c["ttft_p50"] / rr["ttft_p50"] if rr["ttft_p50"] else 0.0,
        "goodput_vs_round_robin": c["goodput"] / rr["goodput"] if rr["goodput"] else 0.0,
        "routed_vs_oracle": c["routed"] / c["oracle"] if c["oracle"] else 0.0,
        "cached_vs_oracle": c["cached"] / c["oracle"] if c["oracle"] else 0.0,
    }


def _print_ratios(ratios: dict[str, float]) -> None:
    if ratios:
        print(
            f"combined against round-robin: TTFT p50 {ratios['ttft_p50_vs_round_robin']:.2f}x, "
            f"goodput {ratios['goodput_vs_round_robin']:.2f}x; combined's hit rate against the "
            f"oracle's: routed {ratios['routed_vs_oracle']:.2f}x, "
            f"cached {ratios['cached_vs_oracle']:.2f}x"
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="scripts/bench-routing",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--window", type=float, default=300, help="seconds of the trace replayed")
    p.add_argument(
        "--time-scales",
        default="0.4,0.3",
        help="the replayed window's time scales, a cluster run each (0.4: 2.5x its rate)",
    )
    p.add_argument("--prompt-scale", type=float, default=0.125, help="of the trace's prompts")
    p.add_argument("--max-output-tokens", type=int, default=128)
    # The prefix cache's policies and their two baselines (packed is bench-sharing's).
    p.add_argument("--policies", type=names, default=[p for p in POLICIES if p != "packed"])
    p.add_argument("--sim-devices", type=int, default=16)
    p.add_argument(
        "--sim-time-scales",
        default="1,0.25,0.15",
        help="the simulated trace's time scales (1: its own rate; 0.25: four times it)",
    )
    p.add_argument("--index-tes", type=int, default=100)
    p.add_argument("--index-blocks", type=int, default=1_000_000)
    p.add_argument("--index-prompt-tokens", type=int, default=32768)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a setting for every cluster, MESHSERVE_ left out (ROUTING_BALANCE_TOKENS=4096)",
    )
    p.add_argument(
        "--log-level",
        default="warning",
        help="the clusters' (debug: each placement's candidates, in WORK/POLICY.log)",
    )
    p.add_argument("--skip-index", action="store_true")
    p.add_argument("--skip-cluster", action="store_true")
    p.add_argument("--skip-sim", action="store_true")
    p.add_argument("--out", type=Path, default=RESULTS / "routing.json")
    args = p.parse_args(argv)
    CLUSTER.update(dict(kv.split("=", 1) for kv in args.set))
    work = Path(tempfile.mkdtemp(prefix="bench-routing-"))
    result: dict[str, Any] = {"args": vars(args) | {"out": str(args.out)}, "work_dir": str(work)}

    if not args.skip_index:
        idx = bench_index(args.index_tes, args.index_blocks, args.index_prompt_tokens, reps=200)
        settings = Settings.load()
        if settings.redis_url:
            idx["store"] = asyncio.run(_bench_store(settings.redis_url, 2000))
        result["index"] = idx
        print(
            f"prompt index: {idx['blocks']:,} blocks over {idx['tes']} TEs; a "
            f"{idx['prompt_tokens']:,}-token prompt ({idx['prompt_blocks']} blocks): hash "
            f"p50 {idx['hash_ms']['p50']:.2f} ms ({'C' if idx['native_hash'] else 'Python'}; "
            f"Python {idx['python_hash_ms']['p50']:.2f} ms), match p50 {idx['match_ms']['p50']:.2f} / p99 "
            f"{idx['match_ms']['p99']:.2f} ms, both p50 {idx['hash_and_match_ms']['p50']:.2f} / "
            f"p99 {idx['hash_and_match_ms']['p99']:.2f} ms, a miss {idx['miss_ms']['p50']:.3f} "
            f"ms; events applied {idx['churn_batches_per_s']:,.0f} batches/s "
            f"({idx['churn_blocks_per_s']:,.0f} blocks/s), bulk {idx['build_blocks_per_s']:,.0f}"
            " blocks/s",
            flush=True,
        )
        if "store" in idx:
            st = idx["store"]
            print(
                f"durable copy (Redis): {st['batches_per_s']:,.0f} batches/s from one TE, "
                f"write p50 {st['write_ms']['p50']:.2f} / p99 {st['write_ms']['p99']:.2f} ms; "
                f"a resync of {st['resync_blocks']:,} blocks reads in "
                f"{st['resync_read_ms']:.1f} ms",
                flush=True,
            )

    if not args.skip_cluster:
        demo = ensure_model(MODEL, models_dir())
        models = work / "models"
        models.mkdir()
        (models / MODEL).symlink_to(demo)
        max_context = json.loads((demo / "config.json").read_text())["max_position_embeddings"]
        result["cluster"] = {}
        for ts in (float(x) for x in args.time_scales.split(",") if x):
            replay_args = [
                "--duration", str(args.window * ts),
                "--time-scale", str(ts),
                "--prompt-scale", str(args.prompt_scale),
                "--max-output-tokens", str(args.max_output_tokens),
            ]  # fmt: skip
            bound = 100 * trace_bound(args.window, ts, args.prompt_scale, max_context)
            print(
                f"cluster: 3 TEs of {MODEL}, {args.window:g} s of {TRACE.name} at {1 / ts:g}x "
                f"its rate, prompts x{args.prompt_scale:g}, outputs <= {args.max_output_tokens}; "
                f"an unbounded shared cache would hold {bound:.1f}% of the prompt tokens",
                flush=True,
            )
            runs = {}
            for policy in args.policies:
                runs[policy] = run_policy(
                    policy, models, demo, work / f"x{1 / ts:g}", replay_args, args.log_level
                )
                print(f"  {policy}: {json.dumps(runs[policy]['row'])}", flush=True)
            rows = {k: r["row"] for k, r in runs.items()}
            if len({(r["prompt_tokens"], r["output_tokens"]) for r in rows.values()}) > 1:
                print("  the policies did not process the same tokens (see 'refused')", flush=True)
            Table(TABLE).print(
                list(rows.values()), title=f"routing on a real cluster, {1 / ts:g}x the rate"
            )
            result["cluster"][f"{ts:g}"] = {
                "runs": runs,
                "bound": bound,
                "ratios": _ratios(rows),
                "settings": CLUSTER,
            }
            _print_ratios(result["cluster"][f"{ts:g}"]["ratios"])

    if not args.skip_sim:
        sims = {}
        for ts in (float(x) for x in args.sim_time_scales.split(",") if x):
            rows = run_sim(args.sim_devices, ts, work)
            Table(TABLE).print(
                list(rows.values()),
                title=f"simulated: the whole trace on {args.sim_devices} devices",
            )
            sims[f"{ts:g}"] = {"rows": rows, "ratios": _ratios(rows)}
            _print_ratios(sims[f"{ts:g}"]["ratios"])
        result["sim"] = sims

    # A section skipped keeps what an earlier run wrote there (marked with its own time).
    if args.out.exists():
        earlier = json.loads(args.out.read_text())
        for section in ("index", "cluster", "sim"):
            if section not in result and section in earlier:
                result[section] = {
                    "from_earlier_run": earlier.get("written_at"),
                    **earlier[section],
                }
    write_result(args.out, result | {"written_at": time.strftime("%Y-%m-%d %H:%M:%S")})


if __name__ == "__main__":
    main()
