"""Where PD disaggregation pays for one model on one fleet (DeepServe §4.5's heat map),
measured with ``meshserve-loadgen simulate``'s cluster (the project's own routing, PD rule,
scaler and batch scheduler over the model's profiled costs).

Each cell is a workload of identical requests: an uncached prompt of ``p`` tokens, ``r·p``
output tokens, Poisson arrivals at ``u`` of the colocated fleet's capacity (the scaler's own
instance-seconds rule). It runs twice per PD split: colocated (``devices`` instances, PD
never), and disaggregated (``devices − k`` instances beside up to ``k`` prefill instances
the scaler loads, PD always), for each ``k`` in ``--prefill``. The cell's gain is the best
split's SLO attainment minus the colocated one's, over the requests after the warm-up; where
they are within ``TIE`` (one point), PD's TPOT p90 improvement (1 − PD's ÷ colocated's,
-1..1) scaled into that band: at the same attainment, the run whose tokens come steadier
wins, by 10% or more (what disaggregation is for). The rate axis is the arrival rate per instance of the model (all roles), as the job executor
measures it.

Prints one table per load level (rows: prompt tokens, columns: output/prompt ratio), writes
bench-results/pd-heatmap.json (the table ``MESHSERVE_PD_HEATMAP`` reads, and every run's
attainments) and pd-heatmap.png.

    python -m bench.pd_heatmap [--profile FILE] [--devices 4] [--duration 120] ...
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, write_result
from loadgen.costmodel import DEFAULT_PROFILE, EngineProfile, load_profiles
from loadgen.plan import plan
from loadgen.results import Result
from loadgen.simulator import SimConfig, simulate
from loadgen.stats import percentile
from loadgen.traces import TraceRequest
from services.job_executor.disaggregation import PdConfig
from services.job_executor.pd_heatmap import PdHeatmap, save
from shared.slo import SLO, parse_slo

OUT = ROOT / "bench-results"


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def requests_per_s(profile: EngineProfile, prompt: int, output: int, load: float, n: int) -> float:
    """Arrivals at ``load`` of ``n`` colocated instances' capacity, by the scaler's rule
    (``services/scaler/target.py``: prompt tokens at the prefill rate of the prompt, output
    tokens at the decode rate of the mean context)."""
    cap = profile.capacity()
    work = prompt / cap.prefill_tokens_per_s(prompt) + output / cap.decode_tokens_per_s(
        prompt + output // 2
    )
    return load * n / work


def workload(
    prompt: int, output: int, rate: float, duration: float, seed: int
) -> list[TraceRequest]:
    rng = random.Random(seed)
    t, out = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        out.append(TraceRequest(arrival_s=t, input_tokens=prompt, output_tokens=output))


TIE = 0.01  # attainments this close are equal: TPOT decides
MIN_TPOT_GAIN = 0.1  # and a TPOT p90 within 10% of the other's is the same too


def score(results: list[Result], slo: SLO, warmup_s: float) -> tuple[float, float]:
    """SLO attainment and TPOT p90 (seconds) of the requests after the warm-up."""
    measured = [r for r in results if r.scheduled_s >= warmup_s]
    met = [
        slo.met(ok=r.ok, input_tokens=r.input_tokens, ttft_s=r.ttft_s, tpot_s=r.tpot_s)
        for r in measured
    ]
    tpots = [t for r in measured if (t := r.tpot_s) is not None]
    return (sum(met) / len(met) if met else 0.0), (percentile(tpots, 90) if tpots else 0.0)


def gain(pd: tuple[float, float], colocated: tuple[float, float]) -> float:
    """PD's attainment over colocated's; within ``TIE``, its TPOT p90 gain in that band
    (0 where the TPOTs are within ``MIN_TPOT_GAIN`` of each other: a tie)."""
    delta = pd[0] - colocated[0]
    if abs(delta) > TIE or not colocated[1]:
        return delta
    tpot = 1.0 - pd[1] / colocated[1]
    return TIE * max(-1.0, min(1.0, tpot)) if abs(tpot) >= MIN_TPOT_GAIN else 0.0


def run_cell(
    profile: EngineProfile,
    args: argparse.Namespace,
    prompt: int,
    ratio: float,
    load: float,
) -> dict[str, Any]:
    output = max(2, round(prompt * ratio))
    n = args.devices
    rate = requests_per_s(profile, prompt, output, load, n)
    reqs = workload(prompt, output, rate, args.duration, seed=args.seed)
    planned = plan(reqs, model=profile.model)
    base = SimConfig(
        devices=n,
        pool_size=n,
        keep_alive_s=args.duration,
        kv_bandwidth=args.kv_bandwidth,
        max_queued_per_slot=0,  # every request served, late or not: attainment says how
        record_gaps=False,
    )
    profiles = {profile.model: profile}
    colocated, _ = simulate(
        planned,
        profiles,
        dataclasses.replace(base, min_replicas=n, max_replicas=n, pd=PdConfig(mode="never")),
    )
    base_score = score(colocated, args.slo, args.warmup)
    row: dict[str, Any] = {
        "prompt_tokens": prompt,
        "output_tokens": output,
        "output_ratio": ratio,
        "load": load,
        "requests": len(planned),
        "rate_per_instance": rate / n,
        "colocated": base_score[0],
        "colocated_tpot_p90_s": base_score[1],
        "pd": {},
    }
    for k in args.prefill:
        results, stats = simulate(
            planned,
            profiles,
            dataclasses.replace(
                base,
                min_replicas=n - k,
                max_replicas=n - k,
                max_prefill_replicas=k,
                pd=PdConfig(mode="always"),
            ),
        )
        att, tpot = score(results, args.slo, args.warmup)
        row["pd"][k] = {
            "attainment": att,
            "tpot_p90_s": tpot,
            "gain": gain((att, tpot), base_score),
            "disaggregated": stats.disaggregated,
        }
    row["gain"] = max(v["gain"] for v in row["pd"].values())  # the best split's
    return row


def plot(path: Path, heatmap: PdHeatmap, loads: list[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(loads), figsize=(4 * len(loads), 3.6), squeeze=False)
    for ax, load, grid in zip(axes[0], loads, heatmap.gain, strict=True):
        im = ax.imshow(grid, cmap="RdBu", vmin=-1, vmax=1, origin="lower", aspect="auto")
        ax.set_xticks(range(len(heatmap.output_ratio)), [f"{r:g}" for r in heatmap.output_ratio])
        ax.set_yticks(range(len(heatmap.prompt_tokens)), [str(p) for p in heatmap.prompt_tokens])
        ax.set_xlabel("output / prompt")
        if ax is axes[0][0]:
            ax.set_ylabel("uncached prompt tokens")
        ax.set_title(f"load {load:g} of colocated capacity")
        for j, row in enumerate(grid):
            for k, g in enumerate(row):
                ax.text(k, j, f"{g:+.3f}", ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=axes[0].tolist(), label="SLO attainment, PD − colocated")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--profile", type=Path, default=DEFAULT_PROFILE)
    ap.add_argument("--model", help="the profile's model (default: its only one)")
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--prefill", default="1,2", help="PD splits to try: prefill instances")
    ap.add_argument("--prompts", default="512,1024,2048,4096,8192")
    ap.add_argument("--ratios", default="0.03125,0.125,0.5")
    ap.add_argument("--loads", default="0.3,0.6,0.9", help="of the colocated fleet's capacity")
    ap.add_argument("--duration", type=float, default=120.0, help="simulated seconds a cell")
    ap.add_argument("--warmup", type=float, default=30.0, help="seconds not measured")
    ap.add_argument("--kv-bandwidth", type=float, default=1.25e9, help="bytes/s (10 Gb/s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slo", help="e.g. 'ttft=500ms,ttft_per_token=1/16384,tpot=25ms'")
    ap.add_argument("--out", type=Path, default=OUT / "pd-heatmap.json")
    args = ap.parse_args(argv)
    args.prefill = [int(k) for k in _floats(args.prefill)]
    args.slo = parse_slo(args.slo) if args.slo else SLO()
    profiles = load_profiles(args.profile)
    profile = profiles[args.model] if args.model else next(iter(profiles.values()))
    if not profile.kv_bytes_per_token:
        raise SystemExit(f"{profile.model}: its engine moves no KV (kv_bytes_per_token 0)")
    prompts = [int(p) for p in _floats(args.prompts)]
    ratios, loads = _floats(args.ratios), _floats(args.loads)
    t0 = time.perf_counter()
    rows = []
    gain: list[list[list[float]]] = []
    rates: list[float] = []
    for load in loads:
        grid = []
        print(
            f"\nload {load:g} of {args.devices} colocated instances' capacity: SLO attainment "
            "PD − colocated (PD's best split)"
        )
        print(f"{'prompt':>8} " + " ".join(f"{'o/p ' + format(r, 'g'):>12}" for r in ratios))
        for p in prompts:
            cells = [run_cell(profile, args, p, r, load) for r in ratios]
            rows += cells
            grid.append([c["gain"] for c in cells])
            print(f"{p:>8} " + " ".join(f"{c['gain']:+7.3f} ({c['colocated']:.2f})" for c in cells))
        gain.append(grid)
        # The rate axis: the median cell's rate per instance at this load (cells of one
        # load differ in rate; the JE looks the rate up against these steps).
        per = sorted(c["rate_per_instance"] for c in rows if c["load"] == load)
        rates.append(per[len(per) // 2])
    order = sorted(range(len(loads)), key=lambda i: rates[i])
    heatmap = PdHeatmap(
        prompt_tokens=tuple(prompts),
        output_ratio=tuple(ratios),
        rate=tuple(rates[i] for i in order),
        gain=tuple(tuple(tuple(r) for r in gain[i]) for i in order),
        source={
            "profile": str(args.profile),
            "model": profile.model,
            "devices": args.devices,
            "prefill_splits": args.prefill,
            "loads": loads,
            "duration_s": args.duration,
            "kv_bandwidth": args.kv_bandwidth,
            "slo": args.slo.to_json(),
            "measured_at": time.strftime("%Y-%m-%d %H:%M"),
        },
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save(args.out, {profile.model: heatmap})
    plot(args.out.with_suffix(".png"), heatmap, [loads[i] for i in order])
    write_result(
        args.out.with_name(args.out.stem + "-runs.json"),
        {
            "cells": rows,
            "heatmap": heatmap.to_json(),
            "wall_s": time.perf_counter() - t0,
        },
    )
    print(
        f"\nheat map: {args.out} (MESHSERVE_PD_HEATMAP), {args.out.with_suffix('.png')}; "
        f"{time.perf_counter() - t0:.0f} s"
    )


if __name__ == "__main__":
    main()
