"""OpenVINO throughput: through OpenVINOEngine, through meshserve's API, and through OpenVINO
GenAI called directly.

Helpers for ``bench/engine.py`` (no CLI of its own), and its two OpenVINO tables
(``run_openvino_bench``, ``run_openvino_api_bench``).

``bench_openvino`` returns one row per (weight format, point), where a point is a decode batch
size or a prefill:
- decode: B requests with distinct prompts of the same length decode a fixed number of
  tokens greedily (ignore_eos). tok/s counts the tokens after the first over the time after
  the first, as bench/torch_decode.py does for the torch engine. Engine: the time of every
  ``step()`` after the prefill step. Direct: ``ContinuousBatchingPipeline.generate``, timed by
  GenAI's own per-token timestamps, with the same scheduler and plugin settings, so the
  difference is our wrapper's cost (per-step handle polling and Python). ``llm_sdpa_tok_s``
  (batch 1 only) is ``LLMPipeline`` on the stateful SDPA backend, GenAI's single-request fast
  path.
- prefill: one prompt of ``prefill_len`` tokens, prefilled in one step; tok/s = prompt
  tokens / time to the first token (engine: the first ``step()``; direct: from the call to
  GenAI's first token timestamp).
- bound: what a decode step costs if it only streams the IR's weights once at the read
  bandwidth measured just before the run (the host's drifts), ``batch × bandwidth ÷ weight
  bytes``. Weight bytes are every constant of the IR
  except those only an embedding lookup (Gather) reads; a tied embedding counts, since the
  LM head reads it whole each step. ``pct_bound``: the median over runs of engine tok/s ÷
  that run's bound.

``bench_openvino_api`` starts a meshserve cluster (``meshserve up``, one TE,
``MESHSERVE_ENGINE=openvino``, ``MESHSERVE_OPENVINO_WEIGHT_FORMAT`` = the format) and compares
streamed ``/v1/completions`` requests (token-id prompts, greedy, ignore_eos) with GenAI's
``ContinuousBatchingPipeline.generate`` on prompts of the same shape, in this process, on the
pipeline the TE's engine builds (same factory, same settings, same IR). The two alternate
within each repetition and never overlap: the direct runs execute while the cluster is idle
(its CPU during them is recorded). Per point: decode bB, B concurrent requests, per-request
decode tok/s (API: completion tokens after the first ÷ time from the first streamed token to
the last) and TTFT; prefill, one prompt of ``prefill_len`` tokens, prompt tokens ÷ TTFT.

Every timed run gets prompts never seen before (a retried run would otherwise hit the prefix
cache). Timings go through ``timed(fn, *args)`` when given (``bench.common.Neighbours.timed``,
which retries runs a busy neighbour disturbed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
import openvino_genai as ov_genai

from bench.common import (
    Col,
    Neighbours,
    Table,
    bound_tok_s,
    call,
    cpu_ticks,
    engine_decode,
    ensure_model,
    median,
    prompts_for,
    with_bandwidth,
)
from services.task_executor.engines.openvino_engine import OpenVINOEngine
from services.task_executor.engines.openvino_engine.engine import CPU_BLOCK_SIZE

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


# --- one run each ---------------------------------------------------------------------------


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


# --- the engine beside GenAI ------------------------------------------------------------------


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
    timed: Timed | None = None,
    inference_precision: str | None = None,
    direct: bool = True,
    llm_pipeline: bool = True,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Rows of decode and prefill throughput for each weight format (IRs converted first if
    missing). ``on_row`` sees each row as soon as it is measured."""
    model_dir = Path(model_dir)
    run = timed or call
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
            wb = runners.weight_bytes
            # each run's bound at the bandwidth measured next to it
            bounds = [bound_tok_s(b, bw, wb) for bw in s["bandwidth"]] if decode else []
            fractions = [x / y for x, y in zip(s["engine"], bounds, strict=False)]
            e = median(s["engine"])
            row = base | {
                "point": point,
                "batch": b,
                "engine_tok_s": e,
                "engine_best_tok_s": max(s["engine"]),
                "direct_tok_s": median(s["direct"]),
                "direct_best_tok_s": max(s["direct"], default=None),
                "engine_vs_direct": median(
                    [x / y for x, y in zip(s["engine"], s["direct"], strict=False)]
                ),
                "llm_sdpa_tok_s": median(s["sdpa"]) if s["sdpa"] else None,
                "bound_tok_s": median(bounds) if decode else None,
                "pct_bound": 100 * median(fractions) if decode else None,
                "pct_bound_best": 100 * max(fractions) if decode else None,
                "bandwidth_gb_s": median(s["bandwidth"]) if decode else None,
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
        self._seeds = itertools.count(10_000)

    def _fresh(self, batch: int, length: int) -> list[list[int]]:
        return prompts_for(batch, length, self.vocab, next(self._seeds))

    def _engine(self, batch: int, length: int, n: int) -> tuple[float, float]:
        return engine_decode(self.engine, self._fresh(batch, length), n, one_step_prefill=True)

    def _direct(self, batch: int, length: int, n: int) -> tuple[float, float]:
        return direct_decode(self.pipe, self._fresh(batch, length), n)

    def _sdpa(self, batch: int, length: int, n: int) -> tuple[float, float]:
        return llm_pipeline_decode(self.sdpa, self._fresh(1, length)[0], n)

    def runs(self, run: Timed, batch: int, length: int, n: int) -> dict[str, Any]:
        """One run of each way, each on prompts of its own (fresh on every try), and the
        bandwidth measured just before the engine's."""
        bw, engine = run(with_bandwidth, self._engine, batch, length, n)
        out = {"bandwidth": bw, "engine": engine}
        if self.pipe is not None:
            out["direct"] = run(self._direct, batch, length, n)
        if self.sdpa is not None and batch == 1 and n > 2:
            out["sdpa"] = run(self._sdpa, batch, length, n)
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
            self.runs(call, b, prompt_len, 4)
        self.runs(call, 1, prefill_len, 2)

        prefill = f"prefill {prefill_len}"
        points = [f"decode b{b}" for b in batches] + [prefill]
        samples: dict[str, dict[str, list[float]]] = {
            p: {"engine": [], "direct": [], "sdpa": [], "bandwidth": []} for p in points
        }
        for _ in range(reps):
            for b in batches:
                s = samples[f"decode b{b}"]
                for how, got in self.runs(run, b, prompt_len, new_tokens).items():
                    s[how].append(got if how == "bandwidth" else b * (new_tokens - 1) / got[1])
            for how, got in self.runs(run, 1, prefill_len, 2).items():
                samples[prefill][how].append(got if how == "bandwidth" else prefill_len / got[0])
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


def _pct(key: str) -> Callable[[dict[str, Any]], str | None]:
    return lambda r: None if r[key] is None else f"{r[key]:.0f}%"


TABLE = Table(
    [
        Col("model", "model", left=True, width=18),
        Col("weight_format", "weights", left=True, width=7),
        Col("point", "point", left=True, width=12),
        Col("engine_tok_s", "engine tok/s", ".1f"),
        Col("engine_best_tok_s", "(best)", ".1f", width=7),
        Col("direct_tok_s", "direct tok/s", ".1f"),
        Col("engine_vs_direct", "eng/dir", ".2f", width=7),
        Col("llm_sdpa_tok_s", "sdpa tok/s", ".1f"),
        Col("bound_tok_s", "bound tok/s", ".1f"),
        Col(_pct("pct_bound"), "%bound"),
        Col(_pct("pct_bound_best"), "(best)"),
        Col(lambda r: r["weight_bytes"] / 1e6, "weight MB", ".0f", width=9),
    ]
)


# --- through meshserve's API, beside GenAI called directly ------------------------------------


class _Api:
    """Streamed /v1/completions requests on one keep-alive session and one event loop, so
    that every run after the first reuses its connections."""

    def __init__(self, url: str, model: str) -> None:
        from loadgen.client import stream_completion

        self.url, self.model, self._stream = url, model, stream_completion
        self.loop = asyncio.new_event_loop()
        self.session = self.loop.run_until_complete(self._open())

    @staticmethod
    async def _open() -> Any:
        import aiohttp

        return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900))

    def run(self, prompts: list[list[int]], max_tokens: int) -> list[Any]:
        """The records of ``len(prompts)`` requests sent at once; raises on any failure."""

        async def send() -> list[Any]:
            bodies = [
                {
                    "model": self.model,
                    "prompt": p,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                for p in prompts
            ]
            return await asyncio.gather(*(self._stream(self.session, self.url, b) for b in bodies))

        records = self.loop.run_until_complete(send())
        for rec, p in zip(records, prompts, strict=True):
            if rec.error is not None:
                raise RuntimeError(f"API request failed ({rec.status}): {rec.error}")
            if (rec.prompt_tokens, rec.completion_tokens) != (len(p), max_tokens):
                raise RuntimeError(
                    f"expected {len(p)} prompt / {max_tokens} completion tokens, "
                    f"got {rec.prompt_tokens} / {rec.completion_tokens}"
                )
        return records

    def close(self) -> None:
        self.loop.run_until_complete(self.session.close())
        self.loop.close()


def api_point(
    api: _Api, batch: int, length: int, n: int, vocab: int, seeds: Iterator[int]
) -> tuple[float, float | None]:
    """(median TTFT s, median per-request decode tok/s) of ``batch`` concurrent requests."""
    records = api.run(prompts_for(batch, length, vocab, next(seeds)), n)
    rates = [r.decode_tok_s for r in records if r.decode_tok_s is not None]
    return median([r.ttft_s for r in records]), median(rates) if n > 1 else None


def direct_point(
    pipe: Any, batch: int, length: int, n: int, vocab: int, seeds: Iterator[int], watch: list[int]
) -> tuple[float, float | None, float]:
    """(TTFT s, per-request decode tok/s, cores the processes ``watch`` used meanwhile) of one
    ``generate`` of ``batch`` prompts."""
    prompts = prompts_for(batch, length, vocab, next(seeds))
    ticks, t = cpu_ticks(watch), time.monotonic()
    ttft, dec = direct_decode(pipe, prompts, n)
    cores = (cpu_ticks(watch) - ticks) / os.sysconf("SC_CLK_TCK") / max(time.monotonic() - t, 1e-3)
    return ttft, (n - 1) / dec if n > 1 else None, cores


def serving_te(url: str, model: str, ir_dir: Path) -> dict[str, Any]:
    """The TE serving ``model``, from the cluster's /health, checked to run the OpenVINO
    engine on the IR in ``ir_dir`` (the IR's weights file is memory-mapped by the runtime, so
    the TE's /proc/<pid>/maps names the IR it loaded)."""
    with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=5) as r:
        health = json.loads(r.read())
    tes = [te for te in health.get("task_executors", []) if te.get("model") == model]
    if len(tes) != 1 or tes[0].get("engine") != "openvino":
        raise RuntimeError(f"expected one OpenVINO TE serving {model}, /health says {tes}")
    te = tes[0]
    mapped: set[str] = set()
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{te['pid']}/maps").read_text().splitlines():
            path = line.split(maxsplit=5)[5:]
            if path and path[0].endswith("openvino_model.bin"):
                mapped.add(path[0])
    want = str((ir_dir / "openvino_model.bin").resolve())
    if mapped and want not in {str(Path(m).resolve()) for m in mapped}:
        raise RuntimeError(f"the TE serves {sorted(mapped)}, not {want}")
    return {"pid": te["pid"], "engine": te["engine"], "ir_weights_mapped": sorted(mapped)}


def bench_openvino_api(
    model_dir: Path,
    *,
    log_dir: Path,
    model_name: str | None = None,
    weight_formats: Sequence[str] = ("int8",),
    batches: Sequence[int] = (1, 8),
    prompt_len: int = 32,
    new_tokens: int = 64,
    prefill_len: int = 512,
    reps: int = 3,
    neighbours: Neighbours | None = None,
    startup_timeout: float = 600.0,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Rows of meshserve's API beside GenAI called directly, per weight format and point.
    The servers' logs go to ``log_dir``."""
    from bench import vs_vllm as vs
    from services.task_executor.engines.factory import openvino_engine, openvino_engine_args
    from shared.settings import Settings

    model_dir = Path(model_dir).resolve()
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    log_dir.mkdir(parents=True, exist_ok=True)
    prefill = f"prefill {prefill_len}"
    # (batch, prompt length, new tokens) of each point
    shapes = {f"decode b{b}": (b, prompt_len, new_tokens) for b in batches}
    shapes[prefill] = (1, prefill_len, 2)
    seeds = itertools.count(20_000)
    rows: list[dict[str, Any]] = []
    for fmt in weight_formats:
        env = {"MESHSERVE_ENGINE": "openvino", "MESHSERVE_OPENVINO_WEIGHT_FORMAT": fmt}
        api: _Api | None = None
        engine: Any = None
        saved_ours = neighbours.ours if neighbours else None
        with tempfile.TemporaryDirectory(prefix="bench-ov-api-") as tmp:
            server = vs.meshserve_cluster(
                "openvino", model_dir, Path(tmp), log_dir, "bfloat16", env
            )
            try:
                url = server.start(startup_timeout)
                assert server.up is not None
                vs.wait_for_model(server.up, url, startup_timeout)
                api = _Api(url, vs.MODEL_ID)
                # Warm-up: the first request loads the model onto the TE; then every shape
                # once, as the plugin compiles kernels per shape.
                api.run(prompts_for(1, prompt_len, vocab, 99), 4)
                for b, length, _ in shapes.values():
                    api.run(prompts_for(b, length, vocab, 98), 4)
                pids = server.pids()  # the cluster's processes: ours while it serves
                if neighbours is not None:
                    neighbours.ours = pids.copy
                # GenAI called directly: the very pipeline the TE's engine builds (same
                # arguments from the same settings, same IR; in this process where the TE
                # runs it in a child), driven by generate() instead of the engine's
                # add_request/step/handle polling, the pipe to the child, HTTP, NATS and the
                # frontend.
                settings = Settings(engine="openvino", openvino_weight_format=fmt)
                engine = openvino_engine(model_dir, **openvino_engine_args(settings))
                pipe = engine._pipe
                te = serving_te(url, vs.MODEL_ID, engine.ir_dir)
                for b, length, _ in shapes.values():
                    direct_decode(pipe, prompts_for(b, length, vocab, 97), 4)
                run = neighbours.timed if neighbours is not None else call
                samples = {
                    p: {"api_tok_s": [], "direct_tok_s": [], "api_ttft_s": [],
                        "direct_ttft_s": [], "cluster_cores": []}
                    for p in shapes
                }  # fmt: skip
                for rep in range(reps):
                    for point, (b, length, n) in shapes.items():
                        s = samples[point]
                        # Alternate which goes first, so a drift of the host hits both alike.
                        for how in ("api", "direct") if rep % 2 == 0 else ("direct", "api"):
                            if how == "api":
                                ttft, rate = run(api_point, api, b, length, n, vocab, seeds)
                            else:
                                ttft, rate, cores = run(
                                    direct_point, pipe, b, length, n, vocab, seeds, pids
                                )
                                s["cluster_cores"].append(cores)
                            s[f"{how}_ttft_s"].append(ttft)
                            s[f"{how}_tok_s"].append(length / ttft if point == prefill else rate)
                base = {
                    "model": model_name or model_dir.name,
                    "engine": "openvino",
                    "weight_format": fmt,
                    "inference_precision": engine.inference_precision,
                    "kv_cache_precision": engine.kv_cache_precision,
                    "num_kv_blocks": engine.num_kv_blocks,
                    "te": te,
                }
                for point, s in samples.items():
                    b, length, n = shapes[point]
                    row = base | {
                        "point": point,
                        "batch": b,
                        "prompt_len": length,
                        "new_tokens": n,
                        "api_tok_s": median(s["api_tok_s"]),
                        "direct_tok_s": median(s["direct_tok_s"]),
                        "api_vs_direct": median(
                            [a / d for a, d in zip(s["api_tok_s"], s["direct_tok_s"], strict=True)]
                        ),
                        "api_ttft_ms": 1e3 * median(s["api_ttft_s"]),
                        "direct_ttft_ms": 1e3 * median(s["direct_ttft_s"]),
                        "cluster_cores_during_direct": max(s["cluster_cores"]),
                        "samples": s,
                    }
                    rows.append(row)
                    if on_row:
                        on_row(row)
            finally:
                if neighbours is not None:
                    neighbours.ours = saved_ours
                if api is not None:
                    api.close()
                if engine is not None:
                    engine.close()
                server.stop(grace=45)
    return rows


API_TABLE = Table(
    [
        Col("model", "model", left=True, width=18),
        Col("weight_format", "weights", left=True, width=7),
        Col("point", "point", left=True, width=12),
        Col("api_tok_s", "api tok/s", ".1f", width=9),
        Col("direct_tok_s", "direct tok/s", ".1f"),
        Col("api_vs_direct", "api/dir", ".3f", width=7),
        Col("api_ttft_ms", "api TTFT ms", ".1f"),
        Col("direct_ttft_ms", "dir TTFT ms", ".1f"),
        Col("cluster_cores_during_direct", "idle cluster cores", ".3f"),
    ]
)


# --- scripts/bench-engine's OpenVINO tables ----------------------------------------------------


def run_openvino_bench(args: argparse.Namespace, neighbours: Neighbours) -> list[dict[str, Any]]:
    print(
        f"\nOpenVINO ({', '.join(args.ov_formats)} IR): engine vs GenAI ContinuousBatchingPipeline"
        f" called directly (sdpa: LLMPipeline on SDPA), {args.prompt_len}-token prompts,"
        f" {args.new_tokens} new tokens; prefill of {args.prefill_len} tokens; median of"
        f" {args.reps} (goal: batch 1 >= 70% of the bound)\n"
    )
    TABLE.header()
    rows: list[dict[str, Any]] = []
    for name in args.ov_models:
        rows += bench_openvino(
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
            on_row=TABLE.row,
        )
    return rows


def run_openvino_api_bench(
    args: argparse.Namespace, neighbours: Neighbours
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    print(
        f"\nmeshserve API (MESHSERVE_ENGINE=openvino, one TE) vs GenAI called directly on the"
        f" TE's pipeline: per-request decode tok/s of {args.prompt_len}-token prompts +"
        f" {args.new_tokens} tokens at concurrency {', '.join(map(str, args.ov_api_batches))};"
        f" prefill tok/s = {args.prefill_len} / TTFT; median of {args.reps}, runs alternate"
        " (goal: api/dir >= 0.95)\n"
    )
    API_TABLE.header()
    rows: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    log_dir = args.out.parent / f"{args.out.stem}-logs"
    for name in args.ov_models:
        try:
            rows += bench_openvino_api(
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
                on_row=API_TABLE.row,
            )
        except (RuntimeError, OSError) as e:
            print(f"{name}: the API benchmark failed: {e}", flush=True)
            errors[f"openvino_api {name}"] = str(e)
    print(f"(cluster logs: {log_dir})")
    return rows, errors
