"""Which ready TE of a model takes a request: the routing policies. Pure.

``combined`` (the default) is DeepServe's Algorithm 1 with NVIDIA Dynamo's cost:

- every candidate has a *load* (outstanding work in tokens: prompt tokens queued for
  prefill plus a decode cost per running sequence, ``scheduling.te_load``) and a *cached*
  count (leading prompt tokens it already holds, from the prompt index);
- when the loads are balanced (max − min ≤ ``balance_tokens``), locality decides: the TE
  holding the longest prefix, the least loaded of those that hold as much;
- otherwise load decides, through the cost of taking the request there: the prompt tokens
  it would still prefill plus its load, the cheapest wins. A long cached prefix still counts
  (it removes prefill), but never piles work on a TE that is far behind the others.
- ties, including a miss everywhere, go to one of the tied TEs chosen by ``spread`` (a
  number per request), never to the first by name: with several job executors placing at
  once, misses would otherwise all land on one TE.

``least-loaded``: the least load, ties spread. ``round-robin``: ``spread`` modulo the
candidates in name order (the caller passes a counter). Both ignore the cache, for
comparison on the same cluster.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

Policy = Literal["combined", "least-loaded", "round-robin"]
POLICIES: tuple[Policy, ...] = ("combined", "least-loaded", "round-robin")


@dataclasses.dataclass(frozen=True, slots=True)
class RoutingConfig:
    policy: Policy = "combined"
    balance_tokens: int = 2048  # loads this close count as balanced: locality decides


DEFAULT_ROUTING = RoutingConfig()


@dataclasses.dataclass(frozen=True, slots=True)
class Candidate:
    te_id: str
    load: int  # outstanding work, tokens
    cached_tokens: int = 0  # leading prompt tokens it holds


@dataclasses.dataclass(frozen=True, slots=True)
class Route:
    te_id: str
    branch: str  # "locality", "load", "least-loaded", "round-robin": why this one


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
    loads = [c.load for c in candidates]
    if max(loads) - min(loads) <= config.balance_tokens:
        best = max(c.cached_tokens for c in candidates)
        holders = [c for c in candidates if c.cached_tokens == best]
        least = min(c.load for c in holders)
        tied = [c for c in holders if c.load == least]
        return Route(_spread(tied, spread).te_id, "locality")

    def cost(c: Candidate) -> int:
        return max(prompt_tokens - c.cached_tokens, 0) + c.load

    cheapest = min(cost(c) for c in candidates)
    tied = [c for c in candidates if cost(c) == cheapest]
    return Route(_spread(tied, spread).te_id, "load")
