"""Many models on one device (LLM-Mesh), three ways, the same requests in one run:

- ``exclusive``: one TE on the host's cores, so one model at a time holds the device; a
  model with requests waiting is loaded when the one before has been idle for the
  keep-alive (ServerlessLLM's one instance per model at a time, with its concurrency
  threshold as the batch limit);
- ``uncoordinated``: one TE per model, every model loaded, their processes competing for
  the cores (meshserve without device turns: what it did before);
- ``turns``: the same, with the pool's device turns (earliest deadline first);
- ``full``: the same, with shadow validation too before a TE takes a request;
- ``full-kv`` (not in the default run): ``full`` with each TE's KV pool sized by demand
  (``MESHSERVE_KV_SIZING``, shrunk after 10 s).

Every row also has the TE processes' resident memory, summed, sampled every half second
(``te_rss_mean_mib``, ``te_rss_peak_mib``): what KV sized by demand gives back; and what
the node pool's device arbiter counted (its ``/metrics``): the turns it granted, those
granted late, and its shadow validations by outcome (``checks``: admitted, late, pushes,
tpot), so a config's refusals can be told apart.

Models are ``--models`` copies of the demo model, each its own model with tensors of its own
(scaled copies: the host cache shares none). The trace is ``meshserve-loadgen synth``: each
model a Gamma arrival process with ``--cv`` (bursty). Service capacity is the number of
requests that met the SLO (``MESHSERVE_SLO_*``, LLM-Mesh's by default); the ratios
``full_vs_exclusive`` and ``full_vs_uncoordinated`` are of those numbers.

    scripts/bench-sharing [--models 8] [--rate 0.5] [--cv 4] [--duration 120] [--out DIR]

Needs NATS and Redis (the wrapper uses local ones where they answer). Writes
``DIR/sharing.json`` (default bench-results/).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.cluster import LocalCluster, counter
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
from bench.scaling import Fleet, _distinct_copy
from devtools.procs import module_of, processes_of, rss_bytes
from services.launcher import metrics_port as service_metrics_port
from shared.embedded import free_port
from shared.settings import process_environment

COMMON = {
    "MAX_NUM_SEQS": "8",
    "TORCH_THREADS": "0",  # each TE's iterations use every core: the device is shared
    "HEARTBEAT_INTERVAL": "0.5",
    "STABLE_WINDOW": "20",
    "PANIC_WINDOW": "3",
}
CONFIGS: dict[str, dict[str, str]] = {
    "exclusive": {"KEEP_ALIVE": "2", "DEVICE_TURNS": "0"},
    "uncoordinated": {"DEVICE_TURNS": "0", "SHADOW_ADMISSION": "0"},
    "turns": {"DEVICE_TURNS": "1", "SHADOW_ADMISSION": "0"},
    "full": {"DEVICE_TURNS": "1", "SHADOW_ADMISSION": "1"},
    "full-kv": {
        "DEVICE_TURNS": "1",
        "SHADOW_ADMISSION": "1",
        "KV_SIZING": "1",
        "KV_SHRINK_AFTER": "10",
    },
}
DEFAULT_CONFIGS = ("exclusive", "uncoordinated", "turns", "full")


class TeMemory:
    """The resident memory of a cluster's TE processes, summed, every ``every_s``."""

    def __init__(self, cluster: str, every_s: float = 0.5) -> None:
        self.cluster, self.every_s = cluster, every_s
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> TeMemory:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            pids = processes_of(self.cluster)
            tes = [p for p in pids if module_of(p) == "services.task_executor.worker"]
            self.samples.append(sum(rss_bytes(p) for p in tes))

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        mib = [s / 2**20 for s in self.samples] or [0.0]
        return {"te_rss_mean_mib": statistics.fmean(mib), "te_rss_peak_mib": max(mib)}


PREWARM_S = 5.0


def _run(
    name: str, models: Path, names: list[str], trace: Path, tokenizer: Path, work: Path
) -> dict[str, Any]:
    shared = name != "exclusive"
    metrics_port = free_port()  # each service its own: the base, then the next ones
    settings = {**COMMON, **CONFIGS[name], "METRICS_PORT": str(metrics_port)}
    if shared:  # every model loaded from the start, one instance each
        pinned = {n: {"min_replicas": 1, "max_replicas": 1} for n in names}
        settings["MODEL_SCALING"] = json.dumps(pinned)
    with LocalCluster(
        name,
        models,
        pool_size=len(names) if shared else 1,
        settings=settings,
        log=work / f"{name}.log",
    ) as cluster:
        fleet = Fleet(cluster).start()
        deadline = time.monotonic() + 600
        want = len(names) if shared else 0
        while sum(fleet.now.values()) < want or fleet.tes < (len(names) if shared else 1):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: the fleet did not come up: {fleet.now}")
            time.sleep(0.5)
        time.sleep(PREWARM_S)
        fleet.instance_s = 0.0
        memory = TeMemory(cluster.cluster).start()
        run_dir = work / name
        subprocess.run(
            [sys.executable, "-m", "loadgen.cli", "replay", str(trace), "--url", cluster.url,
             "--tokenizer", str(tokenizer), "--no-plots", "--out", str(run_dir)],
            check=True,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        fleet.stop()
        rss = memory.stop()
        summary = json.loads((run_dir / "summary.json").read_text())
        return {
            "summary": summary,
            "instance_s": fleet.instance_s,
            "metrics": cluster.metrics(),
            **_arbiter(service_metrics_port(metrics_port, "task_executor")),
            **rss,
        }


def _arbiter(port: int) -> dict[str, Any]:
    """What the node pool's device arbiter counted, from its ``/metrics`` (empty where it
    could not be read: its port was taken, say)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    outcomes = ("admitted", "late", "pushes", "tpot")
    checks = {
        o: int(counter(text, "meshserve:device_admission_checks", outcome=o)) for o in outcomes
    }
    return {
        "turns": int(counter(text, "meshserve:device_turns")),
        "late_turns": int(counter(text, "meshserve:device_late_turns")),
        "checks": checks,
    }


def _met(summary: dict[str, Any]) -> int:
    return round((summary.get("slo_attainment") or 0.0) * (summary.get("requests") or 0))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="scripts/bench-sharing",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--models", type=int, default=8, help="copies of the demo model")
    p.add_argument("--rate", type=float, default=0.5, help="mean requests/s per model")
    p.add_argument("--cv", type=float, default=4.0, help="burstiness of each model's arrivals")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of trace")
    p.add_argument("--input-tokens", type=int, default=200)
    p.add_argument("--output-tokens", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--configs",
        default=",".join(DEFAULT_CONFIGS),
        help=f"which of {', '.join(CONFIGS)}, in this order",
    )
    p.add_argument("--out", type=Path, default=RESULTS, help="directory of sharing.json")
    args = p.parse_args(argv)

    demo = ensure_model("demo", models_dir())
    work = Path(tempfile.mkdtemp(prefix="bench-sharing-"))
    models = work / "models"
    models.mkdir()
    names = [f"m{i}" for i in range(args.models)]
    for i, n in enumerate(names):
        _distinct_copy(demo, models / n, 1.0 + (i + 1) / 1024)
    # The performance model, measured once for all (the copies share the architecture) with
    # the clusters' settings, so that no load measures it.
    env = process_environment({f"MESHSERVE_{k}": v for k, v in COMMON.items()})
    subprocess.run(
        [sys.executable, "-m", "services.cli", "profile", str(models / names[0])],
        check=True,
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
    )
    trace = work / "trace.jsonl"
    spec = ",".join(f"{n}:{args.rate}:{args.cv}" for n in names)
    subprocess.run(
        [sys.executable, "-m", "loadgen.cli", "synth", "--models", spec, "--duration",
         str(args.duration), "--input-tokens", str(args.input_tokens), "--output-tokens",
         str(args.output_tokens), "--seed", str(args.seed), "--out", str(trace)],
        check=True,
        cwd=ROOT,
    )  # fmt: skip
    n_req = sum(1 for _ in trace.open())
    print(
        f"trace: {n_req} requests over {args.duration:g} s, {args.models} models, "
        f"CV {args.cv:g}; settings {COMMON}",
        flush=True,
    )
    rows, runs = [], {}
    for name in args.configs.split(","):
        t0 = time.monotonic()
        runs[name] = _run(name, models, names, trace, demo, work)
        row = replay_row(name, runs[name]["summary"])
        row["met"] = _met(runs[name]["summary"])
        row["instance_s"] = runs[name]["instance_s"]
        row["te_rss_mean_mib"] = runs[name]["te_rss_mean_mib"]
        row["te_rss_peak_mib"] = runs[name]["te_rss_peak_mib"]
        for key in ("turns", "late_turns", "checks"):
            if key in runs[name]:
                row[key] = runs[name][key]
        checks = row.get("checks", {})
        row["refused"] = sum(v for k, v in checks.items() if k != "admitted")
        rows.append(row)
        print(f"{name}: {time.monotonic() - t0:.0f} s, {row['met']} met the SLO", flush=True)
    table = Table(
        [
            Col("config", "config", width=14, left=True),
            Col("requests", "reqs"),
            Col("prompt_tokens", "prompt tok"),
            Col("output_tokens", "output tok"),
            Col("met", "met SLO"),
            Col("slo", "SLO %", ".1f"),
            Col("ttft_p50", "TTFT p50 ms", ".0f"),
            Col("ttft_p90", "TTFT p90 ms", ".0f"),
            Col("tpot_p90", "TPOT p90 ms", ".0f"),
            Col("failed", "failed"),
            Col("refused", "refused"),
            Col("late_turns", "late turns"),
            Col("te_rss_mean_mib", "TE RSS mean MiB", ".0f"),
            Col("te_rss_peak_mib", "peak MiB", ".0f"),
        ]
    )
    table.print(rows, title=f"{args.models} models sharing one CPU, CV {args.cv:g}")
    met = {r["config"]: r["met"] for r in rows}
    ratios = {}
    if "full" in met:
        for other in ("exclusive", "uncoordinated", "turns"):
            if other in met:
                ratios[f"full_vs_{other}"] = met["full"] / max(1, met[other])
    rss = {r["config"]: r["te_rss_mean_mib"] for r in rows}
    if "full" in rss and "full-kv" in rss:
        ratios["kv_sizing_rss_ratio"] = rss["full-kv"] / max(1e-9, rss["full"])
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    write_result(
        args.out / "sharing.json",
        {
            "args": vars(args) | {"out": str(args.out)},
            "settings": {"common": COMMON, "configs": CONFIGS},
            "rows": rows,
            **ratios,
            "work_dir": str(work),
        },
    )


if __name__ == "__main__":
    main()
