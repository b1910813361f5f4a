"""Scaling decisions. Pure: what the scaler observed and its own memory in; actions and the
new memory out (nothing passed in is changed). The scaler service (``tick.py``) and
``meshserve-loadgen simulate`` call these very functions.

The policy's parts: ``state`` (its config, its memory, and the observations that update
it), ``target`` (how many instances each model should have now: the load rule) and
``pools`` (which idle TE a new instance takes). Here, ``decide`` moves each model toward its
target:

- Scale out at once, onto idle pre-warmed TEs (placement: ``placement_order``), except
  during a model's load-failure backoff. Scale in only after the wanted count stayed below
  the current one for the whole stable window, never while panicking or loading, and,
  after SLO misses, never below the peak the panic window asked for within the stable
  window (``target``); the removed instance is the least busy one and drains before it
  unloads. A model that got no request for its keep-alive drops to ``min_replicas`` with
  its instances idle for as long. Scale-up and idle scale-down read the same clock (the
  newest arrival), so an instance unloaded at keep-alive is never reloaded without a new
  request.
- When no TE is idle, a model that wants more instances takes them from models with more
  than they want (``reclaim``): their surplus drains now instead of after the stable
  window, and the freed TE is reserved for the model it was taken for. A model with requests
  and no instance at all, where no model has a surplus, takes one instance from the model
  with the most (max-min fair: nobody loses its last instance).
- Loads of one model that would fork it from the same weight server go by multicast
  (``plan_multicasts``).
- PD disaggregation: a model's prefill instances are counted apart (``target``'s
  ``prefill_wanted``). They load after every model's other instances have taken the idle
  TEs they need (a prefill instance helps only beside instances that decode), take no TE
  by ``reclaim`` and are the first it takes for a model short of whole-request instances,
  scale in after the stable window, and unload at the keep-alive.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence

from services.scaler.pools import fork_source, placement_order
from services.scaler.state import (
    ModelMemory,
    PendingLoad,
    ScalerConfig,
    ScalerState,
    note_peak,
)
from services.scaler.target import Target, target
from services.views import TEView
from shared.messages.cluster import TEState
from shared.messages.tasks import TaskMode

# -- actions -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Load:
    te_id: str
    model: str
    reason: str = ""
    weights_from: str | None = None  # another host's weight server to fork from
    multicast: MulticastPlan | None = None
    role: TaskMode = TaskMode.COLOCATED  # PREFILL: a prefill instance (PD)


@dataclasses.dataclass(frozen=True, slots=True)
class MulticastPlan:
    """A load's part in a multicast (``plan_multicasts``): node ``node`` of ``nodes``."""

    node: int
    nodes: tuple[str, ...]  # relay addresses, node 0 the source's
    source: str  # the source's weight server
    block_bytes: int = 16 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class Unload:
    te_id: str
    model: str
    reason: str = ""


Action = Load | Unload


# -- deciding ----------------------------------------------------------------------------------


def load_backoff(failures: int, cfg: ScalerConfig) -> float:
    """Seconds to wait before loading a model again after `failures` failed loads in a row."""
    if failures <= 0:
        return 0.0
    return min(cfg.backoff_max_s, cfg.backoff_base_s * 2.0 ** (failures - 1))


def _victims(instances: Sequence[TEView], n: int, *, idle_since: float | None) -> list[TEView]:
    """The ``n`` instances to drain (none for ``n`` <= 0): the least busy, the most recently
    active last. ``idle_since``: only instances with nothing to do and no activity since
    then."""
    ready = [te for te in instances if te.state == TEState.READY]
    if idle_since is not None:
        ready = [te for te in ready if te.load == 0 and te.last_active <= idle_since]
    ready.sort(key=lambda te: (te.load, te.last_active, te.te_id))
    return ready[: max(n, 0)]


def _loading(view: Sequence[TEView], te_id: str, model: str) -> list[TEView]:
    """The view as the next placement of the same decision sees it: ``te_id`` loading."""
    return [
        dataclasses.replace(x, state=TEState.LOADING, model=model) if x.te_id == te_id else x
        for x in view
    ]


def _with_pending(tes: Sequence[TEView], pending: Mapping[str, PendingLoad]) -> list[TEView]:
    """The view with this scaler's loads that the TEs' heartbeats do not show yet (one sent
    a tick ago) as loading: a placement that did not see them would put the model's next
    instance in the same pool."""
    return [
        dataclasses.replace(t, state=TEState.LOADING, model=pending[t.te_id].model)
        if t.te_id in pending and t.model is None
        else t
        for t in tes
    ]


def _prefill_step(
    mem: ModelMemory,
    t: Target,
    prefill: Sequence[TEView],
    coming: int,
    now: float,
    cfg: ScalerConfig,
) -> tuple[ModelMemory, list[tuple[TEView, str]]]:
    """A model's prefill instances to unload now: all of them once idle for the keep-alive;
    where the scaler manages them, the surplus once the wanted count stayed below the
    current one for the stable window (never while one loads)."""
    if t.idle:
        idle_since = now - cfg.policy(t.model).keep_alive_s
        victims = _victims(prefill, len(prefill), idle_since=idle_since)
        return mem, [(te, "keep-alive expired") for te in victims]
    if t.prefill_wanted >= t.prefill_current or coming:
        return dataclasses.replace(mem, prefill_below_since=None), []
    since = now if mem.prefill_below_since is None else mem.prefill_below_since
    if now - since < cfg.stable_window_s:
        return dataclasses.replace(mem, prefill_below_since=since), []
    victims = _victims(prefill, t.prefill_current - t.prefill_wanted, idle_since=None)
    mem = dataclasses.replace(mem, prefill_below_since=None if victims else since)
    return mem, [(te, "prefill load fell") for te in victims]


def _not_below(mem: ModelMemory) -> ModelMemory:
    return mem if mem.below_since is None else dataclasses.replace(mem, below_since=None)


@dataclasses.dataclass(frozen=True, slots=True)
class ScaleDecision:
    actions: list[Action]
    state: ScalerState
    targets: dict[str, Target]


def decide(
    state: ScalerState,
    tes: Sequence[TEView],
    *,
    models: Sequence[str],
    now: float,
    cfg: ScalerConfig,
) -> ScaleDecision:
    """Loads and unloads for every known model (``models``: those in the registry)."""
    actions: list[Action] = []
    targets: dict[str, Target] = {}
    idle = [te for te in tes if te.state == TEState.IDLE and te.te_id not in state.pending]
    by_id = {te.te_id: te for te in tes}
    # A reservation lasts while its TE drains and then idles; gone with the TE or once
    # anything is loaded on it.
    reserved = {
        te_id: model
        for te_id, model in state.reserved.items()
        if te_id in by_id and te_id not in state.pending and by_id[te_id].state != TEState.LOADING
    }
    short: dict[str, int] = {}  # instances a model wants that no idle TE could take
    pending_by_model: dict[str, int] = {}
    prefill_pending: dict[str, int] = {}
    for p in state.pending.values():
        counts = prefill_pending if p.role == TaskMode.PREFILL else pending_by_model
        counts[p.model] = counts.get(p.model, 0) + 1
    prefill_short: list[tuple[str, int]] = []  # prefill instances wanted, loaded last
    new_pending = dict(state.pending)
    new_draining = dict(state.draining)
    memories = dict(state.models)
    by_model: dict[str, list[TEView]] = {}
    for te in tes:
        if te.model is not None:
            by_model.setdefault(te.model, []).append(te)
    view = _with_pending(tes, state.pending) if state.pending else list(tes)
    known = set(models)

    def load(te: TEView, model: str, reason: str, role: TaskMode) -> None:
        """Load ``model`` on the idle ``te``; the next placement of this decision sees it
        loading, so a model's instances spread."""
        nonlocal view
        idle.remove(te)
        actions.append(
            Load(te.te_id, model, reason, fork_source(model, te.pool_id, view), role=role)
        )
        new_pending[te.te_id] = PendingLoad(model, te.pool_id, now, reason, role)
        view = _loading(view, te.te_id, model)

    for model in sorted(known | set(by_model)):
        mem = memories.get(model, ModelMemory())
        pol = cfg.policy(model)
        if (
            model not in by_model
            and model not in pending_by_model
            and model not in prefill_pending
            and pol.min_replicas == 0
            and now - mem.last_demand > pol.keep_alive_s
            and not mem.held
        ):
            continue  # at zero and no request: nothing to decide (most models, most ticks)
        serving = [
            te for te in by_model.get(model, ()) if te.serving and te.te_id not in state.draining
        ]
        # Prefill instances (PD) take no whole requests: the model's count is the others'.
        instances = [te for te in serving if te.role != TaskMode.PREFILL]
        prefill = [te for te in serving if te.role == TaskMode.PREFILL]
        # A load sent but not in the view yet is an instance too (it is coming).
        coming = pending_by_model.get(model, 0) - sum(
            1 for te in instances if te.te_id in state.pending
        )
        prefill_coming = prefill_pending.get(model, 0) - sum(
            1 for te in prefill if te.te_id in state.pending
        )
        t = target(
            model,
            mem,
            instances,
            coming=max(coming, 0),
            prefill=prefill,
            prefill_coming=max(prefill_coming, 0),
            now=now,
            cfg=cfg,
        )
        current = t.current
        targets[model] = t
        mem = note_peak(mem, now, t.burst, cfg.stable_window_s)
        if t.missing:
            mem = dataclasses.replace(mem, missed_at=now)  # (target's SLO memory)
        if t.wanted > current and model in known:  # a model gone from the registry: no loads
            mem = _not_below(mem)
            if now - mem.failed_at < load_backoff(mem.failures, cfg):
                memories[model] = mem
                continue
            free = [te for te in idle if reserved.get(te.te_id, model) == model]
            for n in range(t.wanted - current):
                if not free:
                    short[model] = t.wanted - current - n
                    break
                mine = [te for te in free if reserved.get(te.te_id) == model]
                te = placement_order(model, mine or free, view, cfg)[0]
                free.remove(te)
                reserved.pop(te.te_id, None)
                load(te, model, t.reason, TaskMode.COLOCATED)
        elif t.wanted < current:
            if t.idle:
                # Down to min_replicas (``wanted``), once instances have been idle as long.
                idle_since = now - cfg.policy(model).keep_alive_s
                victims = _victims(instances, t.ready - t.wanted, idle_since=idle_since)
                reason = "keep-alive expired"
            elif coming > 0 or t.panicking or t.current > t.ready:
                victims, reason = [], ""
                mem = _not_below(mem)
            else:
                since = now if mem.below_since is None else mem.below_since
                mem = dataclasses.replace(mem, below_since=since)
                due = now - since >= cfg.stable_window_s
                keep = max(t.wanted, t.peak)  # a burst of the window may come back
                victims = _victims(instances, t.ready - keep, idle_since=None) if due else []
                reason = "load fell"
                if victims:
                    mem = dataclasses.replace(mem, below_since=None)
            for te in victims:
                actions.append(Unload(te.te_id, model, reason))
                new_draining[te.te_id] = model
        else:
            mem = _not_below(mem)
        mem, unload_prefill = _prefill_step(mem, t, prefill, max(prefill_coming, 0), now, cfg)
        for te, reason in unload_prefill:
            actions.append(Unload(te.te_id, model, reason))
            new_draining[te.te_id] = model
        if t.prefill_wanted > t.prefill_current and model in known:
            prefill_short.append((model, t.prefill_wanted - t.prefill_current))
        if t.wanted <= current:  # wants no more: what was freed for it is free for all
            reserved = {te_id: m for te_id, m in reserved.items() if m != model}
        memories[model] = mem
    reserved = {te_id: m for te_id, m in reserved.items() if m in targets}
    for model, n in prefill_short:  # what every model's other instances left idle
        if now - memories[model].prefill_yielded_at < cfg.stable_window_s:
            continue  # the fleet needed its TEs for whole requests a moment ago
        free = [te for te in idle if te.te_id not in reserved]
        for _ in range(min(n, len(free))):
            te = placement_order(model, free, view, cfg)[0]
            free.remove(te)
            load(te, model, "prefill load", TaskMode.PREFILL)
    managed = {m for m in targets if cfg.policy(m).max_prefill_replicas}  # not an operator's
    reclaimed, reserved = reclaim(short, targets, by_model, reserved, new_draining, managed)
    for te_id, model, reason in reclaimed:
        actions.append(Unload(te_id, model, reason))
        new_draining[te_id] = model
        if by_id[te_id].role == TaskMode.PREFILL and model in memories:
            memories[model] = dataclasses.replace(memories[model], prefill_yielded_at=now)
    state = dataclasses.replace(
        state, models=memories, pending=new_pending, draining=new_draining, reserved=reserved
    )
    return ScaleDecision(actions=plan_multicasts(actions, view), state=state, targets=targets)


def plan_multicasts(actions: Sequence[Action], tes: Sequence[TEView]) -> list[Action]:
    """Loads of one model that would each fork it from the same weight server (two or
    more in one decision) get it by multicast instead: lambda-Scale's binomial pipeline
    from that server's relay (node 0) through the loading TEs' relays (nodes 1..N), so the
    source sends about one copy instead of N. Only where every address is known (TEs report
    them); a load whose multicast fails forks from ``weights_from`` as before."""
    out = list(actions)
    groups: dict[tuple[str, str], list[int]] = {}
    for i, a in enumerate(out):
        if isinstance(a, Load) and a.weights_from:
            groups.setdefault((a.model, a.weights_from), []).append(i)
    by_id = {te.te_id: te for te in tes}
    for (_, source), idx in groups.items():
        relay0 = next((te.weight_relay for te in tes if te.weight_server == source), "")
        receivers = [
            by_id[out[i].te_id].relay_address if out[i].te_id in by_id else "" for i in idx
        ]
        if len(idx) < 2 or not relay0 or not all(receivers):
            continue
        nodes = (relay0, *receivers)
        for k, i in enumerate(idx, start=1):
            load = out[i]
            assert isinstance(load, Load)
            out[i] = dataclasses.replace(load, multicast=MulticastPlan(k, nodes, source))
    return out


def reclaim(
    short: Mapping[str, int],
    targets: Mapping[str, Target],
    by_model: Mapping[str, Sequence[TEView]],
    reserved: Mapping[str, str],
    draining: Mapping[str, str],
    prefill_managed: Collection[str] = (),
) -> tuple[list[tuple[str, str, str]], dict[str, str]]:
    """When every TE holds a model, a model that wants more instances than it has (``short``)
    takes them from models that have more than they want: the surplus that scale-in would
    remove once the stable window has passed, removed now for a model with work waiting.
    Starved models (no instance at all) first, then the largest shortfall. The victim is the
    least busy surplus instance (a starved model with no surplus left takes one from the model
    with the most instances, if it has two or more); it drains and is reserved for the model
    it was taken for. Instances already being freed for a model (``reserved``: TE -> model)
    count against its shortfall. Prefill instances of the models in ``prefill_managed`` (the
    ones the scaler runs) are taken first. Returns (TE, its model, reason) to unload, and
    the reservations with the new ones added."""
    reserved = dict(reserved)

    def takeable(te: TEView) -> bool:
        return te.state == TEState.READY and te.te_id not in draining

    def whole(te: TEView) -> bool:  # takes whole requests (not a PD prefill instance)
        return takeable(te) and te.role != TaskMode.PREFILL

    def least_busy(te: TEView) -> tuple[float, float, str]:
        return (te.load, te.last_active, te.te_id)

    freeing: dict[str, int] = {}
    for model in reserved.values():
        freeing[model] = freeing.get(model, 0) + 1
    surplus: list[TEView] = []
    for model, t in targets.items():
        if t.wanted >= t.current or t.panicking or t.current > t.ready:
            continue  # needs what it has, or is mid-burst or still loading
        ready = [te for te in by_model.get(model, ()) if whole(te)]
        surplus += _victims(ready, t.current - t.wanted, idle_since=None)
    # Prefill instances (PD) go first: they only speed up instances that decode, which a
    # short model lacks (the prefill work they did goes back to the whole-request ones).
    prefill = sorted(
        (
            te
            for model in prefill_managed
            for te in by_model.get(model, ())
            if te.role == TaskMode.PREFILL and takeable(te)
        ),
        key=least_busy,
    )
    surplus = prefill + sorted(surplus, key=least_busy)
    # What each model keeps: a starved model may also take one of the richest model's.
    kept: dict[str, list[TEView]] = {
        m: sorted(filter(whole, tes), key=least_busy) for m, tes in by_model.items()
    }
    out: list[tuple[str, str, str]] = []

    def take(te: TEView, model: str) -> None:
        assert te.model is not None
        kept[te.model] = [x for x in kept[te.model] if x.te_id != te.te_id]
        reserved[te.te_id] = model
        out.append((te.te_id, te.model, f"reclaimed for {model}"))

    for model in sorted(short, key=lambda m: (targets[m].current > 0, -short[m], m)):
        need = short[model] - freeing.get(model, 0)
        while need > 0 and surplus:
            take(surplus.pop(0), model)
            need -= 1
        if need > 0 and targets[model].current == 0 and not freeing.get(model):
            # Starved, and every other model needs what it has: the first instance comes
            # from the model with the most (at least two), its least busy one. Max-min
            # fair: a model never loses its last instance to another.
            rich = max(kept, key=lambda m: (len(kept[m]), m), default=None)
            if rich is not None and rich != model and len(kept[rich]) >= 2:
                te = kept[rich][0]
                surplus = [x for x in surplus if x.te_id != te.te_id]
                take(te, model)
    return out, reserved
