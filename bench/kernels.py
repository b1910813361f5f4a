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
import dataclasses
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


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    """One decode step's attention inputs over a paged cache (layer 0), as the model has them:
    ``q`` ``[batch, heads, hd]``, the first heads of wider q/k/v rows; ``tables`` padded with
    block 0; ``lens`` the tokens each request attends to."""

    q: torch.Tensor
    cache: PagedKVCache
    tables: torch.Tensor
    lens: torch.Tensor

    def bias(self) -> torch.Tensor:
        """The additive padding mask, built once per forward in the model."""
        keys = torch.arange(self.tables.shape[1] * self.cache.block_size)
        valid = keys[None, :] < self.lens[:, None]
        return additive_mask(valid[:, None, None, :], self.q.dtype)

    def torch_path(self, bias: torch.Tensor) -> torch.Tensor:
        """The engine's fallback: gather whole blocks, then SDPA with GQA rows."""
        ck, cv = self.cache.gather(0, self.tables)
        return gathered_decode_attention(self.q, ck, cv, bias)

    def kernel_path(self, kernel: cpu_kernels.DecodeAttention) -> torch.Tensor:
        return kernel(self.q, self.cache.k[0], self.cache.v[0], self.tables, self.lens)


def decode_case(
    *,
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    hd: int,
    block_size: int,
    lens: list[int],
    seed: int,
) -> DecodeCase:
    """Random K/V and queries, each request's blocks scattered over the cache as a busy
    allocator leaves them."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in lens)
    num_blocks = len(lens) * width + 3
    cache = PagedKVCache(
        num_layers=1,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=kv_heads,
        head_dim=hd,
        dtype=dtype,
        device=CPU,
    )
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=gen))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=gen))
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lens), width, dtype=torch.int64)
    for i, n in enumerate(lens):
        used = -(-n // block_size)
        tables[i, :used] = perm[i * width : i * width + used]
    rows = torch.randn(len(lens), heads + 2 * kv_heads, hd, generator=gen).to(dtype)
    return DecodeCase(rows[:, :heads], cache, tables, torch.tensor(lens, dtype=torch.int64))


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
