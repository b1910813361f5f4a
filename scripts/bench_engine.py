"""Decode throughput of the torch engine, beside transformers ``generate`` and the bandwidth bound.

For each model and dtype, and each batch size: B requests with distinct prompts of the same
length decode a fixed number of tokens greedily (no early stop: ignore_eos for the engine,
min_new_tokens for transformers). Decode tok/s counts the tokens after the first, over the
time after the first (the first comes out of the prefill):
- engine: the time of every ``step()`` after the prefill step;
- transformers: ``generate`` for N tokens minus ``generate`` for 1 token, same inputs.
The bound is what a decode step costs if it only streams the weights once at the measured
memory bandwidth: ``batch × bandwidth ÷ weight bytes`` tokens per second (KV reads ignored;
they are small at these lengths).

A second table (prefix caching) gives, per model and dtype, the time to first token of a request
whose 1,024-token prefix is in the prefix cache against one whose prefix is not (both add the
same number of fresh tokens after it), and prefill tok/s of a 512-token prompt.

A third table (async scheduling) gives decode tok/s with the engine's ``async_scheduling`` on and
off (the next iteration launched while the host finishes the current one, or not), same
workload as the first table, runs of the two alternating. On CPU "on" is the forward-thread
overlap (``overlap_on_cpu``, which the engine leaves off by default); ``--async-device cuda``
measures it where it is meant to pay.
``--no-decode`` / ``--no-prefix-cache`` / ``--no-async-ab`` skip a table.

Checkpoints come from shared.modelgen and are generated under --models-dir when missing.

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
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from services.task_executor.engines.base import EngineRequest  # noqa: E402
from services.task_executor.engines.torch_engine import TorchEngine  # noqa: E402
from services.task_executor.engines.torch_engine.kv_cache import blocks_for  # noqa: E402
from shared.messages.api import SamplingParams  # noqa: E402

MODELS: dict[str, tuple[str, str]] = {
    # name: (directory under --models-dir, shared.modelgen function)
    "demo": ("demo", "make_demo_model"),
    "bench-qwen2-0.5b": ("bench-qwen2-0.5b", "make_bench_model"),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BLOCK_SIZE = 16


def ensure_model(name: str, models_dir: Path) -> Path:
    subdir, maker = MODELS[name]
    path = models_dir / subdir
    if not (path / "config.json").is_file():
        from shared import modelgen

        print(f"generating {name} at {path} ...", file=sys.stderr, flush=True)
        getattr(modelgen, maker)(path)
    return path


def measure_bandwidth(gib: float = 1.0, reps: int = 7) -> float:
    """Read bandwidth in GB/s: the median time to sum a tensor far larger than any cache."""
    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    x.sum()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(times) / 1e9


class Neighbours:
    """CPU time used by other processes, from /proc/stat minus this process's own."""

    MAX_CORES = 0.2  # a run during which others averaged more than this is repeated
    MAX_TRIES = 6

    def __init__(self) -> None:
        self.enabled = Path("/proc/stat").is_file()
        self.tick = os.sysconf("SC_CLK_TCK") if self.enabled else 100
        self.retries = 0

    def _busy(self) -> tuple[int, int, float]:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:9]]
        with open("/proc/self/stat") as f:
            mine = f.read().rsplit(")", 1)[1].split()
        # fields after the command: state is [0], utime [11], stime [12]
        return sum(vals) - vals[3] - vals[4], int(mine[11]) + int(mine[12]), time.monotonic()

    def cores_used(self, since: tuple[int, int, float]) -> float:
        busy, mine, now = self._busy()
        return ((busy - since[0]) - (mine - since[1])) / self.tick / max(now - since[2], 1e-3)

    def wait_quiet(self, max_wait_s: float = 120.0) -> None:
        deadline = time.monotonic() + max_wait_s
        quiet = 0
        while quiet < 2 and time.monotonic() < deadline:
            start = self._busy()
            time.sleep(0.5)
            quiet = quiet + 1 if self.cores_used(start) < self.MAX_CORES else 0

    def timed(self, run: Callable[..., Any], *args: Any) -> Any:
        """``run(*args)`` from a run the neighbours left alone (or the last try)."""
        if not self.enabled:
            return run(*args)
        for _ in range(self.MAX_TRIES):
            self.wait_quiet()
            start = self._busy()
            result = run(*args)
            if self.cores_used(start) < self.MAX_CORES:
                return result
            self.retries += 1
        return result


def prompts_for(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    # Ids past the first few (special tokens) and inside a small tokenizer's range, so the
    # same prompts are plausible for both checkpoints.
    g = torch.Generator().manual_seed(seed)
    hi = min(vocab, 4000)
    return torch.randint(8, hi, (batch, length), generator=g).tolist()


def engine_decode(
    engine: TorchEngine, prompts: list[list[int]], new_tokens: int
) -> tuple[float, float]:
    """(prefill seconds, decode seconds) for one batch run to completion."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"b{time.monotonic_ns()}-{i}", p, params))
    t0 = time.perf_counter()
    first = engine.step()
    t1 = time.perf_counter()
    produced = len(first)
    while engine.has_work():
        produced += len(engine.step())
    t2 = time.perf_counter()
    assert produced == len(prompts) * new_tokens, produced
    return t1 - t0, t2 - t1


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


def median_rate(samples: list[float]) -> float:
    return statistics.median(samples) if samples else float("nan")


def bench_model(
    name: str,
    path: Path,
    dtype: str,
    args: argparse.Namespace,
    bandwidth: float,
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

    rows = []
    for b in args.batches:
        eng_rates, prefill_s, hf_rates = [], [], []
        for rep in range(args.reps):
            prompts = prompts_for(b, args.prompt_len, vocab, seed=rep)
            pre, dec = neighbours.timed(engine_decode, engine, prompts, args.new_tokens)
            eng_rates.append(b * (args.new_tokens - 1) / dec)
            prefill_s.append(pre)
            if hf is not None:
                with torch.inference_mode():
                    _, dec = neighbours.timed(hf_decode, hf, prompts, args.new_tokens)
                hf_rates.append(b * (args.new_tokens - 1) / dec)
        bound = b * bandwidth * 1e9 / weight_bytes
        row = {
            "model": name,
            "dtype": dtype,
            "batch": b,
            "engine_tok_s": median_rate(eng_rates),
            "engine_prefill_ms": 1e3 * statistics.median(prefill_s),
            "hf_tok_s": median_rate(hf_rates) if hf is not None else None,
            "bound_tok_s": bound,
            "weight_bytes": weight_bytes,
            "engine_samples": eng_rates,
            "hf_samples": hf_rates,
        }
        rows.append(row)
        print_row(row, rows[0], flush=True)
    engine.close()
    return rows


HEADER = (
    f"{'model':<18} {'dtype':<9} {'batch':>5} {'engine tok/s':>12} {'hf tok/s':>9} "
    f"{'eng/hf':>6} {'bound tok/s':>11} {'%bound':>6} {'vs b1':>6} {'prefill ms':>10}"
)


def print_row(row: dict[str, Any], first: dict[str, Any], *, flush: bool = False) -> None:
    hf = row["hf_tok_s"]
    eng = row["engine_tok_s"]
    print(
        f"{row['model']:<18} {row['dtype']:<9} {row['batch']:>5} {eng:>12.1f} "
        f"{(f'{hf:.1f}' if hf else '-'):>9} {(f'{eng / hf:.2f}' if hf else '-'):>6} "
        f"{row['bound_tok_s']:>11.1f} {100 * eng / row['bound_tok_s']:>5.0f}% "
        f"{eng / first['engine_tok_s']:>5.1f}x {row['engine_prefill_ms']:>10.1f}",
        flush=flush,
    )


def goals(rows: list[dict[str, Any]], model: str, dtype: str) -> dict[str, Any]:
    by_batch = {r["batch"]: r for r in rows if r["model"] == model and r["dtype"] == dtype}
    out: dict[str, Any] = {"model": model, "dtype": dtype}
    if 1 in by_batch and by_batch[1]["hf_tok_s"]:
        out["engine_vs_hf_batch1"] = by_batch[1]["engine_tok_s"] / by_batch[1]["hf_tok_s"]
        out["engine_ge_hf_batch1"] = out["engine_vs_hf_batch1"] >= 1.0
    if 1 in by_batch and 8 in by_batch:
        out["batch8_vs_batch1"] = by_batch[8]["engine_tok_s"] / by_batch[1]["engine_tok_s"]
        out["batch8_ge_4x_batch1"] = out["batch8_vs_batch1"] >= 4.0
    return out


# --- prefix caching: time to first token with a cached prefix, and prefill speed -------------


def _first_token_s(engine: TorchEngine, prompt: list[int]) -> float:
    """Seconds from queueing a one-token request to its token (its TTFT on an idle engine)."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    engine.add_request(EngineRequest(f"p{time.monotonic_ns()}", prompt, params))
    while engine.has_work():
        engine.step()
    return time.perf_counter() - t


def bench_prefix_cache(
    name: str, path: Path, dtype: str, args: argparse.Namespace, neighbours: Neighbours
) -> dict[str, Any]:
    """TTFT of a request whose prefix is cached vs one whose prefix is not (same lengths:
    the prefix plus a fresh suffix), and prefill tok/s of a prompt with nothing cached."""
    plen, slen, flen = args.cached_prefix_len, args.suffix_len, args.prefill_len
    total = max(plen + slen, flen) + BLOCK_SIZE
    engine = TorchEngine(
        path,
        device="cpu",
        dtype=dtype,
        block_size=BLOCK_SIZE,
        # Room for two prompts at once, so caching one never evicts the other mid-run.
        num_kv_blocks=3 * blocks_for(total, BLOCK_SIZE),
        max_num_seqs=2,
        max_model_len=total,
        max_prefill_tokens=total,
    )
    vocab = engine.config.vocab_size

    def fresh(n: int, seed: int) -> list[int]:
        return prompts_for(1, n, vocab, seed=seed)[0]

    # Warm-up: oneDNN builds kernels per shape; run each shape once, cached and not.
    warm = fresh(plen, 1000)
    _first_token_s(engine, warm + fresh(slen, 1001))
    _first_token_s(engine, warm + fresh(slen, 1002))
    _first_token_s(engine, fresh(flen, 1003))

    # Every timed run, retries included, gets tokens never seen before (a retried "uncached"
    # run would otherwise find its prefix cached by the first try).
    seeds = itertools.count(2000)
    prefix: list[int] = []

    def uncached_run() -> float:
        nonlocal prefix
        prefix = fresh(plen, next(seeds))  # left in the cache for cached_run
        return _first_token_s(engine, prefix + fresh(slen, next(seeds)))

    def cached_run() -> float:
        return _first_token_s(engine, prefix + fresh(slen, next(seeds)))

    uncached, cached, prefill = [], [], []
    for _ in range(args.reps):
        uncached.append(neighbours.timed(uncached_run))
        cached.append(neighbours.timed(cached_run))
        prefill.append(
            flen / neighbours.timed(lambda: _first_token_s(engine, fresh(flen, next(seeds))))
        )
    stats = engine.stats()
    engine.close()
    row = {
        "model": name,
        "dtype": dtype,
        "cached_prefix_len": plen,
        "suffix_len": slen,
        "ttft_uncached_ms": 1e3 * statistics.median(uncached),
        "ttft_cached_ms": 1e3 * statistics.median(cached),
        "prefill_len": flen,
        "prefill_tok_s": statistics.median(prefill),
        "cache_hit_tokens": stats.prefix_cache_hit_tokens,
        "uncached_samples_s": uncached,
        "cached_samples_s": cached,
    }
    row["ttft_ratio"] = row["ttft_cached_ms"] / row["ttft_uncached_ms"]
    print_prefix_row(row, flush=True)
    return row


PREFIX_HEADER = (
    f"{'model':<18} {'dtype':<9} {'prefix':>6} {'ttft uncached ms':>16} "
    f"{'ttft cached ms':>14} {'ratio':>6} {'prefill tok/s':>13}"
)


def print_prefix_row(row: dict[str, Any], *, flush: bool = False) -> None:
    print(
        f"{row['model']:<18} {row['dtype']:<9} {row['cached_prefix_len']:>6} "
        f"{row['ttft_uncached_ms']:>16.1f} {row['ttft_cached_ms']:>14.1f} "
        f"{row['ttft_ratio']:>6.3f} {row['prefill_tok_s']:>13.1f}",
        flush=flush,
    )


def run_prefix_cache_bench(
    plan: list[tuple[str, str]], args: argparse.Namespace, neighbours: Neighbours
) -> list[dict[str, Any]]:
    print(
        f"\nprefix cache: TTFT of {args.cached_prefix_len} cached + {args.suffix_len} new tokens"
        f" vs all {args.cached_prefix_len + args.suffix_len} new (goal: ratio <= 0.2);"
        f" prefill of {args.prefill_len} tokens; median of {args.reps}\n"
    )
    print(PREFIX_HEADER)
    rows = []
    for name, dtype in plan:
        path = ensure_model(name, args.models_dir)
        rows.append(bench_prefix_cache(name, path, dtype, args, neighbours))
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
        print_async_row(row, flush=True)
    for engine in engines.values():
        engine.close()
    return rows


ASYNC_HEADER = (
    f"{'model':<18} {'dtype':<9} {'batch':>5} {'async tok/s':>11} {'sync tok/s':>10} "
    f"{'ratio':>6} {'async min-max':>15} {'sync min-max':>15} {'ahead used/wasted':>17}"
)


def print_async_row(row: dict[str, Any], *, flush: bool = False) -> None:
    def spread(xs: list[float]) -> str:
        return f"{min(xs):.0f}-{max(xs):.0f}"

    print(
        f"{row['model']:<18} {row['dtype']:<9} {row['batch']:>5} {row['async_tok_s']:>11.1f} "
        f"{row['sync_tok_s']:>10.1f} {row['ratio']:>6.3f} {spread(row['async_samples']):>15} "
        f"{spread(row['sync_samples']):>15} "
        f"{row['rows_used']:>8}/{row['rows_wasted']:<8}",
        flush=flush,
    )


def run_async_bench(
    plan: list[tuple[str, str]], args: argparse.Namespace, neighbours: Neighbours
) -> list[dict[str, Any]]:
    print(
        f"\nasync scheduling on {args.async_device}: decode tok/s with async_scheduling on vs off,"
        f" {args.prompt_len}-token prompts, {args.new_tokens} new tokens, median of {args.reps}"
        " (runs alternate)\n"
    )
    print(ASYNC_HEADER)
    rows = []
    for name, dtype in plan:
        path = ensure_model(name, args.models_dir)
        rows.extend(bench_async(name, path, dtype, args, neighbours))
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--models", default="demo,bench-qwen2-0.5b", help="comma-separated: " + ", ".join(MODELS)
    )
    p.add_argument(
        "--models-dir",
        type=Path,
        default=Path(os.environ.get("MESHSERVE_MODELS_DIR", ROOT / "models")),
    )
    p.add_argument("--demo-dtypes", default="float32,bfloat16")
    p.add_argument(
        "--bench-dtypes", default="bfloat16", help="dtypes for the Qwen2-0.5B-shaped model"
    )
    p.add_argument("--batches", default="1,4,8", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--reps", type=int, default=3, help="runs per point; medians are reported")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-hf", action="store_true", help="skip transformers generate")
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "engine.json")
    p.add_argument("--no-decode", action="store_true", help="skip the decode throughput table")
    p.add_argument("--no-prefix-cache", action="store_true", help="skip the prefix cache table")
    p.add_argument("--no-async-ab", action="store_true", help="skip the async scheduling table")
    p.add_argument("--async-batches", default="1,8", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--async-device", default="cpu", help="device of the async scheduling table")
    p.add_argument("--cached-prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=16, help="new tokens after the prefix")
    p.add_argument("--prefill-len", type=int, default=512)
    args = p.parse_args(argv)
    if args.new_tokens < 2:
        p.error("--new-tokens must be at least 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    neighbours = Neighbours()
    bandwidth = neighbours.timed(measure_bandwidth)
    print(f"torch {torch.__version__}, {args.threads} threads, read bandwidth {bandwidth:.1f} GB/s")
    rows: list[dict[str, Any]] = []
    plan: list[tuple[str, str]] = []
    for name in args.models.split(","):
        if name not in MODELS:
            raise SystemExit(f"unknown model {name!r}; known: {', '.join(MODELS)}")
        dtypes = args.demo_dtypes if name == "demo" else args.bench_dtypes
        plan.extend((name, d) for d in dtypes.split(","))
    if not args.no_decode:
        print(
            f"{args.prompt_len}-token prompts, {args.new_tokens} new tokens, median of {args.reps}\n"
        )
        print(HEADER)
        for name, dtype in plan:
            path = ensure_model(name, args.models_dir)
            rows.extend(bench_model(name, path, dtype, args, bandwidth, neighbours))
    prefix_rows = [] if args.no_prefix_cache else run_prefix_cache_bench(plan, args, neighbours)
    async_rows = [] if args.no_async_ab else run_async_bench(plan, args, neighbours)

    result = {
        "host": {
            "machine": platform.machine(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "threads": args.threads,
        },
        "bandwidth_gb_s": bandwidth,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "reps": args.reps,
        "contended_runs_repeated": neighbours.retries,
        "rows": rows,
        "goals": [goals(rows, name, dtype) for name, dtype in plan],
        "prefix_cache": prefix_rows,
        "async_scheduling": async_rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print()
    for g in result["goals"]:
        parts = []
        if "engine_vs_hf_batch1" in g:
            parts.append(f"engine/hf at batch 1 = {g['engine_vs_hf_batch1']:.2f} (goal >= 1)")
        if "batch8_vs_batch1" in g:
            parts.append(f"batch 8 / batch 1 = {g['batch8_vs_batch1']:.1f}x (goal >= 4)")
        if parts:
            print(f"{g['model']} {g['dtype']}: " + "; ".join(parts))
    for r in prefix_rows:
        print(
            f"{r['model']} {r['dtype']}: cached/uncached TTFT = {r['ttft_ratio']:.3f}"
            f" (goal <= 0.2); prefill {r['prefill_tok_s']:.0f} tok/s"
        )
    for r in async_rows:
        print(f"{r['model']} {r['dtype']} batch {r['batch']}: async/sync decode = {r['ratio']:.3f}")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
