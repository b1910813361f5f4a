"""Synthetic traces: arrivals, lengths, many-model mixes and multi-turn conversations.

Arrivals follow a Gamma renewal process per model: inter-arrival gaps with mean
``1/rate`` and coefficient of variation ``cv`` (cv = 1 is Poisson, cv > 1 bursty, cv < 1
smoother, cv = 0 a metronome), the knob the serverless-LLM evaluations (ServerlessLLM,
LLM-Mesh) turn to stress scaling. Each model is one serverless function with its own rate
and cv, so a mix of many models with skewed rates is a list of ``ModelSpec``.

Lengths are log-normal with a given mean and cv (cv = 0: constant), as production prompt
and output lengths are roughly log-normal.

A conversation has a geometric number of turns with the given mean; turn k+1 arrives an
exponential think time after turn k, and its prompt is turn k's prompt and output plus a
new user message. Its ``hash_ids`` repeat every full block of turn k's prompt, so the shared
prefix grows turn by turn (the pattern of the Mooncake and Bailian traces). An optional
per-model system prompt is a shared prefix of every request of that model.

Pure: a ``SynthSpec`` and a seed give the same trace, written in the ``meshserve`` JSONL
format that ``traces.read_trace`` reads back.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Sequence

from loadgen.traces import TraceRequest


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str | None  # None: the trace names no model (replay with --model)
    rate: float  # conversations (first turns) per second
    cv: float = 1.0


@dataclasses.dataclass(frozen=True)
class SynthSpec:
    models: Sequence[ModelSpec]
    duration_s: float = 60.0
    input_mean: float = 512
    input_cv: float = 1.0
    output_mean: float = 128
    output_cv: float = 1.0
    turns_mean: float = 1.0
    think_time_s: float = 10.0
    system_prompt_tokens: int = 0
    block_size: int = 16
    max_input_tokens: int = 32768
    max_requests: int | None = None


def parse_models(spec: str) -> list[ModelSpec]:
    """``"a:2,b:0.5:3"`` → models a (2 /s, cv 1) and b (0.5 /s, cv 3)."""
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        bits = part.split(":")
        if len(bits) not in (2, 3) or not bits[0]:
            raise ValueError(f"bad model spec {part!r} (want NAME:RATE[:CV])")
        try:
            out.append(
                ModelSpec(bits[0], float(bits[1]), float(bits[2]) if len(bits) == 3 else 1.0)
            )
        except ValueError as e:
            raise ValueError(f"bad model spec {part!r}: {e}") from e
    if not out:
        raise ValueError("no models in the spec")
    return out


def gamma_arrivals(rate: float, cv: float, duration_s: float, rng: random.Random) -> list[float]:
    """Arrival times in ``[0, duration_s)`` of a Gamma renewal process (shape ``1/cv²``,
    mean gap ``1/rate``), starting from a random phase so that models do not all fire at 0."""
    if rate <= 0:
        return []
    if cv < 0:
        raise ValueError("cv must be >= 0")
    mean = 1.0 / rate

    def gap() -> float:
        if cv == 0:
            return mean
        k = 1.0 / (cv * cv)
        return rng.gammavariate(k, mean / k)

    out = []
    t = rng.uniform(0, mean)
    while t < duration_s:
        out.append(t)
        t += gap()
    return out


def lognormal_int(mean: float, cv: float, rng: random.Random, lo: int = 1) -> int:
    """A log-normal draw with the given mean and cv, rounded, at least ``lo``."""
    if cv <= 0:
        return max(lo, round(mean))
    s2 = math.log1p(cv * cv)
    return max(lo, round(rng.lognormvariate(math.log(mean) - s2 / 2, math.sqrt(s2))))


def synthesize(spec: SynthSpec, seed: int = 0) -> list[TraceRequest]:
    """The requests of ``spec``, sorted by arrival."""
    if spec.block_size < 1:
        raise ValueError("block size must be positive")
    rng = random.Random(seed)
    next_id = itertools.count()
    bs = spec.block_size
    out: list[TraceRequest] = []
    conv = itertools.count()
    for m in spec.models:
        sys_ids = [next(next_id) for _ in range(spec.system_prompt_tokens // bs)]
        for t0 in gamma_arrivals(m.rate, m.cv, spec.duration_s, rng):
            session = f"{m.name or 'c'}-{next(conv)}"
            prev_ids: list[int] = list(sys_ids)
            prev_full = len(sys_ids)  # blocks of the context known to be shared
            context = spec.system_prompt_tokens
            t, turn = t0, 1
            while t < spec.duration_s:
                new_input = lognormal_int(spec.input_mean, spec.input_cv, rng)
                inp = context + new_input
                if inp > spec.max_input_tokens:
                    if turn > 1:
                        break
                    inp = spec.max_input_tokens
                out_len = lognormal_int(spec.output_mean, spec.output_cv, rng)
                ids = prev_ids[:prev_full]
                ids += [next(next_id) for _ in range(math.ceil(inp / bs) - len(ids))]
                out.append(
                    TraceRequest(
                        arrival_s=t,
                        input_tokens=inp,
                        output_tokens=out_len,
                        model=m.name,
                        hash_ids=tuple(ids),
                        block_size=bs,
                        session_id=session,
                        turn=turn,
                    )
                )
                if spec.turns_mean <= 1 or rng.random() < 1 / spec.turns_mean:
                    break
                prev_ids, prev_full = ids, inp // bs
                context = inp + out_len
                t += rng.expovariate(1 / spec.think_time_s) if spec.think_time_s > 0 else 0.0
                turn += 1
    reqs = sorted(out, key=lambda r: r.arrival_s)
    if spec.max_requests is not None:
        reqs = reqs[: spec.max_requests]
    return reqs
