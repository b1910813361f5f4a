"""Batched multi-LoRA serving on the torch engine (``torch_engine/lora.py``): what adapters
cost a decoding batch, what LoRA costs when no request uses it, and how long an adapter takes
to come in on demand.

On the bench model (Qwen2-0.5B's shapes), with ``--adapters`` random rank ``--rank`` adapters
on q, k, v and o, made with peft into a temporary directory:
- decode tok/s of a batch of ``--batch`` requests spread evenly over 1, 2, 4, ... distinct
  adapters, against the same batch on the base model, in the same engine (``--adapter-counts``);
- the base model's decode tok/s in that engine (LoRA on, adapters resident, none used) against
  an engine built without LoRA;
- loading an adapter into the warm engine on demand: ``load_adapter`` (its files read, checked
  and stacked in host memory) and, when the first request under it is scheduled, its copy into
  a device slot (evicting another), medians of ``--load-reps``;
- LoRA training throughput as a fine-tuning job runs it (``--train-examples``, 0: skipped).

Decode tok/s: ``batch * (new_tokens - 1)`` over the time from the end of the (one) prefill
step to the last token; runs of every configuration alternate within a repetition (their order
rotating), medians of ``--reps``. Goals (issue 30): >= 0.8x the base at 8 adapters, >= 0.98x
with LoRA on but unused, a load <= 100 ms.

    scripts/bench-lora            # writes bench-results/lora.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    RESULTS,
    Col,
    Neighbours,
    Table,
    call,
    ensure_model,
    models_dir,
    numbers,
    prompts_for,
    write_result,
)
from bench.torch_decode import decode_engine
from services.task_executor.engines.base import EngineRequest
from services.task_executor.engines.torch_engine import TorchEngine
from services.task_executor.engines.torch_engine.lora import LoraLimits
from services.task_executor.training.lora import fast_dtype
from shared.messages.api import SamplingParams

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def make_adapters(model_dir: Path, out: Path, count: int, rank: int) -> list[Path]:
    """``count`` random rank-``rank`` LoRA adapters of the model on q, k, v and o, in peft's
    layout (peft's own A; B random too, since peft starts it at zero)."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(TARGETS))
    model = peft.get_peft_model(base, config)
    paths = []
    for i in range(count):
        gen = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(0.02 * torch.randn(p.shape, generator=gen))
        path = out / f"adapter-{i}"
        model.save_pretrained(path)
        paths.append(path)
    del model, base
    return paths


def decode_s(engine: TorchEngine, prompts: list[list[int]], adapters: list[str], new: int) -> float:
    """Seconds of the decode steps of one batch (request ``i`` under ``adapters[i]``, ""
    for the base), the prefill step excluded."""
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    for i, (p, a) in enumerate(zip(prompts, adapters, strict=True)):
        engine.add_request(EngineRequest(f"l{time.monotonic_ns()}-{i}", p, params, adapter=a))
    first = engine.step()
    assert len(first) == len(prompts), "the prefill step did not cover every prompt"
    t0 = time.perf_counter()
    produced = len(first)
    while engine.has_work():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    assert produced == len(prompts) * new, produced
    return time.perf_counter() - t0


def spread(names: list[str], k: int, batch: int) -> list[str]:
    """``batch`` requests over the first ``k`` adapters (0: the base model), evenly."""
    return [names[i % k] if k else "" for i in range(batch)]


def load_on_demand(
    engine: TorchEngine, paths: list[Path], reps: int, prompt: list[int]
) -> dict[str, Any]:
    """Median milliseconds of ``load_adapter`` and of the slot install its first request
    triggers, for ``reps`` adapters new to the engine (each evicts a resident one)."""
    stats = engine.lora_stats
    assert stats is not None
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    loads, installs = [], []
    for k in range(reps):
        name = f"fresh-{k}"
        t0 = time.perf_counter()
        engine.load_adapter(name, str(paths[k % len(paths)]))
        loads.append(time.perf_counter() - t0)
        before = (stats.installs, stats.install_s)
        engine.add_request(EngineRequest(f"load-{k}", prompt, params, adapter=name))
        while engine.has_work():
            engine.step()
        assert stats.installs == before[0] + 1
        installs.append(stats.install_s - before[1])
        engine.unload_adapter(name)
    total = [a + b for a, b in zip(loads, installs, strict=True)]
    return {
        "load_ms": 1e3 * statistics.median(loads),
        "install_ms": 1e3 * statistics.median(installs),
        "total_ms": 1e3 * statistics.median(total),
        "load_samples_ms": [1e3 * s for s in loads],
        "install_samples_ms": [1e3 * s for s in installs],
    }


THROUGHPUT = Table(
    [
        Col("config", "config", left=True, width=22),
        Col("adapters", "adapters", width=8),
        Col("tok_s", "decode tok/s", ".1f"),
        Col("ratio", "x base", ".3f"),
        Col(lambda r: f"{min(r['samples']):.0f}-{max(r['samples']):.0f}", "min-max", width=9),
    ]
)


def training_rate(
    model_dir: Path, out: Path, rank: int, examples: int, batch: int, autocast: torch.dtype | None
) -> dict[str, Any]:
    """LoRA training throughput as a fine-tuning job's train stage runs it
    (``training/lora.py``, computing in ``autocast`` or fp32): ``examples`` chat examples of equal length
    in batches of ``batch``, one epoch; training tokens a second over the steps after the
    first (the first pays the allocator's warm-up)."""
    import json

    import transformers

    from services.task_executor.training.lora import LoraConfig, read_examples, train_lora

    data = out / "train.jsonl"
    words = " ".join(f"w{k}" for k in range(48))
    lines = [
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": f"Question {i:04d}: {words}"},
                    {"role": "assistant", "content": f"Answer {i:04d}: {words}"},
                ]
            }
        )
        for i in range(examples)
    ]
    data.write_text("\n".join(lines) + "\n")
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    tokens = sum(len(e.input_ids) for e in read_examples(data, tok, 1024))
    stamps: list[float] = []
    train_lora(
        model_dir,
        data,
        out / "trained",
        LoraConfig(n_epochs=1, batch_size=batch, rank=rank, alpha=2 * rank, autocast=autocast),
        on_step=lambda step, loss: stamps.append(time.perf_counter()),
    )
    steps = len(stamps)
    per_step = tokens / steps
    return {
        "precision": str(autocast or torch.float32).removeprefix("torch."),
        "examples": examples,
        "batch": batch,
        "tokens": tokens,
        "steps": steps,
        "tokens_per_s": per_step * (steps - 1) / (stamps[-1] - stamps[0]),
        "step_s": (stamps[-1] - stamps[0]) / (steps - 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="scripts/bench-lora",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="bench-qwen2-0.5b")
    p.add_argument("--models-dir", type=Path, default=None, help="default: MESHSERVE_MODELS_DIR")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--adapter-counts", type=numbers, default=[1, 2, 4, 8])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=3, help="runs per configuration (medians)")
    p.add_argument("--load-reps", type=int, default=7)
    p.add_argument("--train-examples", type=int, default=24, help="0: no training run")
    p.add_argument("--train-batch", type=int, default=4)
    p.add_argument("--quiet", action="store_true", help="wait for quiet neighbours before each run")
    p.add_argument("--out", type=Path, default=RESULTS / "lora.json")
    args = p.parse_args(argv)
    path = ensure_model(args.model, args.models_dir or models_dir())
    n_adapters = max(args.adapter_counts)
    neighbours = Neighbours(enabled=args.quiet)
    timed: Callable[..., Any] = neighbours.timed if args.quiet else call

    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        t0 = time.perf_counter()
        paths = make_adapters(path, Path(tmp), n_adapters, args.rank)
        print(f"{n_adapters} rank-{args.rank} adapters made in {time.perf_counter() - t0:.1f} s")
        limits = LoraLimits(max_adapters=n_adapters)
        prefill = args.batch * args.prompt_len  # one prefill step
        engines = {
            "lora": decode_engine(
                path, args.dtype, args.batch, args, lora=limits, max_prefill_tokens=prefill
            ),
            "plain": decode_engine(
                path, args.dtype, args.batch, args, lora=None, max_prefill_tokens=prefill
            ),
        }
        lora = engines["lora"]
        names = [f"a{i}" for i in range(n_adapters)]
        for name, adapter in zip(names, paths, strict=True):
            lora.load_adapter(name, str(adapter))
        vocab = lora.config.vocab_size
        # (engine, adapters in the batch); 0 adapters on "plain": the engine without LoRA
        configs = [("plain", 0), ("lora", 0), *(("lora", k) for k in args.adapter_counts)]
        for engine_name, k in configs:  # warm-up, and every adapter into its slot
            warm = prompts_for(args.batch, args.prompt_len, vocab, seed=1000)
            decode_s(engines[engine_name], warm, spread(names, k, args.batch), 4)
        samples: dict[tuple[str, int], list[float]] = {c: [] for c in configs}
        for rep in range(args.reps):
            prompts = prompts_for(args.batch, args.prompt_len, vocab, seed=rep)
            shift = rep % len(configs)
            for engine_name, k in configs[shift:] + configs[:shift]:
                dec = timed(
                    decode_s,
                    engines[engine_name],
                    prompts,
                    spread(names, k, args.batch),
                    args.new_tokens,
                )
                samples[engine_name, k].append(args.batch * (args.new_tokens - 1) / dec)
        rate = {c: statistics.median(s) for c, s in samples.items()}
        rows = []
        for engine_name, k in configs:
            base = rate["plain", 0] if (engine_name, k) == ("lora", 0) else rate["lora", 0]
            label = (
                "no LoRA (plain engine)"
                if engine_name == "plain"
                else "LoRA on, unused"
                if k == 0
                else f"{k} adapter{'s' * (k > 1)}"
            )
            rows.append(
                {
                    "config": label,
                    "engine": engine_name,
                    "adapters": k,
                    "tok_s": rate[engine_name, k],
                    # adapters: against the base batch in the same engine; LoRA on and
                    # unused: against the engine built without LoRA
                    "ratio": rate[engine_name, k] / base if engine_name == "lora" else 1.0,
                    "samples": samples[engine_name, k],
                }
            )
        print(
            f"\ndecode of {args.batch} requests ({args.prompt_len}-token prompts, "
            f"{args.new_tokens} new tokens) on {lora.device}, {lora.dtype}, "
            f"median of {args.reps}\n"
        )
        THROUGHPUT.print(rows)
        engines["plain"].close()
        load = load_on_demand(lora, paths, args.load_reps, prompts_for(1, 16, vocab, seed=7)[0])
        print(
            f"\nrank-{args.rank} adapter on demand (median of {args.load_reps}): load_adapter "
            f"{load['load_ms']:.1f} ms + slot install {load['install_ms']:.1f} ms = "
            f"{load['total_ms']:.1f} ms"
        )
        lora.close()
        train = []
        # What a job computes in here (the default, `auto`), and float32 beside it.
        for autocast in dict.fromkeys([fast_dtype(lora.device), None]):
            if not args.train_examples:
                break
            run = training_rate(
                path, Path(tmp), args.rank, args.train_examples, args.train_batch, autocast
            )
            train.append(run)
            print(
                f"\nLoRA training (rank {args.rank}, {run['precision']}, batches of "
                f"{args.train_batch}, {run['tokens'] / args.train_examples:.0f}-token examples): "
                f"{run['tokens_per_s']:.0f} training tokens/s, {run['step_s']:.2f} s a step"
            )

    by = {(r["engine"], r["adapters"]): r for r in rows}
    most = max(args.adapter_counts)
    result = {
        "model": args.model,
        "dtype": str(lora.dtype),
        "batch": args.batch,
        "rank": args.rank,
        "targets": list(TARGETS),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "reps": args.reps,
        "throughput": rows,
        "load": load,
        "training": train,
        "goals": {
            f"{most}_adapters_vs_base": by["lora", most]["ratio"],
            "enabled_unused_vs_no_lora": by["lora", 0]["ratio"],
            "load_total_ms": load["total_ms"],
        },
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
