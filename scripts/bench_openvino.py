"""OpenVINO throughput, through OpenVINOEngine and through OpenVINO GenAI directly.

Helpers for ``scripts/bench_engine.py`` (no CLI of its own): ``bench_openvino`` returns one
row per (weight format, point), where a point is a decode batch size or a prefill.

- decode: B requests with distinct prompts of the same length decode a fixed number of
  tokens greedily (ignore_eos). tok/s counts the tokens after the first over the time after
  the first, as bench_engine does for the torch engine. Engine: the time of every ``step()``
  after the prefill step. Direct: ``ContinuousBatchingPipeline.generate``, timed by GenAI's
  own per-token timestamps, with the same prompts and the same scheduler and plugin
  settings, so the difference is our wrapper's cost (per-step handle polling and Python). ``llm_sdpa_tok_s`` (batch 1
  only) is ``LLMPipeline`` on the stateful SDPA backend, GenAI's single-request fast path.
- prefill: one prompt of ``prefill_len`` tokens, prefilled in one step; tok/s = prompt
  tokens / time to the first token (engine: the first ``step()``; direct: from the call to
  GenAI's first token timestamp).
- bound: what a decode step costs if it only streams the IR's weights once at the measured
  bandwidth, ``batch × bandwidth ÷ weight bytes``. Weight bytes are every constant of the IR
  except those only an embedding lookup (Gather) reads; a tied embedding counts, since the
  LM head reads it whole each step. ``pct_bound`` = engine tok/s ÷ bound.

Timings go through ``timed(fn, *args)`` when given (bench_engine's ``Neighbours.timed``, which
retries runs a busy neighbour disturbed).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
import openvino_genai as ov_genai

from services.task_executor.engines.base import EngineRequest
from services.task_executor.engines.openvino_engine import OpenVINOEngine
from services.task_executor.engines.openvino_engine.engine import CPU_BLOCK_SIZE
from shared.messages.api import SamplingParams

Timed = Callable[..., Any]

# Ops that only reshape or decompress a weight on its way to the op that reads it.
_DECOMPRESSION = {"Convert", "Subtract", "Multiply", "Reshape", "Transpose", "Unsqueeze", "Squeeze"}


def ir_decode_bytes(ir_dir: Path) -> int:
    """Bytes of weights one decode step reads: every constant of the IR but those that only
    feed a Gather (an untied embedding table, of which a step reads one row per token)."""
    model = ov.Core().read_model(Path(ir_dir) / "openvino_model.xml")
    ops = model.get_ordered_ops()  # topological: a node's inputs come before it
    weight_like: set[str] = set()
    for op in ops:
        kind = op.get_type_name()
        if kind == "Constant" or (
            kind in _DECOMPRESSION
            and all(
                i.get_source_output().get_node().get_friendly_name() in weight_like
                for i in op.inputs()
            )
        ):
            weight_like.add(op.get_friendly_name())
    total = 0
    for op in ops:
        if op.get_type_name() != "Constant":
            continue
        readers: set[str] = set()
        stack = [op]
        while stack:
            node = stack.pop()
            for out in node.outputs():
                for target in out.get_target_inputs():
                    consumer = target.get_node()
                    if consumer.get_friendly_name() in weight_like:
                        stack.append(consumer)
                    else:
                        readers.add(consumer.get_type_name())
        if readers != {"Gather"}:
            total += op.get_byte_size()
    return total


def measure_bandwidth(gib: float = 1.0, reps: int = 7) -> float:
    """Read bandwidth in GB/s, measured as bench_engine measures it (torch, all threads)."""
    import torch

    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    x.sum()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(times) / 1e9


def prompts_for(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    # As bench_engine: ids past the special tokens and inside a small tokenizer's range.
    rng = np.random.default_rng(seed)
    return rng.integers(8, min(vocab, 4000), size=(batch, length)).tolist()


# --- one run each ---------------------------------------------------------------------------


def engine_decode(
    engine: OpenVINOEngine, prompts: list[list[int]], new_tokens: int
) -> tuple[float, float]:
    """(prefill seconds, decode seconds) for one batch run to completion."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"b{time.monotonic_ns()}-{i}", p, params))
    t0 = time.perf_counter()
    first = engine.step()
    t1 = time.perf_counter()
    produced = sum(len(o.new_token_ids) for o in first)
    while engine.has_work():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    t2 = time.perf_counter()
    assert len(first) == len(prompts), "the prefill step did not cover every prompt"
    assert produced == len(prompts) * new_tokens, produced
    return t1 - t0, t2 - t1


def _greedy_config(new_tokens: int) -> ov_genai.GenerationConfig:
    config = ov_genai.GenerationConfig()
    config.max_new_tokens = new_tokens
    config.do_sample = False
    config.ignore_eos = True
    return config


def _token_times_s(perf_metrics: Any) -> list[float]:
    # GenAI's own timestamps (ms) of each step that produced tokens: timing inside the call
    # leaves out its fixed costs, as the engine's step timing does.
    return [t / 1e3 for t in perf_metrics.raw_metrics.m_new_token_times]


def direct_decode(pipe: Any, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds) for one ``ContinuousBatchingPipeline.generate``."""
    ids = [ov.Tensor(np.asarray([p], dtype=np.int64)) for p in prompts]
    t = time.perf_counter()
    results = pipe.generate(ids, [_greedy_config(new_tokens)] * len(prompts))
    assert all(len(r.m_generation_ids[0]) == new_tokens for r in results)
    times = _token_times_s(results[0].perf_metrics)  # shared by the batch's results
    return times[0] - t + _clock_offset(), times[-1] - times[0]


def llm_pipeline_decode(pipe: Any, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds) for one ``LLMPipeline.generate`` of one prompt."""
    ids = ov.Tensor(np.asarray([prompt], dtype=np.int64))
    t = time.perf_counter()
    out = pipe.generate(ids, _greedy_config(new_tokens))
    assert len(out.tokens[0]) == new_tokens, len(out.tokens[0])
    times = _token_times_s(out.perf_metrics)
    return times[0] - t + _clock_offset(), times[-1] - times[0]


def _clock_offset() -> float:
    """perf_counter() minus GenAI's steady clock (both monotonic; on Linux both are
    CLOCK_MONOTONIC, so this is ~0, but it is measured rather than assumed)."""
    return time.perf_counter() - time.clock_gettime(time.CLOCK_MONOTONIC)


# --- the benchmark ----------------------------------------------------------------------------


def bench_openvino(
    model_dir: Path,
    *,
    model_name: str | None = None,
    weight_formats: Sequence[str] = ("int8", "fp16"),
    batches: Sequence[int] = (1, 8, 16),
    prompt_len: int = 32,
    new_tokens: int = 64,
    prefill_len: int = 512,
    reps: int = 3,
    bandwidth_gb_s: float | None = None,
    timed: Timed | None = None,
    inference_precision: str | None = None,
    direct: bool = True,
    llm_pipeline: bool = True,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Rows of decode and prefill throughput for each weight format (IRs converted first if
    missing). ``on_row`` sees each row as soon as it is measured."""
    model_dir = Path(model_dir)
    run = timed or _call
    bandwidth = bandwidth_gb_s if bandwidth_gb_s is not None else run(measure_bandwidth)
    max_batch = max(batches)
    blocks = max(
        max_batch * -(-(prompt_len + new_tokens) // CPU_BLOCK_SIZE),
        -(-(prefill_len + 2) // CPU_BLOCK_SIZE),
    )
    settings: dict[str, Any] = {
        "max_num_seqs": max_batch,
        "num_kv_blocks": blocks + 4,
        # Every prompt of a batch, and the long prompt, prefill in one step.
        "max_num_batched_tokens": max(prefill_len, max_batch * prompt_len),
        "inference_precision": inference_precision,
    }
    rows: list[dict[str, Any]] = []
    for fmt in weight_formats:
        runners = _Runners(
            model_dir, fmt, settings, direct=direct, sdpa=llm_pipeline and 1 in batches
        )
        try:
            samples = runners.measure(
                run,
                batches=batches,
                prompt_len=prompt_len,
                new_tokens=new_tokens,
                prefill_len=prefill_len,
                reps=reps,
            )
        finally:
            runners.close()
        base = {
            "model": model_name or model_dir.name,
            "engine": "openvino",
            "weight_format": fmt,
            "inference_precision": runners.inference_precision,
            "kv_cache_precision": runners.kv_cache_precision,
            "weight_bytes": runners.weight_bytes,
        }
        for point, s in samples.items():
            decode = point.startswith("decode")
            b = int(point.removeprefix("decode b")) if decode else 1
            bound = b * bandwidth * 1e9 / runners.weight_bytes if decode else None
            e = _median(s["engine"])
            row = base | {
                "point": point,
                "batch": b,
                "engine_tok_s": e,
                "engine_best_tok_s": max(s["engine"]),
                "direct_tok_s": _median(s["direct"]),
                "direct_best_tok_s": max(s["direct"], default=None),
                "engine_vs_direct": _median(
                    [x / y for x, y in zip(s["engine"], s["direct"], strict=False)]
                ),
                "llm_sdpa_tok_s": _median(s["sdpa"]) if s["sdpa"] else None,
                "bound_tok_s": bound,
                "pct_bound": 100 * e / bound if bound else None,
                "pct_bound_best": 100 * max(s["engine"]) / bound if bound else None,
                "samples": s,
            }
            rows.append(row)
            if on_row:
                on_row(row)
    return rows


class _Runners:
    """The three ways to run one IR, alive together: the engine, GenAI's
    ContinuousBatchingPipeline, and LLMPipeline on SDPA. They are measured in turn within
    each repetition so that a slow spell of the host (other VMs share its memory bandwidth)
    hits them alike, and their ratio is taken per repetition."""

    def __init__(
        self, model_dir: Path, fmt: str, settings: dict[str, Any], *, direct: bool, sdpa: bool
    ) -> None:
        self.engine = OpenVINOEngine(model_dir, weight_format=fmt, **settings)
        self.vocab = self.engine.config.vocab_size
        self.weight_bytes = ir_decode_bytes(self.engine.ir_dir)
        self.inference_precision = self.engine.inference_precision
        self.kv_cache_precision = self.engine.kv_cache_precision
        self.pipe = (
            _direct_pipeline(
                self.engine.ir_dir,
                settings,
                inference_precision=self.inference_precision,
                kv_cache_precision=self.kv_cache_precision,
            )
            if direct
            else None
        )
        self.sdpa = (
            ov_genai.LLMPipeline(
                str(self.engine.ir_dir),
                "CPU",
                ATTENTION_BACKEND="SDPA",
                INFERENCE_PRECISION_HINT=self.inference_precision,
            )
            if sdpa
            else None
        )

    def runs(self, run: Timed, prompts: list[list[int]], n: int) -> dict[str, tuple[float, float]]:
        out = {"engine": run(engine_decode, self.engine, prompts, n)}
        if self.pipe is not None:
            out["direct"] = run(direct_decode, self.pipe, prompts, n)
        if self.sdpa is not None and len(prompts) == 1 and n > 2:
            out["sdpa"] = run(llm_pipeline_decode, self.sdpa, prompts[0], n)
        return out

    def measure(
        self,
        run: Timed,
        *,
        batches: Sequence[int],
        prompt_len: int,
        new_tokens: int,
        prefill_len: int,
        reps: int,
    ) -> dict[str, dict[str, list[float]]]:
        # Warm-up: the plugin compiles kernels for each new shape on first use.
        for b in batches:
            self.runs(_call, prompts_for(b, prompt_len, self.vocab, 99), 4)
        self.runs(_call, prompts_for(1, prefill_len, self.vocab, 98), 2)

        prefill = f"prefill {prefill_len}"
        points = [f"decode b{b}" for b in batches] + [prefill]
        samples = {p: {"engine": [], "direct": [], "sdpa": []} for p in points}
        for rep in range(reps):
            for b in batches:
                prompts = prompts_for(b, prompt_len, self.vocab, rep)
                for how, (_, dec) in self.runs(run, prompts, new_tokens).items():
                    samples[f"decode b{b}"][how].append(b * (new_tokens - 1) / dec)
            prompts = prompts_for(1, prefill_len, self.vocab, 1000 + rep)
            for how, (pre, _) in self.runs(run, prompts, 2).items():
                samples[prefill][how].append(prefill_len / pre)
        return samples

    def close(self) -> None:
        self.engine.close()
        self.pipe = self.sdpa = None


def _direct_pipeline(
    ir: Path, settings: dict[str, Any], *, inference_precision: str, kv_cache_precision: str
) -> Any:
    sched = ov_genai.SchedulerConfig()
    sched.num_kv_blocks = settings["num_kv_blocks"]
    sched.max_num_seqs = settings["max_num_seqs"]
    sched.max_num_batched_tokens = settings["max_num_batched_tokens"]
    sched.dynamic_split_fuse = True
    sched.enable_prefix_caching = True  # as the engine runs
    props = {
        "INFERENCE_PRECISION_HINT": inference_precision,
        "KV_CACHE_PRECISION": kv_cache_precision,
    }
    return ov_genai.ContinuousBatchingPipeline(str(ir), sched, "CPU", props)


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def _median(samples: list[float]) -> float:
    return statistics.median(samples) if samples else float("nan")


HEADER = (
    f"{'model':<18} {'weights':<7} {'point':<12} {'engine tok/s':>12} {'(best)':>7} "
    f"{'direct tok/s':>12} {'eng/dir':>7} {'sdpa tok/s':>10} {'bound tok/s':>11} "
    f"{'%bound':>6} {'(best)':>6} {'weight MB':>9}"
)


def format_row(row: dict[str, Any]) -> str:
    def num(v: float | None, fmt: str = ".1f") -> str:
        return "-" if v is None or v != v else format(v, fmt)

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}%"

    return (
        f"{row['model']:<18} {row['weight_format']:<7} {row['point']:<12} "
        f"{num(row['engine_tok_s']):>12} {num(row['engine_best_tok_s']):>7} "
        f"{num(row['direct_tok_s']):>12} {num(row['engine_vs_direct'], '.2f'):>7} "
        f"{num(row['llm_sdpa_tok_s']):>10} {num(row['bound_tok_s']):>11} "
        f"{pct(row['pct_bound']):>6} {pct(row['pct_bound_best']):>6} "
        f"{row['weight_bytes'] / 1e6:>9.0f}"
    )
