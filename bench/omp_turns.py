"""OpenMP spinning between device turns: processes that run torch iterations one at a time
(as a node pool's TEs take turns, ``device_arbiter.py``), under libgomp's default spin count
and under others (``MESHSERVE_TURN_SPIN_COUNT`` sets ``GOMP_SPINCOUNT`` for TEs that take
turns). An iteration is a decode step of the Qwen2-0.5B shape's matrices (24 layers, a
batch of 8, bf16), on torch's default threads (every core).

With libgomp's default a process's threads spin for milliseconds after its iteration ends,
on the cores the next process's turn runs on; a spin count too small makes the threads sleep
between the operations of one iteration. Per-iteration time, the turns passed through pipes:

    python -m bench.omp_turns [--spins default,10000,1000] [--processes 1,2,4] [--iters 120]

Writes bench-results/omp-turns.json.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, host_info, write_result
from shared.settings import process_environment

WARMUP = 3


def _worker(read_fd: int, write_fd: int) -> None:
    import torch

    x = torch.randn(8, 896, dtype=torch.bfloat16)
    layers = [
        (
            torch.randn(896, 4864, dtype=torch.bfloat16),
            torch.randn(4864, 896, dtype=torch.bfloat16),
            torch.randn(896, 1152, dtype=torch.bfloat16),
        )
        for _ in range(24)
    ]

    def step() -> None:
        h = x
        for up, down, qkv in layers:
            h = h + torch.nn.functional.silu(h @ up) @ down
            h @ qkv  # the attention's projections: computed, not used

    for _ in range(WARMUP):
        step()
    with os.fdopen(read_fd, "rb", 0) as r, os.fdopen(write_fd, "wb", 0) as w:
        w.write(b"r")  # ready
        while r.read(1) == b"g":
            step()
            w.write(b"t")


def _run(spin: str, processes: int, iters: int) -> float:
    """Milliseconds an iteration, ``processes`` taking turns, under ``spin``."""
    env = process_environment(pythonpath=[ROOT])
    env.pop("GOMP_SPINCOUNT", None)
    env.pop("OMP_WAIT_POLICY", None)
    if spin != "default":
        env["GOMP_SPINCOUNT"] = spin
    pipes, procs = [], []
    try:
        for _ in range(processes):
            go_r, go_w = os.pipe()
            back_r, back_w = os.pipe()
            argv = [sys.executable, "-m", "bench.omp_turns", "--worker", f"{go_r},{back_w}"]
            procs.append(subprocess.Popen(argv, env=env, pass_fds=(go_r, back_w), cwd=ROOT))
            os.close(go_r)
            os.close(back_w)
            pipes.append((go_w, back_r))
        for _, back in pipes:
            if os.read(back, 1) != b"r":
                raise RuntimeError("a worker died while starting")
        time.sleep(0.1)
        started = time.perf_counter()
        for i in range(iters):
            go, back = pipes[i % processes]
            os.write(go, b"g")
            if os.read(back, 1) != b"t":
                raise RuntimeError("a worker died")
        return 1000 * (time.perf_counter() - started) / iters
    finally:
        for go, back in pipes:
            os.write(go, b"q")
            os.close(go)
            os.close(back)
        for p in procs:
            p.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--spins", default="default,10000,1000", help="GOMP_SPINCOUNT values")
    ap.add_argument("--processes", default="1,2,4")
    ap.add_argument("--iters", type=int, default=120)
    ap.add_argument("--out", type=Path, default=ROOT / "bench-results" / "omp-turns.json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        read_fd, write_fd = (int(x) for x in args.worker.split(","))
        _worker(read_fd, write_fd)
        return 0
    spins = args.spins.split(",")
    counts = [int(n) for n in args.processes.split(",")]
    rows: list[dict[str, Any]] = []
    print(f"{'GOMP_SPINCOUNT':>15}" + "".join(f"{f'{n} taking turns ms':>20}" for n in counts))
    for spin in spins:
        row = {"spin": spin, "ms": {n: _run(spin, n, args.iters) for n in counts}}
        rows.append(row)
        print(f"{spin:>15}" + "".join(f"{row['ms'][n]:>20.1f}" for n in counts))
    write_result(args.out, {"host": host_info(), "when": time.time(), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
