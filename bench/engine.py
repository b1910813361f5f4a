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
``--no-ov-api`` / ``--no-prefix-cache`` / ``--no-async-ab`` skip parts. Each part is a module
of its own (bench/torch_decode.py, bench/openvino.py, bench/prefix_cache.py,
bench/async_scheduling.py, bench/long_context.py); this one runs them, then the summary and
the goals.

Checkpoints come from devtools.modelgen and are generated under --models-dir when missing.

On a shared host a busy neighbour ruins CPU timings (with every core in use, each parallel op
waits for a descheduled thread). Each timed run therefore starts once the other processes are
quiet and is repeated when they used more than a fifth of a core during it (Linux only; the
counts of retried runs are in the JSON).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.async_scheduling import run_async_bench
from bench.common import (
    MODELS,
    RESULTS,
    Col,
    Neighbours,
    Table,
    ensure_model,
    measure_bandwidth,
    models_dir,
    names,
    numbers,
    write_result,
)
from bench.long_context import bench_long_context
from bench.prefix_cache import run_prefix_cache_bench
from bench.torch_decode import run_torch_decode_bench

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
    plan: list[tuple[str, str]] = []
    for name in names(args.models):
        dtypes = args.demo_dtypes if name == "demo" else args.bench_dtypes
        plan.extend((name, d) for d in names(dtypes))
    rows = [] if args.no_decode else run_torch_decode_bench(plan, args, neighbours)
    ov_rows: list[dict[str, Any]] = []
    api_rows: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    if not args.no_openvino:
        from bench import openvino as bench_openvino

        if not args.no_decode:
            ov_rows = bench_openvino.run_openvino_bench(args, neighbours)
        if not args.no_ov_api:
            api_rows, errors = bench_openvino.run_openvino_api_bench(args, neighbours)
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
