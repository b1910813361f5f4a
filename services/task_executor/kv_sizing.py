"""KV sized by demand (LLM-Mesh): an instance's KV pool follows what its requests need,
growing early and shrinking lazily, so that instances sharing a device leave each other the
memory they do not use. Pure.

Demand, in tokens: ``C × max(Σ_r (I_r + max(O_r, Ō)), L_min)`` over the requests the instance
holds, ``I_r`` a request's prompt, ``O_r`` the output it asks for (its ``max_tokens``), ``Ō``
the mean output of recent requests (a request asking for little may still run long), ``C``
a safety factor and ``L_min`` a floor (one request of the model's longest context).

The pool grows as soon as its slack falls under half of ``w`` (to ``demand × (1 + w)``), and
shrinks only when it holds more than ``(1 + h)`` times that for ``shrink_after_s``: a
band between the two, so a demand that wobbles never makes the pool grow and shrink in
turn. Sizes are whole multiples of ``granularity`` tokens (the engine's block size, or
more).

When the demand was under-estimated and the pool is full, the engine's scheduler preempts
the request with the most headroom (``scheduler.victim_index`` in the torch engine: the one
that can best afford to start over); it is admitted again and its prefix recomputed, its
output unchanged."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Container, Iterable, Mapping, Sequence

from services.job_executor.shadow import InstanceView, validate


@dataclasses.dataclass(frozen=True, slots=True)
class KvSizing:
    scale: float = 1.0  # C
    min_tokens: int = 0  # L_min
    grow_slack: float = 0.25  # w
    shrink_slack: float = 0.5  # h
    shrink_after_s: float = 30.0
    granularity: int = 16


def demand_tokens(
    requests: Iterable[tuple[int, int]], mean_output: float, sizing: KvSizing
) -> float:
    """``requests``: (prompt tokens, output tokens asked for) of each request held."""
    need = sum(prompt + max(output, mean_output) for prompt, output in requests)
    return sizing.scale * max(need, sizing.min_tokens)


def _rounded(tokens: float, granularity: int) -> int:
    g = max(1, granularity)
    return max(g, math.ceil(tokens / g) * g)


def floor_tokens(sizing: KvSizing) -> int:
    """What a pool holding no request grows to (its demand is the floor ``L_min``): the
    size a model load's pool enters the device's books at."""
    return _grown(demand_tokens((), 0.0, sizing), sizing)


def _grown(demand: float, sizing: KvSizing) -> int:
    """The size a pool grows (or shrinks) to for ``demand``: ``demand × (1 + w)``, rounded."""
    return _rounded(demand * (1 + sizing.grow_slack), sizing.granularity)


@dataclasses.dataclass(frozen=True, slots=True)
class Resize:
    tokens: int  # the pool's size from now (the current one when it holds)
    over_since: float | None  # since when the pool has been above the shrink line


def next_size(
    current: int, demand: float, *, now: float, over_since: float | None, sizing: KvSizing
) -> Resize:
    """The pool's next size: grown at once to ``demand × (1 + w)`` when its slack is under
    ``w / 2``; shrunk to that once it has stayed above ``(1 + h)`` times it for
    ``shrink_after_s``; else as it is. ``over_since`` carries the shrink timer between
    calls."""
    target = _grown(demand, sizing)
    if current < demand * (1 + sizing.grow_slack / 2):
        return Resize(max(target, current), None)
    if current > target * (1 + sizing.shrink_slack):
        since = now if over_since is None else over_since
        if now - since >= sizing.shrink_after_s:
            return Resize(target, None)
        return Resize(current, since)
    return Resize(current, None)


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceOp:
    """A change of what one device's memory holds: ``shrink`` or ``unload`` releases
    ``bytes``, ``grow`` or ``load`` needs them. ``urgency``: the earliest deadline the op
    serves (smaller first among those that need memory)."""

    kind: str  # "shrink", "unload", "grow", "load"
    instance: str
    bytes: int
    urgency: float = math.inf


RELEASES = ("shrink", "unload")


def order_ops(ops: Iterable[DeviceOp], free_bytes: int) -> tuple[list[DeviceOp], list[DeviceOp]]:
    """The ops to run now, in order, and those that must wait. Every release runs first (a
    grow never starts before the shrink that makes its room has finished: the caller runs
    them in this order, each after the one before); then the ops that need memory, most
    urgent first, each while what the releases freed and what was free still holds it.
    The first that does not fit waits, and so does every op after it: none overtakes it, so
    a large load is never starved by a stream of small grows. A grow that does not fit
    takes what is free now and waits for the rest: else a pool wanting more than its
    neighbours' floors leave would wait for ever beside free memory. (A TE's reservation
    for a load is asked as a grow from nothing: it holds its part until the rest comes;
    an op of kind ``load`` waits whole.)"""
    ops = list(ops)
    releases = [op for op in ops if op.kind in RELEASES]
    needs = sorted(
        (op for op in ops if op.kind not in RELEASES), key=lambda op: (op.urgency, op.instance)
    )
    free = free_bytes + sum(op.bytes for op in releases)
    now: list[DeviceOp] = list(releases)
    wait: list[DeviceOp] = []
    for op in needs:
        if not wait and op.bytes <= free:
            now.append(op)
            free -= op.bytes
        elif not wait and op.kind == "grow" and free > 0:
            now.append(dataclasses.replace(op, bytes=free))
            wait.append(dataclasses.replace(op, bytes=op.bytes - free))
            free = 0
        else:
            wait.append(op)
    return now, wait


@dataclasses.dataclass(frozen=True, slots=True)
class Room:
    """A device's books after ``make_room``: the grows granted now (in order), those that
    wait (a grant's rest among them, when it got part), and the instances told to shrink to
    their demand at once for them."""

    grant: list[DeviceOp]
    wait: list[DeviceOp]
    squeeze: list[str]


def make_room(
    pending: Iterable[DeviceOp],
    used_bytes: int,
    budget_bytes: int,
    holding: Mapping[str, bool],
) -> Room:
    """The device's waiting grows over its budget (0: none, every grow granted):
    ``order_ops`` over what the device's pools hold and were granted (``used_bytes``);
    while one still waits, every other instance holding KV (``holding``: each, and whether
    it was told already) is told to shrink to its demand, once until it says what it holds
    again. The device arbiter keeps its books by it, and the simulator."""
    pending = list(pending)
    if not budget_bytes:
        return Room(pending, [], [])
    grant, wait = order_ops(pending, budget_bytes - used_bytes)
    waiting = {op.instance for op in wait}
    squeeze = [name for name, told in holding.items() if wait and name not in waiting and not told]
    return Room(grant, wait, squeeze)


@dataclasses.dataclass(frozen=True, slots=True)
class Neighbour:
    """An instance on the blocked instance's device that could give way: its device view
    (``shadow.InstanceView``: its requests), its model and what unloading it frees."""

    view: InstanceView
    model: str
    bytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class Elsewhere:
    """An instance of ``model`` on another device (``target`` in ``device``), where a
    preempted neighbour's requests could go."""

    device: tuple[InstanceView, ...]
    target: str
    model: str


def elsewhere(
    devices: Iterable[tuple[Sequence[InstanceView], Mapping[str, str]]], models: Container[str]
) -> list[Elsewhere]:
    """Where a neighbour of one of ``models`` could send its requests: on each other device
    (its instances' views, and the model of each instance there that takes requests: ready
    and colocated), every instance of one of them."""
    return [
        Elsewhere(tuple(views), v.instance, model)
        for views, takes in devices
        for v in views
        if (model := takes.get(v.instance)) is not None and model in models
    ]


# A grow waits this long (every other pool on its device already told to shrink) before
# its instance may preempt a neighbour; the device is looked at no more often.
PREEMPT_AFTER_S = 1.0


@dataclasses.dataclass(frozen=True, slots=True)
class Preemption:
    neighbour: str  # the instance to unload
    moves: Mapping[str, str]  # its requests' ids -> the instance each is placed on


def preemption(
    blocked: InstanceView,
    need_bytes: int,
    free_bytes: int,
    neighbours: Sequence[Neighbour],
    elsewhere: Sequence[Elsewhere],
    now: float,
) -> Preemption | None:
    """Whether an instance blocked from growing (``need_bytes`` more than the device's
    ``free_bytes``) may preempt a neighbour, and which (LLM-Mesh): one holding fewer
    requests than the blocked instance, whose unload frees enough, and each of whose
    requests passes shadow validation (``shadow.validate``) on an instance of its model on
    another device, each placed there before the next is tried. The smallest such neighbour
    (fewest requests, then the most bytes freed); None when there is none, and the grow
    waits."""
    short = need_bytes - free_bytes
    if short <= 0:
        return None  # nothing to make room for
    fits = [
        n
        for n in neighbours
        if n.view.instance != blocked.instance
        and len(n.view.requests) < len(blocked.requests)
        and n.bytes >= short
    ]
    for n in sorted(fits, key=lambda n: (len(n.view.requests), -n.bytes, n.view.instance)):
        moves = _rehome(n, [e for e in elsewhere if e.model == n.model], now)
        if moves is not None:
            return Preemption(neighbour=n.view.instance, moves=moves)
    return None


def _rehome(n: Neighbour, targets: Sequence[Elsewhere], now: float) -> dict[str, str] | None:
    """Each of ``n``'s requests placed on a target that validates it (earliest deadline
    first, each joining its target before the next is tried), or None."""
    devices = [list(e.device) for e in targets]
    moves: dict[str, str] = {}
    for r in sorted(n.view.requests, key=lambda r: r.deadline()):
        # It starts over where it goes, its prompt and what it produced so far recomputed,
        # and its next token is due when it was due here.
        moved = dataclasses.replace(
            r,
            arrival=r.arrival + r.tpot_slo * r.output_tokens,
            prompt_tokens=r.prompt_tokens + r.output_tokens,
            computed_tokens=0,
            output_tokens=0,
            expected_output=max(1, r.expected_output - r.output_tokens),
        )
        for k, e in enumerate(targets):
            if validate(devices[k], e.target, moved, now).ok:
                moves[r.id] = e.target
                devices[k] = [
                    dataclasses.replace(i, requests=(*i.requests, moved))
                    if i.instance == e.target
                    else i
                    for i in devices[k]
                ]
                break
        else:
            return None
    return moves
