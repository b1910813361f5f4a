"""What shadow validation itself costs (``services/job_executor/shadow.validate``): the
node pool's device arbiter plays the device's next iterations forward on its event loop,
on the cores the device's engines run on, before a TE takes a request, and no turn is
granted meanwhile. Times one validation of a new request on a device of ``--instances``
instances holding ``--requests`` (comma-separated) decoding requests each, with the
bench-sharing model's shape of performance (a decode step of 4–12 ms, 8 batch slots: the
new request waits for a slot when every slot is taken, the play's longest case).

    python -m bench.shadow_cost [--instances 8] [--requests 1,4,8] [--repeats 50] [--out DIR]

Writes ``DIR/shadow-cost.json`` (default bench-results/): per row the verdict and the
median and p90 milliseconds of a validation.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from bench.common import RESULTS, Col, Table, write_result
from services.job_executor.shadow import InstanceView, validate
from shared.headroom import RequestView
from shared.perf_model import PerfModel

PERF = PerfModel(
    prefill_lengths=[16, 4096],
    prefill_s=[0.004, 0.4],
    decode_batches=[1, 32],
    decode_contexts=[16, 4096],
    decode_s=[[0.004, 0.006], [0.008, 0.012]],
    max_num_seqs=8,
)
NOW = 100.0


def _device(instances: int, requests: int) -> list[InstanceView]:
    def held(i: int, j: int) -> RequestView:
        return RequestView(
            arrival=NOW - 1.0,
            prompt_tokens=200,
            expected_output=96,
            ttft_slo=2.0,
            tpot_slo=0.1,
            computed_tokens=200,
            output_tokens=10 + j,
            id=f"r{i}-{j}",
        )

    return [
        InstanceView(
            instance=f"i{i}",
            perf=PERF,
            requests=tuple(held(i, j) for j in range(requests)),
            max_num_seqs=8,
            max_prefill_tokens=2048,
        )
        for i in range(instances)
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.shadow_cost",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--instances", type=int, default=8)
    p.add_argument("--requests", default="1,4,8", help="decoding requests per instance")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    new = RequestView(
        arrival=NOW, prompt_tokens=200, expected_output=96, ttft_slo=2.0, tpot_slo=0.1, id="new"
    )
    table = Table(
        [
            Col("instances", "instances"),
            Col("requests", "requests each"),
            Col("verdict", "verdict", width=10, left=True),
            Col("median_ms", "median ms", ".2f"),
            Col("p90_ms", "p90 ms", ".2f"),
        ]
    )
    rows = []
    for n in (int(x) for x in args.requests.split(",")):
        device = _device(args.instances, n)
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            verdict = validate(device, "i0", new, NOW)
            times.append((time.perf_counter() - t) * 1000)
        times.sort()
        row = {
            "instances": args.instances,
            "requests": n,
            "verdict": verdict.reason or "admitted",
            "median_ms": statistics.median(times),
            "p90_ms": times[int(0.9 * (len(times) - 1))],
        }
        rows.append(row)
        table.row(row)
    write_result(
        args.out / "shadow-cost.json", {"args": vars(args) | {"out": str(args.out)}, "rows": rows}
    )


if __name__ == "__main__":
    main()
