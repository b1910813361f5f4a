"""Decode throughput of the torch engine beside transformers generate and the
memory-bandwidth bound, per model, dtype and batch size: scripts/bench-engine's first table
(its --help says how each is timed)."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    BLOCK_SIZE,
    Col,
    Neighbours,
    Table,
    bound_tok_s,
    engine_decode,
    ensure_model,
    median,
    prompts_for,
    with_bandwidth,
)
from services.task_executor.dtypes import DTYPES
from services.task_executor.engines.torch_engine import TorchEngine
from services.task_executor.engines.torch_engine.scheduler import blocks_for


def decode_engine(
    path: Path, dtype: str, max_batch: int, args: argparse.Namespace, **options: Any
) -> TorchEngine:
    """The torch engine of the decode workload (``options``: more of its arguments): room
    for ``max_batch`` requests of --prompt-len + --new-tokens tokens."""
    total = args.prompt_len + args.new_tokens
    return TorchEngine(
        path,
        dtype=dtype,
        block_size=BLOCK_SIZE,
        num_kv_blocks=max_batch * blocks_for(total, BLOCK_SIZE) + 4,
        max_num_seqs=max_batch,
        max_model_len=total + BLOCK_SIZE,
        **options,
    )


def hf_decode(model: Any, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(seconds for 1 new token, seconds for N-1 more) with transformers generate."""
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)
    cfg = model.generation_config
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0

    def run(n: int) -> float:
        t = time.perf_counter()
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=pad,
        )
        elapsed = time.perf_counter() - t
        assert out.shape[1] == ids.shape[1] + n, out.shape
        return elapsed

    one = run(1)
    full = run(new_tokens)
    return one, max(full - one, 1e-9)


def bench_decode(
    name: str,
    path: Path,
    dtype: str,
    args: argparse.Namespace,
    neighbours: Neighbours,
) -> list[dict[str, Any]]:
    engine = decode_engine(path, dtype, max(args.batches), args, device="cpu")
    vocab = engine.config.vocab_size
    weight_bytes = engine.weights.decode_bytes()
    # Warm-up: oneDNN builds its kernels for each new shape on first use.
    for b in args.batches:
        engine_decode(engine, prompts_for(b, args.prompt_len, vocab, seed=99), 4)

    hf = None
    if not args.no_hf:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).eval()
        with torch.inference_mode():
            hf_decode(hf, prompts_for(1, args.prompt_len, vocab, seed=99), 4)

    rows: list[dict[str, Any]] = []
    table = decode_table(lambda: rows[0]["engine_tok_s"] if rows else None)
    for b in args.batches:
        eng_rates, prefill_s, hf_rates, bandwidths = [], [], [], []
        for rep in range(args.reps):
            prompts = prompts_for(b, args.prompt_len, vocab, seed=rep)
            bw, (pre, dec) = neighbours.timed(
                with_bandwidth, engine_decode, engine, prompts, args.new_tokens
            )
            eng_rates.append(b * (args.new_tokens - 1) / dec)
            bandwidths.append(bw)
            prefill_s.append(pre)
            if hf is not None:
                with torch.inference_mode():
                    _, dec = neighbours.timed(hf_decode, hf, prompts, args.new_tokens)
                hf_rates.append(b * (args.new_tokens - 1) / dec)
        fractions = [
            r / bound_tok_s(b, bw, weight_bytes)
            for r, bw in zip(eng_rates, bandwidths, strict=True)
        ]
        row = {
            "model": name,
            "engine": "torch",
            "dtype": dtype,
            "batch": b,
            "engine_tok_s": median(eng_rates),
            "engine_prefill_ms": 1e3 * statistics.median(prefill_s),
            "hf_tok_s": median(hf_rates) if hf is not None else None,
            # the bound of each run at the bandwidth measured next to it
            "bound_tok_s": bound_tok_s(b, median(bandwidths), weight_bytes),
            "pct_bound": 100 * median(fractions),
            "bandwidth_gb_s": median(bandwidths),
            "weight_bytes": weight_bytes,
            "engine_samples": eng_rates,
            "bandwidth_samples": bandwidths,
            "hf_samples": hf_rates,
        }
        rows.append(row)
        table.row(row)
    engine.close()
    return rows


def decode_table(batch1_tok_s: Callable[[], float | None]) -> Table:
    """The torch decode table; ``vs b1`` is a row's tok/s over batch 1's."""

    def over(num: float, den: float | None) -> float | None:
        return num / den if den else None

    return Table(
        [
            Col("model", "model", left=True, width=18),
            Col("dtype", "dtype", left=True, width=9),
            Col("batch", "batch", width=5),
            Col("engine_tok_s", "engine tok/s", ".1f"),
            Col("hf_tok_s", "hf tok/s", ".1f"),
            Col(lambda r: over(r["engine_tok_s"], r["hf_tok_s"]), "eng/hf", ".2f"),
            Col("bound_tok_s", "bound tok/s", ".1f"),
            Col("pct_bound", "%bound", ".0f"),
            Col(lambda r: over(r["engine_tok_s"], batch1_tok_s()), "vs b1", ".1f"),
            Col("engine_prefill_ms", "prefill ms", ".1f"),
        ]
    )


def run_torch_decode_bench(
    plan: list[tuple[str, str]], args: argparse.Namespace, neighbours: Neighbours
) -> list[dict[str, Any]]:
    print(
        f"\ntorch engine: {args.prompt_len}-token prompts, {args.new_tokens} new tokens,"
        f" median of {args.reps}\n"
    )
    rows: list[dict[str, Any]] = []
    for name, dtype in plan:
        path = ensure_model(name, args.models_dir)
        rows.extend(bench_decode(name, path, dtype, args, neighbours))
    return rows
