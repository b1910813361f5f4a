"""Reshaping a trace before replay: faster or slower, thinner or denser, shorter. Pure
functions of a request list (and a seed), so a replay and a simulation of the same options
see the same requests."""

from __future__ import annotations

import dataclasses
import math
import random

from loadgen.traces import TraceRequest, normalize


def scale_time(reqs: list[TraceRequest], factor: float) -> list[TraceRequest]:
    """Every arrival (so every inter-arrival gap) multiplied by ``factor``: 0.1 replays the
    trace ten times faster, 2 at half speed. The mix of lengths is untouched."""
    if factor <= 0:
        raise ValueError("time scale must be positive")
    return [dataclasses.replace(r, arrival_s=r.arrival_s * factor) for r in reqs]


def _rename_blocks(r: TraceRequest, replica: int, replicas: int) -> TraceRequest:
    """Replica ``k`` of ``m`` gets hash id ``h*m + k``: sharing stays the same inside a
    replica (so prefix-cache behaviour is the trace's own) and never crosses replicas
    (a copy is another user's traffic, not a retry of the same prompt)."""
    sid = None if r.session_id is None else f"{r.session_id}~{replica}" if replica else r.session_id
    return dataclasses.replace(
        r, hash_ids=tuple(h * replicas + replica for h in r.hash_ids), session_id=sid
    )


def scale_rate(reqs: list[TraceRequest], factor: float, seed: int = 0) -> list[TraceRequest]:
    """About ``factor`` times the requests over the same span.

    ``factor < 1`` keeps each request with probability ``factor`` (Bernoulli thinning,
    deterministic for a seed): the arrival process keeps its shape at a lower rate.
    ``factor > 1`` adds copies: ``floor(factor)`` of every request, one more with
    probability ``factor - floor(factor)``; each copy arrives a uniform jitter of up to one
    mean inter-arrival gap after its original, and its hash ids are renamed so copies share
    prefixes with each other as the originals do, but not with the originals."""
    if factor <= 0:
        raise ValueError("rate scale must be positive")
    if factor == 1 or not reqs:
        return list(reqs)
    rng = random.Random(seed)
    if factor < 1:
        return [r for r in reqs if rng.random() < factor]
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    gap = span / max(1, len(reqs) - 1)
    replicas = math.ceil(factor)
    out: list[TraceRequest] = []
    for r in reqs:
        copies = math.floor(factor) + (rng.random() < factor - math.floor(factor))
        for k in range(copies):
            c = _rename_blocks(r, k, replicas)
            if k:
                c = dataclasses.replace(c, arrival_s=r.arrival_s + rng.uniform(0, gap))
            out.append(c)
    return normalize(out)


def scale_prompts(reqs: list[TraceRequest], factor: float) -> list[TraceRequest]:
    """Every prompt ``factor`` times as long, and its blocks with it: a trace of 512-token
    blocks at 0.125 has 64-token blocks, so the same requests share the same share of their
    prompts (the trace's prefix structure, at lengths a small model or host can serve).
    ``factor`` must make the block size a whole number of tokens. Outputs are untouched
    (``--max-output-tokens`` caps them)."""
    if factor <= 0:
        raise ValueError("prompt scale must be positive")
    if factor == 1:
        return list(reqs)
    out = []
    for r in reqs:
        block = r.block_size * factor
        if r.block_size and (block < 1 or abs(block - round(block)) > 1e-9):
            raise ValueError(
                f"prompt scale {factor:g} makes the trace's {r.block_size}-token blocks "
                f"{block:g} tokens: choose a scale that leaves whole tokens"
            )
        out.append(
            dataclasses.replace(
                r,
                input_tokens=max(1, round(r.input_tokens * factor)),
                block_size=round(block) if r.block_size else 0,
            )
        )
    return out


def limit(
    reqs: list[TraceRequest], *, duration_s: float | None = None, max_requests: int | None = None
) -> list[TraceRequest]:
    """The requests arriving within the first ``duration_s`` seconds, at most
    ``max_requests`` of them."""
    out = reqs
    if duration_s is not None:
        out = [r for r in out if r.arrival_s < duration_s]
    if max_requests is not None:
        out = out[:max_requests]
    return out


def spread_models(
    reqs: list[TraceRequest], models: int, skew: float = 1.0, seed: int = 0
) -> list[TraceRequest]:
    """The trace's traffic shared among ``models`` models named ``model-01``, ...: each
    conversation (each request where the trace records none) goes to one, drawn with Zipf
    popularity (model k's weight ``1 / k**skew``; 0: uniform), so a few models are busy and
    most are seldom called, as the functions of a serverless platform are (LLM-Mesh serves
    the Azure conversation lengths under Azure Functions' per-function arrivals). Prefix
    blocks stay as they are: a conversation keeps its own prefix on its model."""
    if models < 1:
        raise ValueError("spread over at least one model")
    width = len(str(models))
    names = [f"model-{k:0{max(2, width)}d}" for k in range(1, models + 1)]
    weights = [1 / (k**skew) for k in range(1, models + 1)]
    rng = random.Random(seed)
    chosen: dict[str, str] = {}
    out = []
    for i, r in enumerate(reqs):
        key = r.session_id if r.session_id is not None else f"#{i}"
        if key not in chosen:
            chosen[key] = rng.choices(names, weights)[0]
        out.append(dataclasses.replace(r, model=chosen[key]))
    return out
