"""PD disaggregation against colocated serving on windows of the shipped traces, in
``meshserve-loadgen simulate``'s cluster (the project's routing, PD rule, scaler and batch
scheduler over a profiled engine): for each profile and trace window, one fleet of
``--devices`` TEs run

- colocated: up to all of them as whole-request instances, PD never;
- always: up to ``devices − prefill`` instances and up to ``prefill`` prefill instances the
  scaler loads, every request with output disaggregated (a fixed split: given all devices,
  whole-request instances take them and the prefill instances drown);
- auto: up to all of them as whole-request instances and up to ``prefill`` prefill
  instances, the scaler choosing the split; the JE's rule (MESHSERVE_PD_MIN_UNCACHED_*, and
  no longer a queue on the prefill instance than on the decode instance);
- auto + heat map: the same, deciding by ``--heatmap`` (``scripts/bench-pd-heatmap``) where
  it covers the profile's model.

Prints one table per (profile, window): SLO attainment, TTFT and TPOT percentiles, requests
disaggregated, KV moved, and the prompt and output tokens every run processed (the same in
every row: like is compared with like). Writes bench-results/pd.json.

    python -m bench.pd [--profiles FILE,...] [--devices 8] [--prefill 2] ...
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, write_result
from loadgen import transforms
from loadgen.costmodel import load_profiles
from loadgen.plan import plan
from loadgen.report import summarize
from loadgen.simulator import SimConfig, simulate
from loadgen.traces import read_trace
from services.job_executor.disaggregation import PdConfig
from services.job_executor.pd_heatmap import load as load_heatmaps
from shared.slo import SLO, parse_slo

PROFILES = ROOT / "loadgen" / "profiles"
TRACES = ROOT / "traces"
# (name, trace, rate scale by profile device): a rate that loads the fleet without drowning it.
WINDOWS = {
    "mooncake": ("mooncake_conversation.jsonl", {"cpu": 0.05, "cuda": 4.0}),
    "azure": ("azure_llm_2023_conv.csv", {"cpu": 0.25, "cuda": 8.0}),
}
# Requests per window by profile device: minutes of traffic, several of the scaler's stable
# windows (60 s), so the fleet settles. On the CPU profiles 600 requests span the trace's
# hour; a GPU fleet serves 600 of Mooncake's at 4x in 54 s, less than one stable window
# (the scaler still growing the fleet when the window ends), 3,000 in 4 minutes.
REQUESTS = {"cpu": 600, "cuda": 3000}


def run(
    planned: list[Any],
    profiles: dict[str, Any],
    cfg: SimConfig,
    slo: SLO,
) -> dict[str, Any]:
    results, stats = simulate(planned, profiles, cfg)
    s = summarize(results, slo, exact_prompts=True)
    return {
        "slo_attainment": s["slo_attainment"],
        "ttft_ms": s["ttft_ms"],
        "tpot_ms": s["tpot_ms"],
        "failed": s["failed"],
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in results),
        "output_tokens": sum(r.completion_tokens or 0 for r in results),
        "disaggregated": stats.disaggregated,
        "kv_gb": stats.kv_bytes / 1e9,
        "prefill_loads": stats.prefill_loads,
        "instance_seconds": stats.instance_seconds,
        "pd_reasons": stats.pd_reasons,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--profiles",
        default=f"{PROFILES / 'bench-qwen2-0.5b-torch-cpu.json'},"
        f"{PROFILES / 'bench-qwen2-0.5b-torch-h100.json'}",
    )
    ap.add_argument("--windows", default="mooncake,azure")
    ap.add_argument(
        "--requests",
        type=int,
        default=0,
        help="the first N of each window (default: 600 on CPU profiles, 3,000 on GPU ones)",
    )
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--prefill", type=int, default=2, help="most prefill instances")
    ap.add_argument("--kv-bandwidth", type=float, default=1.25e9, help="bytes/s (10 Gb/s)")
    ap.add_argument(
        "--heatmap",
        type=Path,
        action="append",
        default=[],
        help="heat map files (scripts/bench-pd-heatmap) for the auto + heat map rows: each "
        "applies to the profile it was measured on (repeat for several)",
    )
    ap.add_argument(
        "--slo-cpu", default="ttft=2s,ttft_per_token=1/512,tpot=250ms", help="SLO, CPU profiles"
    )
    ap.add_argument(
        "--slo-cuda", default="ttft=500ms,ttft_per_token=1/16384,tpot=25ms", help="GPU profiles"
    )
    ap.add_argument("--traces", type=Path, default=TRACES)
    ap.add_argument(
        "--late-yield",
        type=float,
        help="seconds a late prompt waits behind those in time (default MESHSERVE_LATE_YIELD's)",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "bench-results" / "pd.json")
    args = ap.parse_args(argv)
    # By (model, profile file): a map measured on one profile says nothing of another.
    heatmaps = {
        (model, Path(str(hm.source.get("profile", ""))).name): hm
        for path in args.heatmap
        for model, hm in load_heatmaps(path).items()
    }
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for path in [Path(p) for p in args.profiles.split(",") if p]:
        for model, profile in load_profiles(path).items():
            device = str(profile.source.get("device", "cpu"))
            kind = "cuda" if device.startswith("cuda") else "cpu"
            slo = parse_slo(args.slo_cuda if kind == "cuda" else args.slo_cpu)
            for window in args.windows.split(","):
                trace, scales = WINDOWS[window]
                reqs = read_trace(args.traces / trace)
                reqs = transforms.scale_rate(reqs, scales[kind], 0)
                reqs = transforms.limit(reqs, max_requests=args.requests or REQUESTS[kind])
                planned = plan(reqs, model=model, max_context={model: profile.max_model_len})
                n, k = args.devices, args.prefill
                base = SimConfig(
                    devices=n,
                    pool_size=n,
                    slo=slo,
                    kv_bandwidth=args.kv_bandwidth,
                    record_gaps=True,
                    late_yield_s=args.late_yield,
                )
                split = dataclasses.replace(base, max_replicas=n - k, max_prefill_replicas=k)
                shared = dataclasses.replace(base, max_replicas=n, max_prefill_replicas=k)
                configs = {
                    "colocated": dataclasses.replace(
                        base, max_replicas=n, pd=PdConfig(mode="never")
                    ),
                    "always": dataclasses.replace(split, pd=PdConfig(mode="always")),
                    "auto": dataclasses.replace(shared, pd=PdConfig(mode="auto")),
                }
                if (hm := heatmaps.get((model, path.name))) is not None:
                    configs["auto + heat map"] = dataclasses.replace(
                        shared, pd=PdConfig(mode="auto", heatmaps={model: hm})
                    )
                span = planned[-1].arrival_s - planned[0].arrival_s if planned else 0.0
                print(
                    f"\n{path.name} ({device}), {window}: first {len(planned)} requests "
                    f"({span:.0f} s) at {scales[kind]:g}x the trace's rate, {n} devices, "
                    f"SLO {slo.describe()}"
                )
                print(
                    f"{'run':<16} {'SLO att':>8} {'TTFT p50/p90 ms':>18} {'TPOT p50/p90 ms':>16} "
                    f"{'PD reqs':>8} {'KV GB':>7} {'inst-s':>7} {'prompt tok':>11} {'output tok':>11}"
                )
                for name, cfg in configs.items():
                    r = run(planned, {model: profile}, cfg, slo)
                    rows.append(
                        {"profile": path.name, "device": device, "window": window, "run": name, **r}
                    )
                    ttft, tpot = r["ttft_ms"], r["tpot_ms"]
                    print(
                        f"{name:<16} {100 * (r['slo_attainment'] or 0):7.1f}% "
                        f"{ttft.get('p50', 0):>8.0f} / {ttft.get('p90', 0):<7.0f} "
                        f"{tpot.get('p50', 0):>6.1f} / {tpot.get('p90', 0):<7.1f} "
                        f"{r['disaggregated']:>8} {r['kv_gb']:>7.1f} {r['instance_seconds']:>7.0f} "
                        f"{r['prompt_tokens']:>11} {r['output_tokens']:>11}"
                    )
    write_result(args.out, {"rows": rows, "argv": argv, "wall_s": time.perf_counter() - t0})


if __name__ == "__main__":
    main()
