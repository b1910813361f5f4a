"""Measure an engine's cost model (``costmodel.EngineProfile``) on the real engine.

  meshserve-loadgen profile MODEL_DIR --out profile.json [--engine torch] [--dtype bfloat16]

Runs the engine the TE would run (``engines.factory.create_engine`` with the same settings)
in this process: the load time, prefills of a few prompt lengths (fitted as
``a * n + b * n**2``), and decode steps at a few batch sizes, at a short and a long context
(the difference gives the per-context-token attention cost). Prompts are random token ids:
timing does not depend on content. Medians of a few repetitions. ``weight_bytes`` is the
checkpoint's size (the host weight cache holds the engine's form of it: the same bytes unless
the engine changes the dtype); ``load_cached_s`` is left to its estimate.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from loadgen.costmodel import EngineProfile
from services.task_executor.checkpoint import shard_files
from services.task_executor.engines.capabilities import bind_features
from services.task_executor.engines.factory import choose_engine, create_engine
from services.task_executor.perf_profile import decode_step_s, pace_at_full_budget, prefill_s
from shared.perf_model import fit_prefill
from shared.settings import Settings


def measure_profile(
    model_dir: Path,
    *,
    model: str,
    settings: Settings,
    batches: Sequence[int] = (1, 4, 8, 16),
    # Up to the CPU's paced budget (a longer prompt runs in chunks of it): the fit holds where
    # the simulator uses it. Not shorter: a short prefill's time is the weights' read.
    prefill_lengths: Sequence[int] = (128, 512, 1024, 2048),
    short_context: int = 32,
    long_context: int = 1024,
    steps: int = 12,
    reps: int = 3,
    log=print,
) -> EngineProfile:
    t0 = time.perf_counter()
    engine = create_engine(model, model_dir, settings)
    load_s = time.perf_counter() - t0
    try:
        pace_at_full_budget(engine)
        rng = random.Random(0)
        vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        max_len = engine.max_model_len
        prefill_lengths = [n for n in prefill_lengths if n < max_len]
        long_context = min(long_context, max_len - steps - 4)
        prefill_s(engine, rng, vocab, min(64, max_len - 1))  # warm-up
        pre = [
            statistics.median(prefill_s(engine, rng, vocab, n) for _ in range(reps))
            for n in prefill_lengths
        ]
        log(f"prefill {dict(zip(prefill_lengths, [round(t, 4) for t in pre], strict=True))}")
        a, b = fit_prefill(prefill_lengths, pre)
        short = [decode_step_s(engine, rng, vocab, bsz, short_context, steps) for bsz in batches]
        log(f"decode step at {short_context} tokens {dict(zip(batches, short, strict=True))}")
        long_b = max(x for x in batches if x <= 8)
        long_t = decode_step_s(engine, rng, vocab, long_b, long_context, steps)
        ctx_s = max(
            0.0,
            (long_t - short[list(batches).index(long_b)])
            / (long_b * (long_context - short_context)),
        )
        log(f"decode step at {long_context} tokens, batch {long_b}: {long_t:.4f}s")
        st = engine.stats()
        return EngineProfile(
            model=model,
            load_s=load_s,
            decode_batches=tuple(batches),
            decode_s=tuple(short),
            decode_ctx_s=ctx_s,
            prefill_s=a,
            prefill_s2=b,
            max_num_seqs=settings.task_executor.max_num_seqs,
            max_prefill_tokens=engine.prefill_budget.paced_tokens or engine.prefill_budget.tokens,
            chunked_prefill=engine.prefill_budget.chunked,
            paced=engine.prefill_budget.paced_tokens > 0,
            kv_blocks=st.total_kv_blocks,
            block_size=getattr(engine, "block_size", 16),
            max_model_len=max_len,
            weight_bytes=checkpoint_bytes(model_dir),
            kv_bytes_per_token=(
                exporter.kv_layout.token_bytes
                if (exporter := bind_features(engine).kv_export) is not None
                else 0
            ),
            source={
                "engine": engine.name,
                "device": engine.device,
                "dtype": settings.task_executor.dtype,
                "model_dir": str(model_dir),
                "measured_at": time.strftime("%Y-%m-%d %H:%M"),
                "prefill_lengths": list(prefill_lengths),
                "prefill_s": pre,
                "long_context": long_context,
                "long_context_batch": long_b,
                "long_context_step_s": long_t,
                "chosen_engine": choose_engine(settings),
            },
        )
    finally:
        engine.close()


def checkpoint_bytes(model_dir: Path) -> int:
    """The checkpoint's safetensors files, in bytes (0 where it has none)."""
    try:
        return sum(f.stat().st_size for f in shard_files(model_dir))
    except (FileNotFoundError, KeyError, ValueError):
        return 0
