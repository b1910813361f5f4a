"""Many models per device in the simulator (LLM-Mesh's comparison): a fleet of CPU and GPU
devices, many models, the Azure conversation trace's lengths and arrivals, each config the
same requests at each rate.

- ``gpu-exclusive``: the GPUs alone, one instance per device at a time (ServerlessLLM);
- ``exclusive``: the CPUs too, still one instance per device (ServerlessLLM with CPUs);
- ``uncoordinated``: ``--slots`` instances per device, their processes time-sliced;
- ``fifo``: the same, one iteration at a time in the order asked (first come);
- ``headroom``: one at a time, the earliest deadline first (the device arbiter's order);
- ``full``: headroom turns and shadow validation before each placement;
- ``full-packed``: the same with bin-packing routing (``packed``: the fullest instance with
  a free batch slot, LLM-Mesh's defragmentation) instead of the default ``combined``;
- ``full-kv``, ``full-packed-kv``: the same two with KV sized by demand (``SimConfig.kv_sizing``:
  each instance's pool follows its requests within the device's whole cache, where the
  others split it evenly). Each pool's floor is 1.25 times the model's context: at the
  profile's 32k one floor takes a CPU device's whole cache, so give these a shorter one
  (``--max-model-len``, for every config of the run);
- ``full-kvp``, ``full-packed-kvp``: the same again, and a grow that waits may preempt a
  smaller neighbour whose requests pass shadow validation elsewhere (``kv_preemption``).

Everything else is the project's policies as the simulator runs them (routing, admission,
holding, the scaler with scale-to-zero, the torch engine's scheduler), the CPU devices with
the bench model's measured CPU profile, the GPUs with its H100 profile
(``loadgen/profiles/``). The trace's requests are shared among ``--models`` models with
Zipf popularity (``spread_models``). Service capacity is the most requests that met the SLO
at any of the rates tried (as LLM-Mesh counts requests served within their SLO); the table
gives them at each rate, and the JSON the ratios at each rate too.

    scripts/bench-sharing-fleet [--models 16] [--rates 0.5,1,2,3,4] [--duration 600] [--out DIR]

Writes ``DIR/sharing-fleet.json`` (default bench-results/), with ``full_vs_exclusive``,
``full_vs_uncoordinated``, ``full_vs_gpu_exclusive`` and the others (ratios of service
capacity) and ``by_rate`` (the same ratios of the requests that met the SLO at each rate).
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS, ROOT, Col, Table, write_result
from loadgen import transforms
from loadgen.costmodel import DEFAULT_PROFILE, GPU_PROFILE, EngineProfile, load_profiles
from loadgen.plan import plan
from loadgen.report import summarize
from loadgen.simulator import SimConfig, simulate
from loadgen.traces import read_trace
from services.job_executor.routing import Policy, RoutingConfig
from shared.slo import SLO

TRACE = ROOT / "traces" / "azure_llm_2023_conv.csv"

# name: (CPU devices, GPU devices, instances per device, sharing, shadow validation,
# routing policy)
CONFIGS: dict[str, tuple[int, int, int, str, bool, Policy]] = {
    "gpu-exclusive": (0, 4, 1, "headroom", False, "combined"),
    "exclusive": (4, 4, 1, "headroom", False, "combined"),
    "uncoordinated": (4, 4, 0, "uncoordinated", False, "combined"),
    "fifo": (4, 4, 0, "fifo", False, "combined"),
    "headroom": (4, 4, 0, "headroom", False, "combined"),
    "full": (4, 4, 0, "headroom", True, "combined"),
    "full-packed": (4, 4, 0, "headroom", True, "packed"),
    "full-kv": (4, 4, 0, "headroom", True, "combined"),
    "full-packed-kv": (4, 4, 0, "headroom", True, "packed"),
    "full-kvp": (4, 4, 0, "headroom", True, "combined"),
    "full-packed-kvp": (4, 4, 0, "headroom", True, "packed"),
}


@dataclasses.dataclass(frozen=True)
class Job:
    config: str
    rate: float
    args: dict[str, Any]


def _profiles(models: list[str], path: Path, max_model_len: int = 0) -> dict[str, EngineProfile]:
    base = next(iter(load_profiles(path).values()))
    if max_model_len:
        base = dataclasses.replace(base, max_model_len=max_model_len)
    return {m: dataclasses.replace(base, model=m) for m in models}


def _run(job: Job) -> dict[str, Any]:
    a = job.args
    reqs = read_trace(Path(a["trace"]), None)
    if job.rate != 1:
        reqs = transforms.scale_rate(reqs, job.rate, a["seed"])
    reqs = transforms.limit(reqs, duration_s=a["duration"])
    reqs = transforms.spread_models(reqs, a["models"], a["skew"], a["seed"])
    planned = plan(reqs)
    models = sorted({p.model for p in planned})
    cpus, gpus, slots, sharing, shadow, routing = CONFIGS[job.config]
    slots = slots or a["slots"]
    kv = job.config.endswith(("-kv", "-kvp"))
    context = a["max_model_len"]
    slo = SLO()
    cfg = SimConfig(
        devices=cpus + gpus,
        gpu_devices=gpus,
        slots_per_device=slots,
        sharing=sharing,  # type: ignore[arg-type]
        shadow=shadow,
        max_replicas=(cpus + gpus) * slots,
        slo=slo,
        record_gaps=False,
        routing=RoutingConfig(policy=routing),
        kv_sizing=kv,
        kv_preemption=job.config.endswith("-kvp"),
        late_yield_s=a["late_yield"],
    )
    t0 = time.monotonic()
    results, stats = simulate(
        planned,
        _profiles(models, DEFAULT_PROFILE, context),
        cfg,
        _profiles(models, GPU_PROFILE, context),
    )
    summary = summarize(results, slo, exact_prompts=True)
    met = sum(
        1
        for r in results
        if slo.met(
            ok=r.status == 200, input_tokens=r.input_tokens, ttft_s=r.ttft_s, tpot_s=r.tpot_s
        )
    )
    return {
        "config": job.config,
        "rate": job.rate,
        "requests": len(results),
        "prompt_tokens": sum(p.input_tokens for p in planned),
        "output_tokens": sum(p.output_tokens for p in planned),
        "met": met,
        "attainment": met / max(1, len(results)),
        "ttft_p90": summary["ttft_ms"].get("p90") if summary.get("ttft_ms") else None,
        "failed": sum(1 for r in results if r.status != 200),
        "instance_s": stats.instance_seconds,
        "turns": stats.turns,
        "late_turns": stats.late_turns,
        "shadow_refused": dict(stats.shadow_refused),
        "device_busy": stats.device_busy,
        "kv_squeezes": stats.kv_squeezes,
        "kv_load_waits": stats.kv_load_waits,
        "kv_load_failures": stats.kv_load_failures,
        "kv_preemptions": stats.kv_preemptions,
        "kv_moved": stats.kv_moved,
        "wall_s": time.monotonic() - t0,
    }


def capacity(rows: list[dict[str, Any]]) -> int:
    """Service capacity: the most requests that met the SLO at any rate tried."""
    return max((r["met"] for r in rows), default=0)


def ratios(met: dict[str, int]) -> dict[str, float]:
    """``full_vs_<config>``: full's figure over each other config's."""
    return {
        f"full_vs_{other.replace('-', '_')}": met["full"] / met[other]
        for other in met
        if other != "full" and "full" in met and met[other] > 0
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="scripts/bench-sharing-fleet",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--models", type=int, default=16)
    p.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of model popularity")
    p.add_argument("--slots", type=int, default=4, help="instances per device where shared")
    p.add_argument("--rates", default="0.5,1,2,3,4", help="times the trace's arrival rate")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of the trace")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        help="the models' context (default: the profiles'; a -kv config's pools' floor is "
        "1.25 times it)",
    )
    p.add_argument(
        "--late-yield",
        type=float,
        help="seconds a late prompt waits behind those in time (default MESHSERVE_LATE_YIELD's)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=2, help="simulations at once")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    configs = args.configs.split(",")
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        p.error(f"unknown configs {unknown}; have {', '.join(CONFIGS)}")
    rates = [float(r) for r in args.rates.split(",")]
    shared = vars(args) | {"trace": str(args.trace), "out": str(args.out)}
    jobs = [Job(c, r, shared) for c in configs for r in rates]
    t0 = time.monotonic()
    rows = []
    with multiprocessing.get_context("spawn").Pool(max(1, args.jobs)) as pool:
        for row in pool.imap_unordered(_run, jobs):
            rows.append(row)
            print(
                f"{row['config']} at {row['rate']:g}x: {row['met']} of {row['requests']} met "
                f"the SLO ({row['wall_s']:.0f} s)",
                flush=True,
            )
    rows.sort(key=lambda r: (configs.index(r["config"]), r["rate"]))
    cols = [
        Col("config", "config", width=14, left=True),
        Col("rate", "rate x", ".2g"),
        Col("requests", "reqs"),
        Col("prompt_tokens", "prompt tok"),
        Col("output_tokens", "output tok"),
        Col("met", "met SLO"),
        Col("attainment", "SLO %", ".1%"),
        Col("ttft_p90", "TTFT p90 ms", ".0f"),
        Col("failed", "failed"),
        Col("instance_s", "inst-s", ".0f"),
    ]
    Table(cols).print(
        rows,
        title=f"{args.models} models on 4 CPU + 4 GPU devices (simulated), "
        f"{args.trace.name}, first {args.duration:g} s",
    )
    caps = {c: capacity([r for r in rows if r["config"] == c]) for c in configs}
    for c, cap in caps.items():
        print(f"service capacity {c}: {cap} requests met the SLO")
    overall = ratios(caps)
    for k, v in overall.items():
        print(f"{k}: {v:.2f}x")
    by_rate = {
        f"{rate:g}": ratios({r["config"]: r["met"] for r in rows if r["rate"] == rate})
        for rate in rates
    }
    print(f"{len(jobs)} simulations in {time.monotonic() - t0:.0f} s")
    write_result(
        args.out / "sharing-fleet.json",
        {"args": shared, "rows": rows, "capacity": caps, **overall, "by_rate": by_rate},
    )


if __name__ == "__main__":
    main()
