"""A performance model of one model on one engine and device (LLM-Mesh's): how long an
iteration takes, from a grid of measurements. Pure arithmetic over measured numbers.

- **Prefill**: seconds to prefill one prompt alone, measured at power-of-two lengths;
  between two lengths, linear interpolation; below the shortest, the shortest's time (a
  prefill reads every weight once however short it is); beyond the longest, the last
  segment's slope carried on.
- **Decode**: seconds of one decode step of a batch, measured on a grid of power-of-two
  batch sizes × power-of-two mean contexts (tokens each sequence attends over); between
  grid points, bilinear interpolation; outside the grid, the edge segments carried on
  (clamped at the low edge, for the same reason as prefill).

An iteration that decodes a batch and prefills a chunk beside it costs the prefill's time
and what the decode step adds beyond a lone short one (``iteration_s``): both read every
weight once, which the iteration does once, and their compute adds up.

``meshserve profile`` measures it (``services/task_executor/perf_profile.py``) and stores
it with the model; the scaler's per-token figures (``InstanceCapacity``) are read off it
(``capacity``), and the device's shadow validation (``services/job_executor/shadow.py``)
and the simulator play iterations forward with it.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import msgspec

from shared.messages.scaling import InstanceCapacity

# The scaler's per-token figures come from these points of the grid: a full batch (up to
# this many sequences) at a short context, and the growth with the context.
CAPACITY_MAX_BATCH = 32
CAPACITY_SHORT_CONTEXT = 128


def powers_of_two(low: int, high: int) -> list[int]:
    """``low, 2*low, 4*low, ...`` up to ``high``, and ``high`` itself last when it is not
    one of them (the grid reaches the engine's limit)."""
    out, n = [], max(1, low)
    while n < high:
        out.append(n)
        n *= 2
    out.append(max(1, high))
    return sorted(set(out))


def _segment(xs: Sequence[int], x: float) -> tuple[int, float]:
    """The index i of the segment [xs[i], xs[i+1]] to interpolate ``x`` on and the weight of
    xs[i+1] (0 below the first point: clamped; past the last: the last segment, extended)."""
    if len(xs) == 1 or x <= xs[0]:
        return 0, 0.0
    i = min(bisect.bisect_right(xs, x) - 1, len(xs) - 2)
    return i, (x - xs[i]) / (xs[i + 1] - xs[i])


def _interp(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    if len(xs) == 1:
        return ys[0] * max(1.0, x / xs[0])  # one point: proportional above it
    i, w = _segment(xs, x)
    return max(0.0, ys[i] + (ys[i + 1] - ys[i]) * w) if len(ys) > 1 else ys[0]


class PerfModel(msgspec.Struct, frozen=True, kw_only=True):
    """Iteration times of one model on one engine and device, on power-of-two grids."""

    prefill_lengths: list[int]  # prompt tokens, ascending
    prefill_s: list[float]  # seconds to prefill a prompt of each length alone
    decode_batches: list[int]  # sequences decoding together, ascending
    decode_contexts: list[int]  # mean tokens each sequence attends over, ascending
    decode_s: list[list[float]]  # [batch][context]: seconds of one decode step
    max_num_seqs: int
    # [batch][context]: carried on from the measured points, not measured (a point past
    # the profile's token budget); empty: all measured
    extrapolated: list[list[bool]] = msgspec.field(default_factory=list)
    grid: str = ""  # "full" (``meshserve profile``) or "coarse" (the corners a load measured)
    engine: str = ""
    device: str = ""
    measured_at: float = 0.0

    def __post_init__(self) -> None:
        for name, xs in (
            ("prefill_lengths", self.prefill_lengths),
            ("decode_batches", self.decode_batches),
            ("decode_contexts", self.decode_contexts),
        ):
            if not xs or list(xs) != sorted(set(xs)) or xs[0] < 1:
                raise ValueError(f"{name} must be distinct positive ascending numbers: {xs}")
        if len(self.prefill_s) != len(self.prefill_lengths):
            raise ValueError("one prefill time per prompt length")
        if len(self.decode_s) != len(self.decode_batches) or any(
            len(row) != len(self.decode_contexts) for row in self.decode_s
        ):
            raise ValueError("one decode time per batch size and context")

    def prefill_time_s(self, tokens: int) -> float:
        """Seconds to prefill ``tokens`` prompt tokens alone (0 for none)."""
        if tokens <= 0:
            return 0.0
        return _interp(self.prefill_lengths, self.prefill_s, tokens)

    def decode_step_s(self, batch: int, mean_context: float) -> float:
        """Seconds of one decode step of ``batch`` sequences attending over ``mean_context``
        tokens each (0 for no batch)."""
        if batch <= 0:
            return 0.0
        xb, xc = self.decode_batches, self.decode_contexts
        if len(xb) == 1:
            row = [r[0] for r in self.decode_s] if len(xc) == 1 else self.decode_s[0]
            at = _interp(xc, row, mean_context) if len(xc) > 1 else row[0]
            return at * max(1.0, batch / xb[0])
        i, wb = _segment(xb, batch)
        lo = _interp(xc, self.decode_s[i], mean_context)
        hi = _interp(xc, self.decode_s[i + 1], mean_context)
        return max(0.0, lo + (hi - lo) * wb)

    def iteration_s(self, decode_batch: int, mean_context: float, prefill_tokens: int) -> float:
        """One iteration: a decode step of ``decode_batch`` sequences and a prefill of
        ``prefill_tokens`` beside it."""
        if prefill_tokens <= 0:
            return self.decode_step_s(decode_batch, mean_context)
        prefill = self.prefill_time_s(prefill_tokens)
        if decode_batch <= 0:
            return prefill
        # The prefill alone already reads every weight once, as a lone short decode step
        # does: the decodes beside it add what their step costs beyond that.
        lone = self.decode_step_s(1, self.decode_contexts[0])
        return prefill + max(0.0, self.decode_step_s(decode_batch, mean_context) - lone)

    def capacity(self) -> InstanceCapacity:
        """The scaler's per-token figures (``InstanceCapacity``) read off the grid: prefill
        fitted as ``a*n + b*n²`` over the measured lengths, a full batch's step (up to
        ``CAPACITY_MAX_BATCH``) at a short context, and the step's growth per context token
        per sequence."""
        a, b = fit_prefill(self.prefill_lengths, self.prefill_s)
        batch = max(1, min(self.max_num_seqs, CAPACITY_MAX_BATCH))
        short = min(CAPACITY_SHORT_CONTEXT, self.decode_contexts[-1])
        full = self.decode_step_s(batch, short)
        long = self.decode_contexts[-1]
        ctx_s = 0.0
        if long > short:
            grow = self.decode_step_s(batch, long) - full
            ctx_s = max(0.0, grow / (batch * (long - short)))
        return InstanceCapacity(
            prefill_s=a,
            prefill_attention_s=b,
            decode_s=full / batch,
            decode_step_s=full,
            decode_context_s=ctx_s,
            max_num_seqs=self.max_num_seqs,
            engine=self.engine,
            device=self.device,
            measured_at=self.measured_at,
        )


def fit_prefill(lengths: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """Least squares ``t = a*n + b*n**2`` with a, b >= 0."""
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
