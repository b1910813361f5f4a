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
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from services.task_executor.engines.torch_engine import cpu_kernels, linear  # noqa: E402
from services.task_executor.engines.torch_engine.attention import (  # noqa: E402
    additive_mask,
    gathered_decode_attention,
)
from services.task_executor.engines.torch_engine.kv_cache import PagedKVCache  # noqa: E402

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


def attention_rows(reps: int) -> list[dict]:
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        kernel = cpu_kernels.decode_attention(
            dtype=dtype, device=CPU, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM
        )
        if kernel is None:
            print(f"decode attention: no C kernel for {dtype} here (no compiler?)", flush=True)
            continue
        for batch, ctx in ATTENTION_CASES:
            gen = torch.Generator().manual_seed(batch * 7919 + ctx)
            lens = torch.tensor([max(1, ctx - 37 * i) for i in range(batch)], dtype=torch.int64)
            width = -(-ctx // BLOCK)
            num_blocks = batch * width + 8
            cache = PagedKVCache(
                num_layers=1,
                num_blocks=num_blocks,
                block_size=BLOCK,
                num_kv_heads=KV_HEADS,
                head_dim=HEAD_DIM,
                dtype=dtype,
                device=CPU,
            )
            cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=gen))
            cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=gen))
            tables = torch.randperm(num_blocks, generator=gen)[: batch * width]
            tables = tables.view(batch, width).contiguous()
            rows_qkv = torch.randn(batch, HEADS + 2 * KV_HEADS, HEAD_DIM, generator=gen)
            q = rows_qkv.to(dtype)[:, :HEADS]
            valid = torch.arange(width * BLOCK)[None, :] < lens[:, None]
            bias = additive_mask(valid[:, None, None, :], dtype)

            def torch_path(q=q, cache=cache, tables=tables, bias=bias):
                ck, cv = cache.gather(0, tables)
                return gathered_decode_attention(q, ck, cv, bias)

            def c_kernel(q=q, cache=cache, tables=tables, lens=lens, kernel=kernel):
                return kernel(q, cache.k[0], cache.v[0], tables, lens)

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
            print(
                f"decode attention {row['dtype']:<8} b{batch:<3} ctx {ctx:<5} torch "
                f"{row['torch_us']:8.0f} us  kernel {row['kernel_us']:7.0f} us  "
                f"{row['speedup']:5.2f}x  max|diff| {diff:.1e}",
                flush=True,
            )
            rows.append(row)
    return rows


def packing_rows(reps: int) -> list[dict]:
    shapes = {
        "qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
        "o": (HIDDEN, HIDDEN),
        "gate_up": (2 * INTER, HIDDEN),
        "down": (HIDDEN, INTER),
    }
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        if not linear.can_pack(dtype, CPU):
            print(f"packing: oneDNN does not pack {dtype} on this CPU", flush=True)
            continue
        gen = torch.Generator().manual_seed(1)
        plain = [
            {k: (torch.randn(s, generator=gen) * 0.02).to(dtype) for k, s in shapes.items()}
            for _ in range(LAYERS)
        ]
        hints = sorted({1, linear.PACK_BATCH_HINT})
        variants: dict[str, list[dict[str, torch.Tensor]]] = {"F.linear": plain}
        for hint in hints:
            variants[f"packed {hint}"] = [
                {k: torch.ops.mkldnn._reorder_linear_weight(w, hint) for k, w in layer.items()}
                for layer in plain
            ]
        for batch in PACK_BATCHES:
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
            print(
                f"packing {row['dtype']:<8} b{batch:<3} "
                + "  ".join(f"{n} {v * 1e3:6.1f} ms" for n, v in t.items())
                + f"  hint {linear.PACK_BATCH_HINT} vs 1: {row['hint_speedup']:.2f}x",
                flush=True,
            )
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
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "kernels.json")
    args = p.parse_args(argv)
    result = {
        "host": {
            "cpus": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "machine": platform.machine(),
        },
        "reps": args.reps,
        "decode_attention": [] if args.no_attention else attention_rows(args.reps),
        "packing": [] if args.no_packing else packing_rows(args.reps),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
