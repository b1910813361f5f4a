"""Time to first token with a cached prefix against one without, and prefill tok/s, per
engine (torch per dtype, OpenVINO per weight format): scripts/bench-engine's prefix cache
table, and bench/gpu.py's."""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import (
    BLOCK_SIZE,
    Col,
    Neighbours,
    Table,
    ensure_model,
    first_token_s,
    prompts_for,
)
from services.task_executor.engines.base import Engine
from services.task_executor.engines.torch_engine import TorchEngine
from services.task_executor.engines.torch_engine.scheduler import blocks_for


def bench_prefix_cache(
    name: str,
    engine_name: str,
    variant: str,
    make_engine: Callable[[int], Engine],
    vocab: int,
    args: argparse.Namespace,
    neighbours: Neighbours,
) -> dict[str, Any]:
    """TTFT of a request whose prefix is cached vs one whose prefix is not (same lengths:
    the prefix plus a fresh suffix), and prefill tok/s of a prompt with nothing cached.
    ``make_engine(total)`` builds an engine for prompts up to ``total`` tokens with room for
    two of them at once (caching one never evicts the other mid-run)."""
    plen, slen, flen = args.cached_prefix_len, args.suffix_len, args.prefill_len
    engine = make_engine(max(plen + slen, flen) + BLOCK_SIZE)

    def fresh(n: int, seed: int) -> list[int]:
        return prompts_for(1, n, vocab, seed=seed)[0]

    # Warm-up: kernels are built per shape; run each shape once, cached and not.
    warm = fresh(plen, 1000)
    first_token_s(engine, warm + fresh(slen, 1001))
    first_token_s(engine, warm + fresh(slen, 1002))
    first_token_s(engine, fresh(flen, 1003))

    # Every timed run, retries included, gets tokens never seen before (a retried "uncached"
    # run would otherwise find its prefix cached by the first try).
    seeds = itertools.count(2000)
    prefix: list[int] = []

    def uncached_run() -> float:
        nonlocal prefix
        prefix = fresh(plen, next(seeds))  # left in the cache for cached_run
        return first_token_s(engine, prefix + fresh(slen, next(seeds)))

    def cached_run() -> float:
        return first_token_s(engine, prefix + fresh(slen, next(seeds)))

    def prefill_run() -> float:
        return first_token_s(engine, fresh(flen, next(seeds)))

    uncached, cached, prefill = [], [], []
    for _ in range(args.reps):
        uncached.append(neighbours.timed(uncached_run))
        cached.append(neighbours.timed(cached_run))
        prefill.append(flen / neighbours.timed(prefill_run))
    stats = engine.stats()
    engine.close()
    row = {
        "model": name,
        "engine": engine_name,
        "dtype": variant,
        "cached_prefix_len": plen,
        "suffix_len": slen,
        "ttft_uncached_ms": 1e3 * statistics.median(uncached),
        "ttft_cached_ms": 1e3 * statistics.median(cached),
        "prefill_len": flen,
        "prefill_tok_s": statistics.median(prefill),
        # 0 for OpenVINO: GenAI does not report its prefix-cache hits
        "cache_hit_tokens": stats.prefix_cache_hit_tokens,
        "uncached_samples_s": uncached,
        "cached_samples_s": cached,
    }
    row["ttft_ratio"] = row["ttft_cached_ms"] / row["ttft_uncached_ms"]
    PREFIX_TABLE.row(row)
    return row


PREFIX_TABLE = Table(
    [
        Col("model", "model", left=True, width=18),
        Col("engine", "engine", left=True, width=8),
        Col("dtype", "dtype", left=True, width=9),
        Col("cached_prefix_len", "prefix"),
        Col("ttft_uncached_ms", "ttft uncached ms", ".1f"),
        Col("ttft_cached_ms", "ttft cached ms", ".1f"),
        Col("ttft_ratio", "ratio", ".3f"),
        Col("prefill_tok_s", "prefill tok/s", ".1f"),
    ]
)


def _torch_engine_for(path: Path, dtype: str) -> Callable[[int], Engine]:
    def make(total: int) -> Engine:
        return TorchEngine(
            path,
            device="cpu",
            dtype=dtype,
            block_size=BLOCK_SIZE,
            num_kv_blocks=3 * blocks_for(total, BLOCK_SIZE),
            max_num_seqs=2,
            max_model_len=total,
            max_prefill_tokens=total,
        )

    return make


def _openvino_engine_for(path: Path, fmt: str, precision: str | None) -> Callable[[int], Engine]:
    def make(total: int) -> Engine:
        from services.task_executor.engines.openvino_engine import OpenVINOEngine
        from services.task_executor.engines.openvino_engine.engine import CPU_BLOCK_SIZE

        return OpenVINOEngine(
            path,
            weight_format=fmt,
            num_kv_blocks=3 * blocks_for(total, CPU_BLOCK_SIZE),
            max_num_seqs=2,
            max_model_len=total,
            max_num_batched_tokens=total,
            inference_precision=precision,
        )

    return make


def run_prefix_cache_bench(
    plan: list[tuple[str, str]], args: argparse.Namespace, neighbours: Neighbours
) -> list[dict[str, Any]]:
    print(
        f"\nprefix cache: TTFT of {args.cached_prefix_len} cached + {args.suffix_len} new tokens"
        f" vs all {args.cached_prefix_len + args.suffix_len} new (goal: ratio <= 0.2);"
        f" prefill of {args.prefill_len} tokens; median of {args.reps}\n"
    )
    PREFIX_TABLE.header()
    runs: list[tuple[str, str, str, Callable[[int], Engine], Path]] = []
    for name, dtype in plan:
        path = ensure_model(name, args.models_dir)
        runs.append((name, "torch", dtype, _torch_engine_for(path, dtype), path))
    if not args.no_openvino:
        for name in args.ov_models:
            path = ensure_model(name, args.models_dir)
            for fmt in args.ov_formats:
                make = _openvino_engine_for(path, fmt, args.ov_precision)
                runs.append((name, "openvino", fmt, make, path))
    rows = []
    for name, engine_name, variant, make, path in runs:
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        rows.append(bench_prefix_cache(name, engine_name, variant, make, vocab, args, neighbours))
    return rows
