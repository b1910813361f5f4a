"""Decode and prefill throughput of meshserve's CPU engines, beside their references and the
memory-bandwidth bound, and TTFT with a cached prefix; one run prints every table.

Decode (torch engine, per model and dtype): for each batch size, B requests with distinct
prompts of the same length decode a fixed number of tokens greedily (no early stop: ignore_eos
for the engine, min_new_tokens for transformers). Decode tok/s counts the tokens after the
first, over the time after the first (the first comes out of the prefill):
- engine: the time of every ``step()`` after the prefill step;
- transformers: ``generate`` for N tokens minus ``generate`` for 1 token, same inputs.
The bound is what a decode step costs if it only streams the weights once at the measured
memory bandwidth: ``batch × bandwidth ÷ weight bytes`` tokens per second (KV reads ignored;
they are small at these lengths). The host shares its memory bandwidth with other machines
and it drifts (±30% within minutes), so each run is paired with a bandwidth sample taken just
before it: "bound" is at the median of those, "%bound" the median over runs of tok/s ÷ that
run's bound.

OpenVINO (per IR weight format, --ov-formats, on the Qwen2-0.5B-shaped checkpoint): the same
decode workload and a prefill of a --prefill-len prompt through OpenVINOEngine, beside OpenVINO
GenAI's ContinuousBatchingPipeline called directly (and LLMPipeline on SDPA at batch 1), and
the bound for the IR's weight bytes (bench/openvino.py says how each is timed). Then,
unless --no-ov-api, meshserve's API (a cluster started here with MESHSERVE_ENGINE=openvino)
beside GenAI called directly, on the same request shapes, runs alternating. IRs are converted
on first use (optimum-intel in .venv-ov-export; scripts/convert-openvino does it ahead).

Prefix caching: per engine and dtype/format, the time to first token of a request whose
1,024-token prefix is in the prefix cache against one whose prefix is not (both add the same
number of fresh tokens after it), and prefill tok/s of a 512-token prompt.

Async scheduling (torch): decode tok/s with the engine's ``async_scheduling`` on and off (the
next iteration launched while the host finishes the current one, or not), same workload as
the decode table, runs of the two alternating. On CPU "on" is the forward-thread overlap
(``overlap_on_cpu``, which the engine leaves off by default); ``--async-device cuda``
measures it where it is meant to pay.

Long prompts and contexts (first, on --long-model in bf16): prefill tok/s of one prompt of
1k-8k tokens and decode ms/token at contexts of 512-8k, the torch engine beside vLLM's CPU
build in its own venv, same workloads (``bench/long_context.py`` says how each is timed).
``--long-only`` runs just that table; ``--no-long`` skips it.

A summary table and the goals close the run. ``--no-decode`` / ``--no-openvino`` /
``--no-ov-api`` / ``--no-prefix-cache`` / ``--no-async-ab`` skip parts.

Checkpoints come from devtools.modelgen and are generated under --models-dir when missing.

On a shared host a busy neighbour ruins CPU timings (with every core in use, each parallel op
waits for a descheduled thread). Each timed run therefore starts once the other processes are
quiet and is repeated when they used more than a fifth of a core during it (Linux only; the
counts of retried runs are in the JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import signal
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    MODELS,
    RESULTS,
    Col,
    Neighbours,
    Table,
    bound_tok_s,
    engine_decode,
    ensure_model,
    first_token_s,
    measure_bandwidth,
    median,
    models_dir,
    names,
    numbers,
    prompts_for,
    with_bandwidth,
    write_result,
)
from bench.long_context import bench_long_context
from services.task_executor.engines.base import Engine
from services.task_executor.engines.torch_engine import TorchEngine
from services.task_executor.engines.torch_engine.scheduler import blocks_for

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BLOCK_SIZE = 16
OV_BLOCK_SIZE = 32  # GenAI's paged-attention block on CPU (openvino_engine.CPU_BLOCK_SIZE)


# --- torch decode: the engine beside transformers generate and the bound ---------------------


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


def bench_model(
    name: str,
    path: Path,
    dtype: str,
    args: argparse.Namespace,
    neighbours: Neighbours,
) -> list[dict[str, Any]]:
    max_batch = max(args.batches)
    total = args.prompt_len + args.new_tokens
    engine = TorchEngine(
        path,
        device="cpu",
        dtype=dtype,
        block_size=BLOCK_SIZE,
        num_kv_blocks=max_batch * blocks_for(total, BLOCK_SIZE) + 4,
        max_num_seqs=max_batch,
        max_model_len=total + BLOCK_SIZE,
    )
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


# --- OpenVINO: the engine beside GenAI direct and the bound; the API beside GenAI direct -----


def run_openvino_bench(args: argparse.Namespace, neighbours: Neighbours) -> list[dict[str, Any]]:
    from bench import openvino as bench_openvino

    print(
        f"\nOpenVINO ({', '.join(args.ov_formats)} IR): engine vs GenAI ContinuousBatchingPipeline"
        f" called directly (sdpa: LLMPipeline on SDPA), {args.prompt_len}-token prompts,"
        f" {args.new_tokens} new tokens; prefill of {args.prefill_len} tokens; median of"
        f" {args.reps} (goal: batch 1 >= 70% of the bound)\n"
    )
    bench_openvino.TABLE.header()
    rows: list[dict[str, Any]] = []
    for name in args.ov_models:
        rows += bench_openvino.bench_openvino(
            ensure_model(name, args.models_dir),
            model_name=name,
            weight_formats=args.ov_formats,
            batches=args.batches,
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            prefill_len=args.prefill_len,
            reps=args.reps,
            timed=neighbours.timed,
            inference_precision=args.ov_precision,
            direct=not args.no_ov_direct,
            llm_pipeline=not args.no_ov_sdpa,
            on_row=bench_openvino.TABLE.row,
        )
    return rows


def run_openvino_api_bench(
    args: argparse.Namespace, neighbours: Neighbours
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    from bench import openvino as bench_openvino

    print(
        f"\nmeshserve API (MESHSERVE_ENGINE=openvino, one TE) vs GenAI called directly on the"
        f" TE's pipeline: per-request decode tok/s of {args.prompt_len}-token prompts +"
        f" {args.new_tokens} tokens at concurrency {', '.join(map(str, args.ov_api_batches))};"
        f" prefill tok/s = {args.prefill_len} / TTFT; median of {args.reps}, runs alternate"
        " (goal: api/dir >= 0.95)\n"
    )
    bench_openvino.API_TABLE.header()
    rows: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    log_dir = args.out.parent / f"{args.out.stem}-logs"
    for name in args.ov_models:
        try:
            rows += bench_openvino.bench_openvino_api(
                ensure_model(name, args.models_dir),
                log_dir=log_dir,
                model_name=name,
                weight_formats=args.ov_api_formats,
                batches=args.ov_api_batches,
                prompt_len=args.prompt_len,
                new_tokens=args.new_tokens,
                prefill_len=args.prefill_len,
                reps=args.reps,
                neighbours=neighbours,
                on_row=bench_openvino.API_TABLE.row,
            )
        except (RuntimeError, OSError) as e:
            print(f"{name}: the API benchmark failed: {e}", flush=True)
            errors[f"openvino_api {name}"] = str(e)
    print(f"(cluster logs: {log_dir})")
    return rows, errors


# --- prefix caching: time to first token with a cached prefix, and prefill speed -------------


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

        return OpenVINOEngine(
            path,
            weight_format=fmt,
            num_kv_blocks=3 * blocks_for(total, OV_BLOCK_SIZE),
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


# --- async scheduling: the same decode with the next iteration launched ahead, and without ----


def bench_async(
    name: str, path: Path, dtype: str, args: argparse.Namespace, neighbours: Neighbours
) -> list[dict[str, Any]]:
    max_batch = max(args.async_batches)
    total = args.prompt_len + args.new_tokens
    engines = {
        on: TorchEngine(
            path,
            device=args.async_device,
            dtype=dtype,
            block_size=BLOCK_SIZE,
            num_kv_blocks=max_batch * blocks_for(total, BLOCK_SIZE) + 4,
            max_num_seqs=max_batch,
            max_model_len=total + BLOCK_SIZE,
            async_scheduling=on,
            overlap_on_cpu=True,
        )
        for on in (True, False)
    }
    vocab = engines[True].config.vocab_size
    for b in args.async_batches:
        for engine in engines.values():
            engine_decode(engine, prompts_for(b, args.prompt_len, vocab, seed=99), 4)
    rows = []
    for b in args.async_batches:
        rates: dict[bool, list[float]] = {True: [], False: []}
        before = dataclasses.replace(engines[True].overlap)
        for rep in range(args.reps):
            prompts = prompts_for(b, args.prompt_len, vocab, seed=rep)
            # Alternate which goes first, so a drift in the host's speed hits both alike.
            for on in (True, False) if rep % 2 == 0 else (False, True):
                _, dec = neighbours.timed(engine_decode, engines[on], prompts, args.new_tokens)
                rates[on].append(b * (args.new_tokens - 1) / dec)
        ov = engines[True].overlap
        row = {
            "model": name,
            "dtype": dtype,
            "device": engines[True].device,
            "batch": b,
            "async_tok_s": statistics.median(rates[True]),
            "sync_tok_s": statistics.median(rates[False]),
            "async_samples": rates[True],
            "sync_samples": rates[False],
            # over the timed runs (and their retries): iterations launched ahead, and rows
            # of those used and thrown away
            "launched_ahead": ov.launched - before.launched,
            "rows_used": ov.rows_used - before.rows_used,
            "rows_wasted": ov.rows_wasted - before.rows_wasted,
        }
        row["ratio"] = row["async_tok_s"] / row["sync_tok_s"]
        rows.append(row)
        ASYNC_TABLE.row(row)
    for engine in engines.values():
        engine.close()
    return rows


def _spread(key: str) -> Callable[[dict[str, Any]], str]:
    return lambda r: f"{min(r[key]):.0f}-{max(r[key]):.0f}"


ASYNC_TABLE = Table(
    [
        Col("model", "model", left=True, width=18),
        Col("dtype", "dtype", left=True, width=9),
        Col("batch", "batch", width=5),
        Col("async_tok_s", "async tok/s", ".1f"),
        Col("sync_tok_s", "sync tok/s", ".1f"),
        Col("ratio", "ratio", ".3f"),
        Col(_spread("async_samples"), "async min-max", width=15),
        Col(_spread("sync_samples"), "sync min-max", width=15),
        Col(lambda r: f"{r['rows_used']}/{r['rows_wasted']}", "ahead used/wasted", width=17),
    ]
)


def run_async_bench(
    plan: list[tuple[str, str]], args: argparse.Namespace, neighbours: Neighbours
) -> list[dict[str, Any]]:
    print(
        f"\nasync scheduling on {args.async_device}: decode tok/s with async_scheduling on vs off,"
        f" {args.prompt_len}-token prompts, {args.new_tokens} new tokens, median of {args.reps}"
        " (runs alternate)\n"
    )
    ASYNC_TABLE.header()
    rows = []
    for name, dtype in plan:
        path = ensure_model(name, args.models_dir)
        rows.extend(bench_async(name, path, dtype, args, neighbours))
    return rows


# --- summary and goals ------------------------------------------------------------------------


def summary_rows(
    rows: list[dict[str, Any]],
    ov_rows: list[dict[str, Any]],
    prefix_rows: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """One row per (model, engine, dtype or weight format): decode tok/s by batch, % of the
    bound and the reference (generate / GenAI direct) at batch 1, prefill tok/s, and the
    cached/uncached TTFT ratio. Pure: built from the other tables' rows."""
    out: dict[tuple[str, str, str], dict[str, Any]] = {}

    def entry(model: str, engine: str, variant: str) -> dict[str, Any]:
        return out.setdefault(
            (model, engine, variant),
            {
                "model": model,
                "engine": engine,
                "variant": variant,
                "decode_tok_s": {},
                "pct_bound_b1": None,
                "ref_b1_tok_s": None,
                "prefill_tok_s": None,
                "ttft_cached_over_uncached": None,
            },
        )

    for r in rows:
        e = entry(r["model"], r.get("engine", "torch"), r["dtype"])
        e["decode_tok_s"][r["batch"]] = r["engine_tok_s"]
        if r["batch"] == 1:
            e["pct_bound_b1"] = r["pct_bound"]
            e["ref_b1_tok_s"] = r["hf_tok_s"]
    for r in ov_rows:
        e = entry(r["model"], "openvino", r["weight_format"])
        if r["point"].startswith("decode"):
            e["decode_tok_s"][r["batch"]] = r["engine_tok_s"]
            if r["batch"] == 1:
                e["pct_bound_b1"] = r["pct_bound"]
                direct = r["direct_tok_s"]
                e["ref_b1_tok_s"] = None if direct != direct else direct  # NaN: not measured
        else:
            e["prefill_tok_s"] = r["engine_tok_s"]
    for r in prefix_rows:
        e = entry(r["model"], r["engine"], r["dtype"])
        # the prefix table's prefill (the same method for every engine) wins
        e["prefill_tok_s"] = r["prefill_tok_s"]
        e["ttft_cached_over_uncached"] = r["ttft_ratio"]
    return list(out.values())


def print_summary(summary: list[dict[str, Any]], batches: list[int]) -> None:
    cols = [
        Col("model", "model", left=True, width=18),
        Col("engine", "engine", left=True, width=8),
        Col("variant", "dtype", left=True, width=9),
        *(Col(lambda s, b=b: s["decode_tok_s"].get(b), f"b{b} tok/s", ".1f") for b in batches),
        Col("pct_bound_b1", "%bound b1", ".0f"),
        Col("ref_b1_tok_s", "ref b1", ".1f"),
        Col("prefill_tok_s", "prefill tok/s", ".1f"),
        Col("ttft_cached_over_uncached", "cached/uncached", ".3f"),
    ]
    Table(cols).print(
        summary,
        title="summary: decode tok/s by batch; % of the bandwidth bound and the reference at"
        " batch 1 (torch: transformers generate, openvino: GenAI called directly); prefill"
        " tok/s; cached/uncached TTFT",
    )


def _goal(
    goal: str, row: dict[str, Any], variant: str, value: float, op: str, target: float, **extra: Any
) -> dict[str, Any]:
    met = value >= target if op == ">=" else value <= target
    return {
        "goal": goal,
        "model": row["model"],
        "engine": row.get("engine", "torch"),
        "variant": variant,
        **extra,
        "value": value,
        "target": f"{op} {target:g}",
        "met": bool(met),
    }


def goals(
    rows: list[dict[str, Any]],
    ov_rows: list[dict[str, Any]],
    api_rows: list[dict[str, Any]],
    prefix_rows: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """Every goal the run can check, each with its value, target and whether it is met."""
    out: list[dict[str, Any]] = []
    torch_runs: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    for r in rows:
        torch_runs.setdefault((r["model"], r["dtype"]), {})[r["batch"]] = r
    for (_, dtype), by_batch in torch_runs.items():
        b1, b8 = by_batch.get(1), by_batch.get(8)
        if b1 and b1["hf_tok_s"]:
            ratio = b1["engine_tok_s"] / b1["hf_tok_s"]
            out.append(_goal("torch_engine_vs_hf_batch1", b1, dtype, ratio, ">=", 1.0))
        if b1 and b8:
            ratio = b8["engine_tok_s"] / b1["engine_tok_s"]
            out.append(_goal("torch_batch8_vs_batch1", b1, dtype, ratio, ">=", 4.0))
    for r in ov_rows:
        if r["point"] == "decode b1":
            frac = r["pct_bound"] / 100
            out.append(
                _goal("openvino_batch1_fraction_of_bound", r, r["weight_format"], frac, ">=", 0.70)
            )
    for r in api_rows:
        out.append(
            _goal(
                "openvino_api_vs_genai_direct",
                r,
                r["weight_format"],
                r["api_vs_direct"],
                ">=",
                0.95,
                point=r["point"],
            )
        )
    for r in prefix_rows:
        out.append(
            _goal("ttft_cached_prefix_over_uncached", r, r["dtype"], r["ttft_ratio"], "<=", 0.2)
        )
    return out


def print_goals(goal_list: list[dict[str, Any]]) -> None:
    Table(
        [
            Col(lambda g: "met" if g["met"] else "NOT MET", "verdict", left=True, width=7),
            Col(
                lambda g: g["goal"] + (f" {g['point']}" if "point" in g else ""),
                "goal",
                left=True,
                width=44,
            ),
            Col("model", "model", left=True, width=16),
            Col("engine", "engine", left=True, width=8),
            Col("variant", "variant", left=True, width=9),
            Col("value", "value", ".3f"),
            Col("target", "goal", width=8),
        ]
    ).print(goal_list, title="goals")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="scripts/bench-engine",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument(
        "--models", default="demo,bench-qwen2-0.5b", help="comma-separated: " + ", ".join(MODELS)
    )
    p.add_argument("--models-dir", type=Path, default=None, help="default: MESHSERVE_MODELS_DIR")
    p.add_argument("--demo-dtypes", default="float32,bfloat16")
    p.add_argument(
        "--bench-dtypes",
        default="float32,bfloat16",
        help="torch dtypes for the Qwen2-0.5B-shaped model",
    )
    p.add_argument("--batches", default="1,8,16", type=numbers)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--reps", type=int, default=3, help="runs per point; medians are reported")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-hf", action="store_true", help="skip transformers generate")
    p.add_argument("--out", type=Path, default=RESULTS / "engine.json")
    p.add_argument(
        "--no-decode",
        action="store_true",
        help="skip the decode tables (torch, and the OpenVINO engine's with its prefill rows)",
    )
    p.add_argument("--no-openvino", action="store_true", help="skip every OpenVINO table and row")
    p.add_argument(
        "--ov-formats", default="int8,fp16", type=names, help="OpenVINO IR weight formats"
    )
    p.add_argument(
        "--ov-models", default="bench-qwen2-0.5b", type=names, help="models run on OpenVINO"
    )
    p.add_argument(
        "--ov-precision",
        default=None,
        help="OpenVINO inference precision (f32, bf16); default: the CPU plugin's choice",
    )
    p.add_argument(
        "--no-ov-direct", action="store_true", help="skip GenAI called directly beside the engine"
    )
    p.add_argument(
        "--no-ov-sdpa", action="store_true", help="skip GenAI's LLMPipeline (SDPA) at batch 1"
    )
    p.add_argument(
        "--no-ov-api",
        action="store_true",
        help="skip meshserve's API (a cluster on the OpenVINO engine) vs GenAI direct",
    )
    p.add_argument(
        "--ov-api-formats",
        default=None,
        type=names,
        help="weight formats of the API table (default: --ov-formats)",
    )
    p.add_argument(
        "--ov-api-batches", default="1,8", type=numbers, help="concurrencies of the API table"
    )
    p.add_argument("--no-prefix-cache", action="store_true", help="skip the prefix cache table")
    p.add_argument("--no-async-ab", action="store_true", help="skip the async scheduling table")
    p.add_argument("--async-batches", default="1,8", type=numbers)
    p.add_argument("--async-device", default="cpu", help="device of the async scheduling table")
    p.add_argument("--cached-prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=16, help="new tokens after the prefix")
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument(
        "--no-long", action="store_true", help="skip long prompts and contexts beside vLLM"
    )
    p.add_argument("--long-only", action="store_true", help="only that table")
    p.add_argument("--long-model", default="bench-qwen2-0.5b")
    p.add_argument("--long-prefill", default="1024,2048,4096,8192", type=numbers)
    p.add_argument("--long-contexts", default="512,2048,4096,8192", type=numbers)
    p.add_argument("--long-reps", type=int, default=2)
    args = p.parse_args(argv)
    if args.new_tokens < 2:
        p.error("--new-tokens must be at least 2")
    if args.ov_api_formats is None:
        args.ov_api_formats = args.ov_formats
    for name in names(args.models) + args.ov_models:
        if name not in MODELS:
            p.error(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return args


def _versions(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"threads": args.threads}
    if not args.no_openvino:
        import openvino
        import openvino_genai

        out["openvino"] = openvino.__version__
        out["openvino_genai"] = openvino_genai.__version__
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.models_dir is None:
        args.models_dir = models_dir()
    # SIGTERM unwinds like Ctrl-C, so a cluster started for the API table is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    started = time.monotonic()
    neighbours = Neighbours()
    bandwidth = neighbours.timed(measure_bandwidth)
    print(f"torch {torch.__version__}, {args.threads} threads, read bandwidth {bandwidth:.1f} GB/s")
    long_context: dict[str, Any] = {}
    if not args.no_long:
        long_context = bench_long_context(
            ensure_model(args.long_model, args.models_dir),
            args.long_prefill,
            args.long_contexts,
            args.new_tokens,
            args.long_reps,
            args.threads,
        )
        if args.long_only:
            write_result(args.out, {"bandwidth_gb_s": bandwidth, "long_context": long_context})
            return 0
    rows: list[dict[str, Any]] = []
    plan: list[tuple[str, str]] = []
    for name in names(args.models):
        dtypes = args.demo_dtypes if name == "demo" else args.bench_dtypes
        plan.extend((name, d) for d in names(dtypes))
    if not args.no_decode:
        print(
            f"\ntorch engine: {args.prompt_len}-token prompts, {args.new_tokens} new tokens,"
            f" median of {args.reps}\n"
        )
        for name, dtype in plan:
            path = ensure_model(name, args.models_dir)
            rows.extend(bench_model(name, path, dtype, args, neighbours))
    ov_rows: list[dict[str, Any]] = []
    api_rows: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    if not args.no_openvino:
        if not args.no_decode:
            ov_rows = run_openvino_bench(args, neighbours)
        if not args.no_ov_api:
            api_rows, errors = run_openvino_api_bench(args, neighbours)
    prefix_rows = [] if args.no_prefix_cache else run_prefix_cache_bench(plan, args, neighbours)
    async_rows = [] if args.no_async_ab else run_async_bench(plan, args, neighbours)

    summary = summary_rows(rows, ov_rows, prefix_rows)
    goal_list = goals(rows, ov_rows, api_rows, prefix_rows)
    result = {
        "versions": _versions(args),
        "bandwidth_gb_s": bandwidth,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "prefill_len": args.prefill_len,
        "reps": args.reps,
        "wall_s": round(time.monotonic() - started, 1),
        "contended_runs_repeated": neighbours.retries,
        "rows": rows,
        "openvino": ov_rows,
        "openvino_api": api_rows,
        "prefix_cache": prefix_rows,
        "async_scheduling": async_rows,
        "long_context": long_context,
        "summary": summary,
        "goals": goal_list,
        "errors": errors,
    }
    write_result(args.out, result)
    if summary:
        print_summary(summary, args.batches)
    for r in async_rows:
        print(f"{r['model']} {r['dtype']} batch {r['batch']}: async/sync decode = {r['ratio']:.3f}")
    print_goals(goal_list)
    print(f"\n{result['wall_s']:.0f} s; {neighbours.retries} runs repeated for a busy neighbour")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
