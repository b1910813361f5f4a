"""Autoscaling on a bursty many-model trace, three ways, the same requests in one run:

- ``autoscaler``: a local cluster (``meshserve up``) with two node pools (the second one
  ``meshserve task-executor --pool-id``), every model scaled by the scaler from zero;
- ``fixed``: the same cluster with each model pinned at the autoscaler's peak replica count
  (``MESHSERVE_MODEL_SCALING`` min = max), a fleet sized for the peak;
- ``ideal``: ``meshserve-loadgen simulate --compare-ideal`` on the same trace with the demo
  model's profile: the same policy with instances that load instantly (λScale's ideal).

The trace is ``meshserve-loadgen synth``: ``--models`` models of the demo's size, each a
Gamma arrival process with ``--cv`` (bursty). Instance-seconds are integrated from the
cluster's ``/health`` (TEs holding a model, loading, ready or draining) from the first
request until the fleet is back at its floor. Settings are shortened for a run of minutes
(keep-alive, windows) and printed.

    scripts/bench-scaling [--duration 120] [--models 4] [--rate 0.4] [--cv 4]

Needs NATS and Redis (``MESHSERVE_NATS_URL`` / ``MESHSERVE_REDIS_URL``; the wrapper uses
local ones where they answer). Writes bench-results/scaling.json.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.cluster import LocalCluster, instances
from bench.common import (
    RESULTS,
    ROOT,
    Col,
    Table,
    ensure_model,
    models_dir,
    replay_row,
    write_result,
)
from loadgen.costmodel import load_profiles, save_profiles

SCALING = {  # shortened so that a run of minutes shows scale-out, scale-in and zero
    "KEEP_ALIVE": "10",
    "STABLE_WINDOW": "20",
    "PANIC_WINDOW": "3",
    "MAX_NUM_SEQS": "4",
    "TORCH_THREADS": "1",
    "HEARTBEAT_INTERVAL": "0.5",
}
LOG_LEVEL = ["warning"]  # the clusters' (--log-level)
PREWARM_S = 5.0  # a cluster's TEs import their engine as they start: the trace starts after


class Fleet:
    """Samples ``/health``: instance-seconds and each model's peak instance count."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.instance_s = 0.0
        self.peak: dict[str, int] = {}  # each model's own peak
        self.peak_total = 0  # instances at once, all models
        self.now: dict[str, int] = {}
        self.tes = 0  # TEs in the cluster
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Fleet:
        self._thread.start()
        return self

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.is_set():
            with contextlib.suppress(OSError, ValueError):
                body = self.cluster.health()
                counts = instances(body, ("loading", "ready", "draining"))
                now = time.monotonic()
                self.instance_s += sum(counts.values()) * (now - last)
                last = now
                self.now = counts
                self.tes = len(body["task_executors"])
                self.peak_total = max(self.peak_total, sum(counts.values()))
                for m, n in counts.items():
                    self.peak[m] = max(self.peak.get(m, 0), n)
            time.sleep(0.25)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _run_cluster(
    name: str,
    models: Path,
    trace: Path,
    tokenizer: Path,
    out: Path,
    pool_size: int,
    extra: dict[str, str],
    floor: int,
) -> dict[str, Any]:
    with LocalCluster(
        name,
        models,
        pool_size=pool_size,
        settings={**SCALING, **extra},
        log=out / f"{name}.log",
        second_pool=True,
        log_level=LOG_LEVEL[0],
    ) as cluster:
        fleet = Fleet(cluster).start()
        deadline = time.monotonic() + 300
        while fleet.tes < 2 * pool_size:  # both pools joined
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: {fleet.tes} of {2 * pool_size} TEs joined")
            time.sleep(0.5)
        time.sleep(PREWARM_S)  # each TE pre-warms its engine (imports) once it starts
        while sum(fleet.now.values()) < floor or any(  # a fixed fleet loads first
            n < floor // max(len(fleet.now), 1) for n in fleet.now.values()
        ):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: the fleet did not load: {fleet.now}")
            time.sleep(0.5)
        fleet.instance_s = 0.0
        run_dir = out / name
        subprocess.run(
            [sys.executable, "-m", "loadgen.cli", "replay", str(trace), "--url", cluster.url,
             "--tokenizer", str(tokenizer), "--no-plots", "--out", str(run_dir)],
            check=True,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while sum(fleet.now.values()) > floor and time.monotonic() < deadline:
            time.sleep(0.5)  # the autoscaler's tail: back to zero after the keep-alive
        fleet.stop()
        summary = json.loads((run_dir / "summary.json").read_text())
        return {
            "summary": summary,
            "instance_s": fleet.instance_s,
            "peak": fleet.peak,
            "peak_total": fleet.peak_total,
        }


def _row(config: str, summary: dict[str, Any], instance_s: float, peak: int) -> dict[str, Any]:
    return replay_row(config, summary) | {"instance_s": instance_s, "peak": peak}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="scripts/bench-scaling",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--models", type=int, default=4, help="models of the demo's size")
    p.add_argument("--rate", type=float, default=0.4, help="mean requests/s per model")
    p.add_argument("--cv", type=float, default=4.0, help="burstiness of each model's arrivals")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of trace")
    p.add_argument("--pool-size", type=int, default=4, help="TEs per node pool (two pools)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--log-level",
        default="warning",
        help="the clusters' log level (info: every scale event with its steps, in WORK/*.log)",
    )
    p.add_argument(
        "--autoscaler-only", action="store_true", help="run the autoscaler's cluster alone"
    )
    p.add_argument("--out", type=Path, default=RESULTS / "scaling.json")
    args = p.parse_args(argv)
    LOG_LEVEL[0] = args.log_level

    demo = ensure_model("demo", models_dir())
    work = Path(tempfile.mkdtemp(prefix="bench-scaling-"))
    models = work / "models"
    models.mkdir()
    names = [f"m{i}" for i in range(args.models)]
    for n in names:
        (models / n).symlink_to(demo)
    trace = work / "trace.jsonl"
    spec = ",".join(f"{n}:{args.rate}:{args.cv}" for n in names)
    subprocess.run(
        [sys.executable, "-m", "loadgen.cli", "synth", "--models", spec, "--duration",
         str(args.duration), "--input-tokens", "200", "--output-tokens", "96",
         "--seed", str(args.seed), "--out", str(trace)],
        check=True,
        cwd=ROOT,
    )  # fmt: skip
    n_req = sum(1 for _ in trace.open())
    print(f"trace: {n_req} requests over {args.duration:g} s, {args.models} models, "
          f"CV {args.cv:g}; settings {SCALING}", flush=True)  # fmt: skip

    auto = _run_cluster("autoscaler", models, trace, demo, work, args.pool_size, {}, 0)
    if args.autoscaler_only:
        row = _row("autoscaler", auto["summary"], auto["instance_s"], auto["peak_total"])
        print(json.dumps(row | {"work_dir": str(work)}, indent=1))
        return
    peaks = {n: max(auto["peak"].get(n, 1), 1) for n in names}
    while sum(peaks.values()) > 2 * args.pool_size:  # models peaked at different times
        top = max(peaks, key=lambda n: peaks[n])
        peaks[top] -= 1
    pinned = {n: {"min_replicas": k, "max_replicas": k} for n, k in peaks.items()}
    fixed = _run_cluster(
        "fixed",
        models,
        trace,
        demo,
        work,
        args.pool_size,
        {"MODEL_SCALING": json.dumps(pinned)},
        sum(peaks.values()),
    )
    ideal_dir = work / "ideal"
    # The demo model's profile with the clusters' batch limit.
    profile = load_profiles(ROOT / "loadgen" / "profiles" / "demo-torch-cpu.json")["demo"]
    save_profiles(
        work / "profile.json",
        [dataclasses.replace(profile, max_num_seqs=int(SCALING["MAX_NUM_SEQS"]))],
    )
    subprocess.run(
        [sys.executable, "-m", "loadgen.cli", "simulate", str(trace), "--profile",
         str(work / "profile.json"), "--profile-for", "demo",
         "--stable-window", SCALING["STABLE_WINDOW"], "--panic-window", SCALING["PANIC_WINDOW"],
         "--devices", str(2 * args.pool_size), "--pool-size", str(args.pool_size),
         "--models-map", ",".join(f"{n}={n}" for n in names),
         "--keep-alive", SCALING["KEEP_ALIVE"], "--compare-ideal", "--no-plots",
         "--out", str(ideal_dir)],
        check=True,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    sim = json.loads((ideal_dir / "summary.json").read_text())
    ideal = sim["run"]["ideal"]
    ideal_summary = {**sim, **ideal["summary"]}
    rows = [
        _row("autoscaler", auto["summary"], auto["instance_s"], auto["peak_total"]),
        _row("fixed (peak)", fixed["summary"], fixed["instance_s"], fixed["peak_total"]),
        _row(
            "ideal (sim)",
            ideal_summary,
            ideal["stats"]["instance_seconds"],
            ideal["stats"]["max_busy_devices"],
        ),
    ]
    table = Table(
        [
            Col("config", "config", width=14, left=True),
            Col("requests", "reqs"),
            Col("prompt_tokens", "prompt tok"),
            Col("output_tokens", "output tok"),
            Col("instance_s", "inst-s", ".0f"),
            Col("ttft_p50", "TTFT p50 ms", ".0f"),
            Col("ttft_p90", "TTFT p90 ms", ".0f"),
            Col("tpot_p90", "TPOT p90 ms", ".0f"),
            Col("slo", "SLO %", ".1f"),
            Col("goodput", "goodput/s", ".2f"),
            Col("failed", "failed"),
            Col("peak", "peak at once"),
        ]
    )
    table.print(rows, title=f"autoscaling, {args.models} models, CV {args.cv:g}")
    a, f, i = (r["instance_s"] for r in rows)
    print(f"\nautoscaler/ideal instance-seconds {a / i:.2f}x, autoscaler/fixed {a / f:.2f}x")
    write_result(args.out, {"args": vars(args) | {"out": str(args.out)}, "settings": SCALING,
                            "rows": rows, "work_dir": str(work)})  # fmt: skip


if __name__ == "__main__":
    main()
