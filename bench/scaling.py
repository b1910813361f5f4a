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

``--host-cache-ab`` runs the autoscaler's cluster twice instead, on models made distinct
(each the demo's tensors scaled by its own factor, so no two share a tensor): with the host
weight cache on (a fresh directory) and off, and compares the scale-ups' ``te_load`` (mean,
from the frontend's ``meshserve_scale_step_seconds``), the waits of the requests held while
their model came up from zero (``meshserve_held_wait_seconds``), TTFT, and the cache's hit
rate (its ``index.json``: loads that mapped a tensor over all tensor lookups).

Needs NATS and Redis (``MESHSERVE_NATS_URL`` / ``MESHSERVE_REDIS_URL``; the wrapper uses
local ones where they answer). Writes bench-results/scaling.json.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shutil
import subprocess
import sys
import tempfile
import threading
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
    floor: dict[str, int],
) -> dict[str, Any]:
    """``floor``: the instances of each model a fixed fleet loads before the trace starts."""
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
        while any(fleet.now.get(m, 0) < n for m, n in floor.items()):  # a fixed fleet first
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
        while sum(fleet.now.values()) > sum(floor.values()) and time.monotonic() < deadline:
            time.sleep(0.5)  # the autoscaler's tail: back to zero after the keep-alive
        fleet.stop()
        summary = json.loads((run_dir / "summary.json").read_text())
        return {
            "metrics": cluster.metrics(),
            "summary": summary,
            "instance_s": fleet.instance_s,
            "peak": fleet.peak,
            "peak_total": fleet.peak_total,
        }


def _distinct_copy(src: Path, dst: Path, factor: float) -> None:
    """``src``'s checkpoint with every floating-point tensor scaled by ``factor``: a model of
    the same size that shares no tensor with another (the host cache stores each once)."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors" and f.is_file():
            (dst / f.name).symlink_to(f)
    tensors = load_file(str(src / "model.safetensors"))
    scaled = {
        k: (v * factor).to(v.dtype) if v.is_floating_point() else v for k, v in tensors.items()
    }
    save_file(scaled, str(dst / "model.safetensors"))


def _histogram(
    metrics: str, name: str, **labels: str
) -> tuple[list[tuple[float, float]], float, float]:
    """A Prometheus histogram summed over series matching ``labels``: cumulative buckets
    (le, count), sum, count."""
    buckets: dict[float, float] = {}
    for line in metrics.splitlines():
        if not line.startswith(f"{name}_bucket"):
            continue
        head, _, value = line.rpartition(" ")
        have = dict(
            p.split("=", 1) for p in head.partition("{")[2].rstrip("}").split(",") if "=" in p
        )
        have = {k: v.strip('"') for k, v in have.items()}
        if all(have.get(k) == v for k, v in labels.items()):
            le = float(have["le"])
            buckets[le] = buckets.get(le, 0.0) + float(value)
    total = counter(metrics, f"{name}_sum", **labels)
    count = counter(metrics, f"{name}_count", **labels)
    return sorted(buckets.items()), total, count


def _quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The upper bound of the bucket holding quantile ``q`` (None: no sample)."""
    if not buckets or buckets[-1][1] == 0:
        return None
    for le, n in buckets:
        if n >= q * buckets[-1][1]:
            return le
    return None


def _host_cache_ab(
    args: argparse.Namespace, models: Path, trace: Path, demo: Path, work: Path
) -> None:
    rows = []
    cache_dir = _shm_dir(work, "weights")
    for config, extra in (
        ("cache on", {"HOST_CACHE_DIR": str(cache_dir)}),
        ("cache off", {"HOST_CACHE_BYTES": "0"}),
    ):
        run = _run_cluster(
            config.replace(" ", "-"), models, trace, demo, work, args.pool_size, extra, {}
        )
        text = run["metrics"]
        _, load_sum, loads = _histogram(
            text, "meshserve_scale_step_seconds", kind="up", step="te_load"
        )
        held, _, n_held = _histogram(text, "meshserve_held_wait_seconds")
        hits = lookups = 0
        if "HOST_CACHE_DIR" in extra:
            index = json.loads((Path(extra["HOST_CACHE_DIR"]) / "index.json").read_text())
            hits = sum(e["hits"] for e in index["entries"].values())
            lookups = hits + sum(e["misses"] for e in index["entries"].values())
        rows.append(
            _row(config, run["summary"], run["instance_s"], run["peak_total"])
            | {
                "scale_ups": loads,
                "te_load_ms": 1000 * load_sum / loads if loads else None,
                "held": n_held,
                "held_p50": _quantile(held, 0.5),
                "held_p90": _quantile(held, 0.9),
                "hit_rate": 100 * hits / lookups if lookups else None,
            }
        )
    table = Table(
        [
            Col("config", "config", width=10, left=True),
            Col("requests", "reqs"),
            Col("prompt_tokens", "prompt tok"),
            Col("output_tokens", "output tok"),
            Col("scale_ups", "loads", ".0f"),
            Col("te_load_ms", "te_load mean ms", ".1f"),
            Col("held", "held", ".0f"),
            Col("held_p50", "held wait p50 s (<=)", ".2f"),
            Col("held_p90", "held wait p90 s (<=)", ".2f"),
            Col("ttft_p90", "TTFT p90 ms", ".0f"),
            Col("slo", "SLO %", ".1f"),
            Col("hit_rate", "cache hits %", ".1f"),
        ]
    )
    shutil.rmtree(cache_dir, ignore_errors=True)
    table.print(rows, title=f"host weight cache on and off, {args.models} distinct models")
    write_result(args.out, {"args": vars(args) | {"out": str(args.out)}, "settings": SCALING,
                            "rows": rows, "work_dir": str(work)})  # fmt: skip


def _shm_dir(work: Path, name: str) -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else work
    return Path(tempfile.mkdtemp(prefix=f"meshserve-bench-{name}-", dir=base))


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
    p.add_argument(
        "--host-cache-ab",
        action="store_true",
        help="the autoscaler with the host weight cache on and off, on distinct models",
    )
    p.add_argument("--out", type=Path, default=RESULTS / "scaling.json")
    args = p.parse_args(argv)
    LOG_LEVEL[0] = args.log_level

    demo = ensure_model("demo", models_dir())
    work = Path(tempfile.mkdtemp(prefix="bench-scaling-"))
    models = work / "models"
    models.mkdir()
    names = [f"m{i}" for i in range(args.models)]
    for i, n in enumerate(names):
        if args.host_cache_ab:
            _distinct_copy(demo, models / n, 1.0 + (i + 1) / 1024)
        else:
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

    if args.host_cache_ab:
        _host_cache_ab(args, models, trace, demo, work)
        return
    auto = _run_cluster("autoscaler", models, trace, demo, work, args.pool_size, {}, {})
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
        peaks,
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
