"""Measure a model's performance model (``shared.perf_model.PerfModel``) on the engine a TE
runs: prefills alone at power-of-two prompt lengths, decode steps on a grid of power-of-two
batch sizes × mean contexts. Prompts are random token ids (timing does not depend on
content); each point is the best of a few tries (the least disturbed by whatever else the
host runs), and what noise is left is smoothed where it breaks monotonicity (a longer
prompt, a larger batch, a longer context never costs less: ``nondecreasing``).

Two grids: ``FULL``, what ``meshserve profile`` measures offline and stores with the model
(prompts up to 4,096 tokens, batches up to 32, contexts up to 2,048: under a minute for the
demo model, minutes for a 0.5B one on two CPU cores), and ``COARSE``, what a load
that finds no stored model measures before it turns ready (the corners of the same grid:
about a second for the demo model).

A decode point needs ``batch × context`` tokens of prompt prefilled first. Points past
``max_decode_tokens`` (or that the engine's KV cache or batch limit cannot hold together)
are not measured: they are carried on along the context axis from the last two measured
contexts of their batch size (decode cost grows linearly with the context attended), and
the model records which ones (``extrapolated``)."""

from __future__ import annotations

import dataclasses
import random
import statistics
import time

from services.task_executor.engines.base import Engine, EngineRequest
from services.task_executor.engines.capabilities import bind_features
from shared.messages.api import SamplingParams
from shared.messages.scaling import InstanceCapacity
from shared.perf_model import PerfModel, powers_of_two


@dataclasses.dataclass(frozen=True, slots=True)
class Grid:
    name: str  # what the model records (``PerfModel.grid``)
    max_prompt: int  # longest prefill measured (clipped to the engine's context)
    max_batch: int  # largest batch (clipped to max_num_seqs)
    min_context: int
    max_context: int
    max_decode_tokens: int  # batch × context a point may prefill before it decodes
    corners_only: bool = False  # the first and last point of each axis only
    tries: int = 2
    steps: int = 6


FULL = Grid(
    name="full",
    max_prompt=4096,
    max_batch=32,
    min_context=16,
    max_context=2048,
    max_decode_tokens=16384,
)
COARSE = Grid(
    name="coarse",
    max_prompt=512,
    max_batch=32,
    min_context=128,
    max_context=512,
    max_decode_tokens=4096,
    corners_only=True,
    tries=1,
)


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


def _axis(low: int, high: int, corners_only: bool) -> list[int]:
    points = powers_of_two(low, high)
    return [points[0], points[-1]] if corners_only and len(points) > 2 else points


def measure_perf_model(
    engine: Engine, *, vocab: int, max_num_seqs: int, grid: Grid = FULL
) -> PerfModel:
    pace_at_full_budget(engine)
    rng = random.Random(0)
    room = engine.max_model_len
    longest = max(1, min(grid.max_prompt, room // 2))
    lengths = _axis(min(16, longest), longest, grid.corners_only)
    batches = _axis(1, max(1, min(grid.max_batch, max_num_seqs)), grid.corners_only)
    top = max(1, min(grid.max_context, room // 2))
    contexts = _axis(min(grid.min_context, top), top, grid.corners_only)
    prefill_s(engine, rng, vocab, 16)  # warm-up
    prefills = [min(prefill_s(engine, rng, vocab, n) for _ in range(grid.tries)) for n in lengths]
    raw: list[list[float | None]] = []
    for batch in batches:
        row: list[float | None] = []
        for context in contexts:
            t: float | None = None
            if batch * context <= grid.max_decode_tokens:
                try:
                    t = min(
                        decode_step_s(engine, rng, vocab, batch, context, grid.steps)
                        for _ in range(grid.tries)
                    )
                except RuntimeError:  # never decoded together: KV or batch limit
                    t = None
            row.append(t)
        raw.append(row)
    rows, extrapolated = carry_on(batches, contexts, raw)
    rows = [nondecreasing(row) for row in rows]  # along the context, then the batch
    columns = [nondecreasing([row[j] for row in rows]) for j in range(len(contexts))]
    rows = [[columns[j][i] for j in range(len(contexts))] for i in range(len(batches))]
    return PerfModel(
        prefill_lengths=lengths,
        prefill_s=nondecreasing(prefills),
        decode_batches=batches,
        decode_contexts=contexts,
        decode_s=rows,
        extrapolated=extrapolated,
        max_num_seqs=max_num_seqs,
        grid=grid.name,
        engine=engine.name,
        device=engine.device,
        measured_at=time.time(),
    )


def nondecreasing(values: list[float]) -> list[float]:
    """The nondecreasing sequence closest to ``values`` in least squares (pool adjacent
    violators): a longer prompt, a larger batch or a longer context never costs less, so a
    point that does was disturbed, and it is averaged with its neighbours rather than kept
    (or allowed to lift every point after it, as a running maximum would)."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, n = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += n
    return [total / n for total, n in blocks for _ in range(int(n))]


def carry_on(
    batches: list[int], contexts: list[int], raw: list[list[float | None]]
) -> tuple[list[list[float]], list[list[bool]]]:
    """The grid's unmeasured points (None) from its measured ones, and which they are. Past
    a row's last measured context the step grows by the attention's cost per sequence per
    context token: the row's own slope where it has two measured points, else the slope of
    the largest batch that has (scaled by the batch). Raises for a row with no measured
    point (the smallest context of every batch fits any sensible budget)."""
    per_seq_token = 0.0
    for batch, row in zip(batches, raw, strict=True):
        known = [(c, t) for c, t in zip(contexts, row, strict=True) if t is not None]
        if len(known) >= 2:
            (c0, t0), (c1, t1) = known[-2], known[-1]
            per_seq_token = max(0.0, (t1 - t0) / (c1 - c0) / batch)
    filled: list[list[float]] = []
    guessed: list[list[bool]] = []
    for batch, row in zip(batches, raw, strict=True):
        known = [(c, t) for c, t in zip(contexts, row, strict=True) if t is not None]
        if not known:
            raise RuntimeError(f"no decode point of batch {batch} could be measured")
        slope = per_seq_token * batch
        if len(known) >= 2:
            (c0, t0), (c1, t1) = known[-2], known[-1]
            slope = max(0.0, (t1 - t0) / (c1 - c0))
        c_last, t_last = known[-1]
        filled.append(
            [
                t if t is not None else t_last + slope * (c - c_last)
                for c, t in zip(contexts, row, strict=True)
            ]
        )
        guessed.append([t is None for t in row])
    return filled, guessed
