"""The engines on one CUDA GPU, side by side in one process and one run: meshserve's torch engine
(CUDA graphs and async scheduling; async scheduling off; CUDA graphs off) and vLLM (``VLLMEngine``, vLLM's own engine with its CUDA graphs
and compiled model unless --vllm-eager), driven through the same ``Engine`` protocol with the
same requests.

Decode: for each batch size B, B distinct prompts of --prompt-len tokens each decode
--new-tokens greedily (ignore_eos). TTFT is the time until every request of the batch has its
first token; decode tok/s counts the tokens after that over the time after it. The bound is
what a step costs if it only reads the weights once at the GPU's measured read bandwidth
(``B × bandwidth ÷ weight bytes``). Runs of the engines alternate per repetition, so a drift
of the machine hits each alike; medians of --reps are reported.

Prefix caching: per engine, TTFT of a request whose --cached-prefix-len prefix is cached vs
one whose prefix is not, and prefill tok/s of a --prefill-len prompt (bench/prefix_cache.py's
table).

A summary gives torch ÷ vLLM decode throughput and TTFT per batch, async ÷ sync, and graphs
÷ eager. Needs a CUDA device (and vLLM importable for its rows; ``--engines
torch,torch-sync,torch-eager`` runs without).
Writes bench-results/gpu.json by default.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    BLOCK_SIZE,
    MODELS,
    RESULTS,
    Col,
    Neighbours,
    Table,
    bound_tok_s,
    ensure_model,
    measure_bandwidth,
    median,
    models_dir,
    names,
    numbers,
    prompts_for,
    write_result,
)
from bench.prefix_cache import PREFIX_TABLE, bench_prefix_cache
from services.task_executor.engines.base import Engine, EngineRequest
from services.task_executor.engines.torch_engine import TorchEngine
from services.task_executor.engines.torch_engine.config import load_model_config
from services.task_executor.engines.torch_engine.scheduler import blocks_for
from services.task_executor.engines.torch_engine.weights import CheckpointTensors, load_weights
from shared.messages.api import SamplingParams

ENGINES = ("torch", "torch-sync", "torch-eager", "vllm")


def weight_bytes(model_dir: Path, dtype: torch.dtype) -> int:
    """Bytes of weights one decode step streams at ``dtype`` (``ModelWeights.decode_bytes``),
    read off the checkpoint onto the meta device: no memory, whichever engines run."""
    config = load_model_config(model_dir)
    weights = load_weights(
        CheckpointTensors(model_dir), config, dtype=dtype, device=torch.device("meta")
    )
    return weights.decode_bytes()


def make_engine(kind: str, path: Path, args: argparse.Namespace) -> Engine:
    max_batch = max(args.batches)
    max_len = (
        max(
            args.prompt_len + args.new_tokens,
            args.cached_prefix_len + args.suffix_len,
            args.prefill_len,
        )
        + BLOCK_SIZE
    )
    if kind == "vllm":
        from services.task_executor.engines.vllm_engine import VLLMEngine

        return VLLMEngine(
            path,
            dtype=args.dtype,
            max_num_seqs=max_batch,
            gpu_memory_fraction=args.vllm_memory_fraction,
            max_model_len=max_len,
            enforce_eager=args.vllm_eager,
        )
    return TorchEngine(
        path,
        device="cuda",
        dtype=args.dtype,
        block_size=BLOCK_SIZE,
        num_kv_blocks=(max_batch + 2) * blocks_for(max_len, BLOCK_SIZE),
        max_num_seqs=max_batch,
        max_model_len=max_len,
        async_scheduling=kind != "torch-sync",
        cuda_graphs=kind != "torch-eager",
    )


def batch_run(
    engine: Engine, prompts: list[list[int]], new_tokens: int
) -> tuple[float, float, int]:
    """(seconds until every request has its first token, seconds after that until all are
    done, tokens produced in that second phase) for one batch run to completion."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    ids = [f"g{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(EngineRequest(rid, p, params))
    produced = dict.fromkeys(ids, 0)
    t0 = time.perf_counter()
    t_first = None
    at_first = 0
    while engine.has_work():
        for o in engine.step():
            produced[o.request_id] += len(o.new_token_ids)
        if t_first is None and all(produced.values()):
            t_first, at_first = time.perf_counter(), sum(produced.values())
    t_end = time.perf_counter()
    total = sum(produced.values())
    assert total == len(prompts) * new_tokens, (total, len(prompts), new_tokens)
    assert t_first is not None
    return t_first - t0, t_end - t_first, total - at_first


def bench_decode(
    engines: dict[str, Engine], vocab: int, wbytes: int, bandwidth: float, args: argparse.Namespace
) -> list[dict[str, Any]]:
    print(
        f"\ndecode: {args.prompt_len}-token prompts, {args.new_tokens} new tokens, greedy;"
        f" median of {args.reps}; bound at {bandwidth:.0f} GB/s for {wbytes / 1e9:.2f} GB\n"
    )
    table = Table(
        [
            Col("engine", "engine", left=True, width=11),
            Col("batch", "batch", width=5),
            Col("decode_tok_s", "decode tok/s", ".1f"),
            Col("per_request_tok_s", "per req", ".1f", width=8),
            Col("pct_bound", "%bound", ".1f", width=7),
            Col("ttft_ms", "ttft ms", ".1f", width=8),
            Col(
                lambda r: f"{min(r['decode_samples']):.0f}-{max(r['decode_samples']):.0f}",
                "tok/s min-max",
                width=15,
            ),
        ]
    )
    rows = []
    names = list(engines)
    for b in args.batches:
        for engine in engines.values():  # warm-up: every shape the runs meet (graphs, allocator)
            batch_run(engine, prompts_for(b, args.prompt_len, vocab, seed=99), args.new_tokens)
        rates: dict[str, list[float]] = {n: [] for n in names}
        ttfts: dict[str, list[float]] = {n: [] for n in names}
        for rep in range(args.reps):
            prompts = prompts_for(b, args.prompt_len, vocab, seed=rep)
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for n in order:
                ttft, dec, toks = batch_run(engines[n], prompts, args.new_tokens)
                rates[n].append(toks / dec)
                ttfts[n].append(ttft)
        bound = bound_tok_s(b, bandwidth, wbytes)
        for n in names:
            row = {
                "engine": n,
                "batch": b,
                "decode_tok_s": median(rates[n]),
                "per_request_tok_s": median(rates[n]) / b,
                "pct_bound": 100 * median(rates[n]) / bound,
                "ttft_ms": 1e3 * median(ttfts[n]),
                "decode_samples": rates[n],
                "ttft_samples_s": ttfts[n],
            }
            rows.append(row)
            table.row(row)
    return rows


def ratios(rows: list[dict[str, Any]], num: str, den: str) -> list[dict[str, Any]]:
    by = {(r["engine"], r["batch"]): r for r in rows}
    out = []
    for (engine, b), r in by.items():
        other = by.get((den, b))
        if engine != num or other is None:
            continue
        out.append(
            {
                "ratio": f"{num} / {den}",
                "batch": b,
                "decode": r["decode_tok_s"] / other["decode_tok_s"],
                "ttft": r["ttft_ms"] / other["ttft_ms"],
            }
        )
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="scripts/bench-gpu",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--model", default="bench-qwen2-0.5b", choices=sorted(MODELS))
    p.add_argument("--models-dir", type=Path, default=None, help="default: MESHSERVE_MODELS_DIR")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--engines", default=",".join(ENGINES), type=names)
    p.add_argument("--batches", default="1,8,16,64", type=numbers)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cached-prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--no-prefix-cache", action="store_true", help="skip the prefix cache table")
    p.add_argument("--vllm-eager", action="store_true", help="vLLM without CUDA graphs/compile")
    p.add_argument("--vllm-memory-fraction", type=float, default=0.3)
    p.add_argument("--out", type=Path, default=RESULTS / "gpu.json")
    args = p.parse_args(argv)
    unknown = set(args.engines) - set(ENGINES)
    if unknown:
        p.error(f"unknown engines {sorted(unknown)}; known: {', '.join(ENGINES)}")
    if args.new_tokens < 2:
        p.error("--new-tokens must be at least 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench-gpu: no CUDA device here", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    path = ensure_model(args.model, args.models_dir or models_dir())
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    host: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    bandwidth = measure_bandwidth(gib=2.0, reps=10, device="cuda")
    print(f"{host['gpu']}, torch {host['torch']} (CUDA {host['cuda']}), read {bandwidth:.0f} GB/s")
    engines: dict[str, Engine] = {}
    started: dict[str, float] = {}
    # vLLM first: it sizes its KV pool from the memory free when it starts.
    for kind in sorted(args.engines, key=lambda k: k != "vllm"):
        t = time.perf_counter()
        engines[kind] = make_engine(kind, path, args)
        started[kind] = time.perf_counter() - t
        print(f"{kind}: started in {started[kind]:.1f} s", flush=True)
    if "vllm" in engines:
        import vllm

        host["vllm"] = vllm.__version__
    dtype = getattr(torch, args.dtype)
    wbytes = weight_bytes(path, dtype)
    rows = bench_decode(engines, vocab, wbytes, bandwidth, args)
    prefix_rows = []
    if not args.no_prefix_cache:
        print(
            f"\nprefix cache: TTFT of {args.cached_prefix_len} cached + {args.suffix_len} new"
            f" tokens vs all new; prefill of {args.prefill_len} tokens; median of {args.reps}\n"
        )
        PREFIX_TABLE.header()
        # A GPU's timings do not suffer from busy CPU neighbours.
        neighbours = Neighbours(enabled=False)
        for kind, engine in engines.items():
            prefix_rows.append(
                bench_prefix_cache(
                    args.model, kind, args.dtype, lambda _n, e=engine: e, vocab, args, neighbours
                )
            )
    for engine in engines.values():
        engine.close()
    summary = [
        *ratios(rows, "torch", "vllm"),
        *ratios(rows, "torch", "torch-sync"),
        *ratios(rows, "torch", "torch-eager"),
    ]
    Table(
        [
            Col("ratio", "ratio", left=True, width=20),
            Col("batch", "batch", width=5),
            Col("decode", "decode", ".3f", width=7),
            Col("ttft", "ttft", ".3f"),
        ]
    ).print(summary, title="ratios")
    write_result(
        args.out,
        {
            "versions": host,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "bandwidth_gb_s": bandwidth,
            "weight_bytes": wbytes,
            "startup_s": started,
            "decode": rows,
            "prefix_cache": prefix_rows,
            "summary": summary,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
