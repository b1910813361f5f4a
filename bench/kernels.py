"""The torch engine's CPU kernel choices, each beside the alternative it replaced, in one run.

Decode attention (per dtype, batch and context): meshserve's C kernel reading the paged
cache in place (``cpu_kernels.py``) against the torch path the engine falls back to (gather
the blocks with ``index_select``, then ``scaled_dot_product_attention`` with the additive
mask, built once per forward as the model does, outside the timing). Qwen2-0.5B's attention
shape (14 query heads, 2 K/V heads, head size 64), 16-token blocks scattered over the cache,
context lengths staggered by 37 tokens below the nominal one. Per layer, median of --reps
alternating runs; the largest difference between the two outputs is reported.

Weight packing (per dtype oneDNN packs, and batch): one decode step's matmuls of the
Qwen2-0.5B-shaped model (24 layers of qkv, o, gate_up, down, each layer's weights distinct so
nothing stays in cache), with weights packed for oneDNN at batch hint 1 and at
``linear.PACK_BATCH_HINT``, and plain ``F.linear``; median of --reps alternating runs.

  scripts/bench-kernels [--reps 15] [--out bench-results/kernels.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.common import RESULTS, Col, Table, write_result
from devtools.kernel_cases import decode_case
from services.task_executor.engines.torch_engine import cpu_kernels, linear

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 14, 2, 64, 16
HIDDEN, INTER, LAYERS = 896, 4864, 24
ATTENTION_CASES = ((1, 512), (8, 600), (16, 1024), (32, 2048))
PACK_BATCHES = (1, 8, 16)
CPU = torch.device("cpu")


def _alternating(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median seconds per call of each function, the functions taking turns."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(reps):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


ATTENTION_TABLE = Table(
    [
        Col("dtype", "dtype", left=True, width=8),
        Col("batch", "batch"),
        Col("context", "context", width=7),
        Col("torch_us", "torch µs", ".0f", width=9),
        Col("kernel_us", "kernel µs", ".0f", width=9),
        Col("speedup", "speed-up", ".2f"),
        Col("max_abs_diff", "max|diff|", ".1e", width=9),
    ]
)


def attention_rows(reps: int, cases: list[tuple[int, int]]) -> list[dict]:
    print("\ndecode attention per layer: torch's gather + SDPA against the C kernel\n")
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        kernel = cpu_kernels.decode_attention(
            dtype=dtype, device=CPU, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM
        )
        if kernel is None:
            print(f"decode attention: no C kernel for {dtype} here (no compiler?)", flush=True)
            continue
        for batch, ctx in cases:
            case = decode_case(
                dtype=dtype,
                heads=HEADS,
                kv_heads=KV_HEADS,
                hd=HEAD_DIM,
                block_size=BLOCK,
                lens=[max(1, ctx - 37 * i) for i in range(batch)],
                seed=batch * 7919 + ctx,
            )
            bias = case.bias()

            def torch_path(case=case, bias=bias):
                return case.torch_path(bias)

            def c_kernel(case=case, kernel=kernel):
                return case.kernel_path(kernel)

            diff = (c_kernel().float() - torch_path().float()).abs().max().item()
            t = _alternating({"torch": torch_path, "kernel": c_kernel}, reps)
            row = {
                "dtype": str(dtype).removeprefix("torch."),
                "batch": batch,
                "context": ctx,
                "torch_us": round(t["torch"] * 1e6, 1),
                "kernel_us": round(t["kernel"] * 1e6, 1),
                "speedup": round(t["torch"] / t["kernel"], 2),
                "max_abs_diff": diff,
            }
            ATTENTION_TABLE.row(row)
            rows.append(row)
    return rows


def packing_rows(reps: int, batches: list[int], layers: int) -> list[dict]:
    print("\none decode step's matmuls: plain F.linear, and weights packed by oneDNN\n")
    shapes = {
        "qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
        "o": (HIDDEN, HIDDEN),
        "gate_up": (2 * INTER, HIDDEN),
        "down": (HIDDEN, INTER),
    }
    hints = sorted({1, linear.PACK_BATCH_HINT})
    # One table for both dtypes: its header prints once, before the first row.
    table = Table(
        [
            Col("dtype", "dtype", left=True, width=8),
            Col("batch", "batch"),
            *(
                Col(f"{n}_ms", f"{n} ms", ".1f", width=10)
                for n in ["F.linear"] + [f"packed {h}" for h in hints]
            ),
            Col("hint_speedup", f"hint {linear.PACK_BATCH_HINT} ÷ 1", ".2f", width=10),
        ]
    )
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        if not linear.can_pack(dtype, CPU):
            print(f"packing: oneDNN does not pack {dtype} on this CPU", flush=True)
            continue
        gen = torch.Generator().manual_seed(1)
        plain = [
            {k: (torch.randn(s, generator=gen) * 0.02).to(dtype) for k, s in shapes.items()}
            for _ in range(layers)
        ]
        variants: dict[str, list[dict[str, torch.Tensor]]] = {"F.linear": plain}
        for hint in hints:
            variants[f"packed {hint}"] = [
                {k: torch.ops.mkldnn._reorder_linear_weight(w, hint) for k, w in layer.items()}
                for layer in plain
            ]
        for batch in batches:
            xs = {k: torch.randn(batch, s[1], generator=gen).to(dtype) for k, s in shapes.items()}

            def step(weights, xs=xs):
                for layer in weights:
                    for k, w in layer.items():
                        linear.linear(xs[k], w)

            t = _alternating({n: (lambda w=w: step(w)) for n, w in variants.items()}, reps)
            row = {
                "dtype": str(dtype).removeprefix("torch."),
                "batch": batch,
                **{f"{n}_ms": round(v * 1e3, 2) for n, v in t.items()},
                "hint_speedup": round(t["packed 1"] / t[f"packed {linear.PACK_BATCH_HINT}"], 2),
            }
            table.row(row)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="scripts/bench-kernels",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--no-attention", action="store_true")
    p.add_argument("--no-packing", action="store_true")
    p.add_argument(
        "--cases",
        type=lambda v: [tuple(int(x) for x in c.split("x")) for c in v.split(",")],
        default=list(ATTENTION_CASES),
        help="decode attention cases, BATCHxCONTEXT,... (default: %(default)s)",
    )
    p.add_argument(
        "--pack-batches",
        type=lambda v: [int(x) for x in v.split(",")],
        default=list(PACK_BATCHES),
        help="batch sizes of the packing comparison",
    )
    p.add_argument("--layers", type=int, default=LAYERS, help="layers of the packing step")
    p.add_argument("--out", type=Path, default=RESULTS / "kernels.json")
    args = p.parse_args(argv)
    result = {
        "reps": args.reps,
        "decode_attention": [] if args.no_attention else attention_rows(args.reps, args.cases),
        "packing": (
            [] if args.no_packing else packing_rows(args.reps, args.pack_batches, args.layers)
        ),
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
