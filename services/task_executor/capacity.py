"""How much one instance of a model sustains on this engine and device, measured on the
engine itself: the scaler sizes each model's fleet from it (``services/scaler/target.py``).

Measured once per model architecture, engine and kind of host, offline where it can be:
``meshserve profile MODEL_DIR`` (``scripts/up`` runs it for the demo model) measures it and
stores it with the model (``MODEL_STORE`` in the checkpoint's directory) and on the host
(``CapacityStore`` under ``MESHSERVE_CAPACITY_CACHE``). A load finds it there (or the scaler
hands it over from Redis) and measures nothing; only a load that finds none measures it,
before it turns ready (0.3 s for the demo model alone, up to 2 s under load), and stores it
in both places. Prompts are random token ids (timing does not depend on content).
``meshserve-loadgen profile`` measures a fuller cost model with the same two probes
(``prefill_s`` and ``decode_step_s``)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec

from services.task_executor.engines.base import Engine, EngineRequest
from services.task_executor.engines.capabilities import bind_features
from shared.messages.api import SamplingParams
from shared.messages.scaling import InstanceCapacity
from shared.settings import Settings

CAPACITY_PROMPT_TOKENS = 512  # the prefill probe (clipped to half the context)
CAPACITY_DECODE_CONTEXT = 128  # tokens each decode of the probe attends over
CAPACITY_MAX_BATCH = 32  # decode probe batch: max_num_seqs, up to this many
CAPACITY_DECODE_STEPS = 6
CAPACITY_LONG_CONTEXT = 512  # the context-cost probe: a small batch at this context
CAPACITY_CONTEXT_BATCH = 4


def prefill_s(engine: Engine, rng: random.Random, vocab: int, length: int) -> float:
    """Seconds to prefill one prompt of ``length`` tokens (and sample its first token)."""
    engine.add_request(
        EngineRequest(
            f"p{rng.random()}",
            [rng.randrange(vocab) for _ in range(length)],
            SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
        )
    )
    t = time.perf_counter()
    while engine.has_work():
        engine.step()
    return time.perf_counter() - t


def decode_step_s(
    engine: Engine, rng: random.Random, vocab: int, batch: int, context: int, steps: int
) -> float:
    """Median step time of ``batch`` requests decoding together at about ``context`` tokens.
    They generate until ``steps`` such steps are timed and are then aborted: with chunked
    prefill a batch's prompts join over several iterations, and requests with a fixed short
    output would finish before the last joined."""
    tag = f"d{rng.random()}"
    ids = [f"{tag}-{i}" for i in range(batch)]
    room = max(steps + 4, engine.max_model_len - context - 1)
    for rid in ids:
        engine.add_request(
            EngineRequest(
                rid,
                [rng.randrange(vocab) for _ in range(context)],
                SamplingParams(max_tokens=room, temperature=0.0, ignore_eos=True),
            )
        )
    times: list[float] = []
    together = 0
    try:
        while engine.has_work() and len(times) < steps:
            running_before = engine.stats().running
            t = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t
            if running_before == batch and engine.stats().waiting == 0:
                together += 1
                if together > 1:  # the first may still hold the last prompt's last chunk
                    times.append(dt)
    finally:
        for rid in ids:
            engine.abort(rid)
        while engine.has_work():
            engine.step()
    if not times:
        raise RuntimeError(f"batch {batch} never decoded together (max_num_seqs or KV too small?)")
    return statistics.median(times)


def fit_prefill(lengths: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """Least squares ``t = a*n + b*n**2`` with a, b >= 0 (pure; unit-tested)."""
    s11 = sum(n * n for n in lengths)
    s12 = sum(n**3 for n in lengths)
    s22 = sum(n**4 for n in lengths)
    y1 = sum(n * t for n, t in zip(lengths, seconds, strict=True))
    y2 = sum(n * n * t for n, t in zip(lengths, seconds, strict=True))
    det = s11 * s22 - s12 * s12
    if len(set(lengths)) >= 2 and det > 0:
        a = (y1 * s22 - y2 * s12) / det
        b = (s11 * y2 - s12 * y1) / det
        if a >= 0 and b >= 0:
            return a, b
    # One length, or a fit that went negative: the best pure-linear or pure-quadratic one.
    lin = y1 / s11
    quad = y2 / s22

    def err(a: float, b: float) -> float:
        return sum((a * n + b * n * n - t) ** 2 for n, t in zip(lengths, seconds, strict=True))

    return (lin, 0.0) if err(lin, 0.0) <= err(0.0, quad) else (0.0, quad)


def pace_at_full_budget(engine: Engine) -> None:
    """An engine that paces its prefill (once it knows its costs, which the probes measure)
    is probed as it then runs a lone prompt: at its full budget, not its cautious default."""
    features = bind_features(engine)
    if features.prefill_pacing is not None:
        free = InstanceCapacity(
            prefill_s=0.0,
            prefill_attention_s=0.0,
            decode_s=0.0,
            decode_context_s=0.0,
            max_num_seqs=1,
        )
        features.prefill_pacing.pace_prefill(free, 1.0)


def measure_capacity(engine: Engine, *, vocab: int, max_num_seqs: int) -> InstanceCapacity:
    """Prefill cost from two prompt lengths; decode cost of a full batch (up to
    CAPACITY_MAX_BATCH sequences) at a short context, and its growth with the context from
    a small batch at a short and a long one. About a second on the demo model, a few on a
    0.5B model on two CPU cores; paid once per model and engine."""
    pace_at_full_budget(engine)
    rng = random.Random(0)
    n = max(16, min(CAPACITY_PROMPT_TOKENS, engine.max_model_len // 2))
    prefill_s(engine, rng, vocab, 16)  # warm-up
    lengths = [max(8, n // 4), n]
    times = [min(prefill_s(engine, rng, vocab, k) for _ in range(2)) for k in lengths]
    a, b = fit_prefill(lengths, times)
    batch = max(1, min(max_num_seqs, CAPACITY_MAX_BATCH))
    steps = CAPACITY_DECODE_STEPS
    # Contexts that leave room to generate while the batch's prompts join.
    short = max(1, min(CAPACITY_DECODE_CONTEXT, engine.max_model_len // 4))
    long = max(short, min(CAPACITY_LONG_CONTEXT, engine.max_model_len // 2))
    full = decode_step_s(engine, rng, vocab, batch, short, steps)
    small = min(batch, CAPACITY_CONTEXT_BATCH)
    ctx_s = 0.0
    if long > short:
        at_short = decode_step_s(engine, rng, vocab, small, short, steps)
        at_long = decode_step_s(engine, rng, vocab, small, long, steps)
        ctx_s = max(0.0, (at_long - at_short) / (small * (long - short)))
    return InstanceCapacity(
        prefill_s=a,
        prefill_attention_s=b,
        decode_s=full / batch,
        decode_step_s=full,
        decode_context_s=ctx_s,
        max_num_seqs=max_num_seqs,
        engine=engine.name,
        device=engine.device,
        measured_at=time.time(),
    )


MODEL_STORE = Path(".meshserve") / "capacity"  # under a checkpoint's directory


def find_or_measure(
    engine: Engine, model_path: Path, settings: Settings, *, measure: bool = True
) -> tuple[InstanceCapacity | None, str]:
    """The capacity of ``engine`` serving the model at ``model_path`` as ``settings`` set
    it up, and where it came from: stored with the model (``"model"``), on this host
    (``"host"``), or ``"measured"`` now (then stored in both, best effort); (None, "none")
    when none is stored and ``measure`` is false."""
    te = settings.task_executor
    stores = [CapacityStore(model_path / MODEL_STORE), CapacityStore(te.capacity_cache)]
    key = stores[0].key(
        model_path,
        engine=engine.name,
        device=engine.device,
        dtype=te.dtype,
        max_num_seqs=te.max_num_seqs,
        threads=te.torch_threads,
    )
    for i, (where, store) in enumerate(zip(("model", "host"), stores, strict=True)):
        if (capacity := store.get(key)) is not None:
            other = stores[1 - i]
            if other.get(key) is None:  # each keeps a copy (best effort), written once
                other.put(key, capacity)
            return capacity, where
    if not measure:
        return None, "none"
    vocab = int(json.loads((model_path / "config.json").read_text())["vocab_size"])
    capacity = measure_capacity(engine, vocab=vocab, max_num_seqs=te.max_num_seqs)
    for store in stores:
        store.put(key, capacity)
    return capacity, "measured"


def profile_model(model_dir: Path, settings: Settings) -> tuple[InstanceCapacity | None, str]:
    """``meshserve profile``: the model loaded as a TE with these settings loads it, its
    capacity found or measured and stored (``find_or_measure``), the engine closed."""
    from services.task_executor.engines.base import LoadReport
    from services.task_executor.engines.factory import create_engine, prewarm

    prewarm(settings)
    engine = create_engine(model_dir.name, model_dir, settings, report=LoadReport())
    try:
        return find_or_measure(engine, model_dir, settings)
    finally:
        engine.close()


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


class CapacityStore:
    """Measured capacities on this host's disk, one file each, keyed by what the figures
    depend on: the model's architecture (its ``config.json``, not its weights: a fine-tuned
    variant runs at the same speed), the engine, device and dtype, the batch limit and
    threads, and the CPU (a shared cache directory may serve several kinds of hosts)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def key(self, model_path: Path, **engine: object) -> str:
        config = json.loads((model_path / "config.json").read_text())
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        what = {"config": config, **engine, "cpu": _cpu_name(), "cores": cores}
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24]

    def get(self, key: str) -> InstanceCapacity | None:
        try:
            return msgspec.json.decode(
                (self.directory / f"{key}.json").read_bytes(), type=InstanceCapacity
            )
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            return None

    def put(self, key: str, capacity: InstanceCapacity) -> None:
        """Atomic (a concurrent reader sees the old file or the new one); best effort."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self.directory / f".{key}.{os.getpid()}.tmp"
            tmp.write_bytes(msgspec.json.encode(capacity))
            tmp.replace(self.directory / f"{key}.json")
        except OSError:
            pass
