"""Which ready TE of a model takes a request: the routing policies. Pure.

``combined`` (the default) is DeepServe's Algorithm 1 with NVIDIA Dynamo's cost:

- every candidate has a *load* (outstanding work in tokens: prompt tokens queued for
  prefill, less the prefixes the router expected cached, plus a decode cost per running
  sequence, ``placement.te_load``) and a *cached* count (leading prompt tokens it already
  holds, from the prompt index);
- its *cost* is the work a request would wait for there: the prompt tokens it would still
  prefill plus the load (Dynamo's KV router);
- a TE is near enough when its cost exceeds the cheapest by at most ``balance_tokens`` plus
  the prompt tokens it holds: a held prefix is worth the prefill it spares this request (in
  its cost already) and the same again, the work the fleet would spend computing and
  keeping it a second time elsewhere, which every request queued there would wait for.
  Among the near TEs the one holding the longest prefix wins (locality), the cheapest of
  those that hold as much. So when loads are balanced locality decides (DeepServe); when
  they are not, load does (Dynamo), and a TE far enough behind loses even a long prefix.
  Measured on the Mooncake conversation trace (``scripts/bench-routing``): on a real 3-TE
  cluster at 3.3x its rate this reuses 92% of what an oracle router would (87% with the
  allowance alone) at the same latency; in the simulator (the whole trace, 16 devices, 4x
  and 6.7x its rate) 97% against 90%, and at 6.7x half the TTFT p50 (1.9 s against 3.8 s).
- ties, including a miss everywhere, go to one of the tied TEs chosen by ``spread`` (a
  number per request), never to the first by name: with several job executors placing at
  once, misses would otherwise all land on one TE.

The branch reported is ``locality`` when the chosen TE holds more of the prompt than some
other candidate (the cache decided or agreed), ``load`` when it holds no more than any.

KV room comes first: ``combined`` and ``packed`` choose among the candidates whose engine
can hold the prompt's uncached tokens in KV now (what it reported free, cached blocks it may
evict included, less the prompt tokens queued there and placed since: ``kv_room``), where
any can. A prompt placed where its KV does not fit waits for the sequences there to finish
(or preempts them) while another instance has the room: on the Mooncake conversation window
of ``scripts/bench-pd`` (CPU profile, prompts up to 30k tokens against 43k tokens of KV an
instance) the room rule lifts colocated serving from 98.0% to 99.8% within the SLO.

``least-loaded``: the least load, ties spread. ``round-robin``: ``spread`` modulo the
candidates in name order (the caller passes a counter). Both ignore the cache, for
comparison on the same cluster.

``packed`` (LLM-Mesh's defragmentation): bin-packing, the candidate holding the most
sequences that still has a free batch slot (then the longest cached prefix, then the least
load), or the least loaded when every batch is full. Busy instances fill up and small ones
drain, so that the scaler recycles them and their device's memory goes to the instances
that need it. It relies on the TEs' shadow validation (``MESHSERVE_SHADOW_ADMISSION``)
to refuse a request the fullest instance cannot serve in time: the job executor then
tries the next fullest.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence
from typing import Literal

Policy = Literal["combined", "least-loaded", "round-robin", "packed"]
POLICIES: tuple[Policy, ...] = ("combined", "least-loaded", "round-robin", "packed")


@dataclasses.dataclass(frozen=True, slots=True)
class RoutingConfig:
    policy: Policy = "combined"
    balance_tokens: int = 2048  # costs this close to the cheapest: locality decides


DEFAULT_ROUTING = RoutingConfig()


@dataclasses.dataclass(frozen=True, slots=True)
class Candidate:
    te_id: str
    load: int  # outstanding work, tokens
    cached_tokens: int = 0  # leading prompt tokens it holds
    sequences: int = 0  # requests it holds (queued or running)
    slots: int = 0  # its batch limit (0: not known)
    kv_room: int | None = None  # KV tokens it can still give new prompts (None: not known)


@dataclasses.dataclass(frozen=True, slots=True)
class Route:
    te_id: str
    branch: str  # "locality", "load", "least-loaded", "round-robin": why this one


def spread_of(config: RoutingConfig, counter: int, key: str) -> int:
    """A request's ``spread``: round-robin's counter (the caller's, one more per request),
    else a hash of the request's own key, so that ties fall evenly whichever JE places it."""
    return counter if config.policy == "round-robin" else zlib.crc32(key.encode())


def _spread(tied: Sequence[Candidate], spread: int) -> Candidate:
    ordered = sorted(tied, key=lambda c: c.te_id)
    return ordered[spread % len(ordered)]


def route(
    candidates: Sequence[Candidate], prompt_tokens: int, config: RoutingConfig, spread: int
) -> Route:
    """The TE for a request of ``prompt_tokens`` among ``candidates`` (not empty)."""
    if not candidates:
        raise ValueError("no candidates to route to")
    if config.policy == "round-robin":
        return Route(_spread(candidates, spread).te_id, "round-robin")
    if config.policy == "least-loaded":
        least = min(c.load for c in candidates)
        tied = [c for c in candidates if c.load == least]
        return Route(_spread(tied, spread).te_id, "least-loaded")

    if config.policy == "packed":
        return Route(_packed(_with_room(candidates, prompt_tokens), spread).te_id, "packed")

    candidates = _with_room(candidates, prompt_tokens)

    def cost(c: Candidate) -> int:
        return max(prompt_tokens - c.cached_tokens, 0) + c.load

    cheapest = min(cost(c) for c in candidates)
    # What a TE's prefix is worth beyond the prefill it spares this request (already in its
    # cost): the same again, which the fleet would spend computing and keeping it twice,
    # plus the allowance.
    near = [c for c in candidates if cost(c) <= cheapest + config.balance_tokens + c.cached_tokens]
    best = max(c.cached_tokens for c in near)
    holders = [c for c in near if c.cached_tokens == best]
    least = min(cost(c) for c in holders)
    tied = [c for c in holders if cost(c) == least]
    chosen = _spread(tied, spread)
    least_held = min(c.cached_tokens for c in candidates)
    return Route(chosen.te_id, "locality" if chosen.cached_tokens > least_held else "load")


def _with_room(candidates: Sequence[Candidate], prompt_tokens: int) -> Sequence[Candidate]:
    """The candidates whose KV can take the prompt's uncached tokens now, where any can (all
    of them where none can: the request waits for memory wherever it goes)."""
    fits = [
        c
        for c in candidates
        if c.kv_room is None or c.kv_room >= max(prompt_tokens - c.cached_tokens, 0)
    ]
    return fits or candidates


def _packed(candidates: Sequence[Candidate], spread: int) -> Candidate:
    open_ = [c for c in candidates if c.slots <= 0 or c.sequences < c.slots]
    if not open_:
        least = min(c.load for c in candidates)
        return _spread([c for c in candidates if c.load == least], spread)
    best = max((c.sequences, c.cached_tokens, -c.load) for c in open_)
    return _spread([c for c in open_ if (c.sequences, c.cached_tokens, -c.load) == best], spread)
