"""Scaling decisions. Pure: what the scaler observed and its own memory in; actions and the
new memory out. The scaler service and ``meshserve-loadgen simulate`` call these very
functions.

The rule, per model (DeepServe §6, Dynamo's SLA planner, Knative's two windows):

- Load is measured in instances' worth of work. A request rate ``r`` with ``p`` prompt and
  ``o`` output tokens per request needs ``r·p·prefill(p) + r·o·decode(p + o/2)`` instances,
  where ``prefill(n)`` and ``decode(c)`` are one instance's seconds per token for a prompt
  of n tokens and at a context of c tokens (``InstanceCapacity``, measured once per model
  and engine: attention makes long prompts and long contexts dearer per token). Rates come
  from the JEs' arrivals over a stable window (60 s) and a panic window (6 s); ``o`` is the
  mean output of recently finished requests.
- Wanted replicas: the stable load over the target utilisation; the panic load likewise
  when it asks for at least ``panic_factor`` × the ready instances (a burst); while
  requests queue, the work waiting (sequences over ``max_num_seqs`` slots, queued prompt
  tokens over what one instance prefills in ``backlog_drain_s``); and one more than all
  that while recent requests miss their SLO with requests queueing. Within ``tolerance``
  of the current count, the current count. At least one while any request arrived within
  the keep-alive or is held; clamped to [min, max] replicas.
- Scale out at once, onto idle pre-warmed TEs (placement: ``placement_order``), except
  during a model's load-failure backoff. Scale in only after the wanted count stayed below
  the current one for the whole stable window, and never while panicking or loading; the
  removed instance is the least busy one and drains before it unloads. A model that got no
  request for its keep-alive drops to ``min_replicas`` with its instances idle for as long.
  Scale-up and idle scale-down read the same clock (the newest arrival), so an instance
  unloaded at keep-alive is never reloaded without a new request.
- When no TE is idle, a model that wants more instances takes them from models with more
  than they want (``reclaim``): their surplus drains now instead of after the stable
  window, and the freed TE is reserved for the model it was taken for. A model with requests
  and no instance at all, where no model has a surplus, takes one instance from the model
  with the most (max-min fair: nobody loses its last instance).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Mapping, Sequence

from services.views import TEView
from shared.messages.cluster import TEState
from shared.messages.scaling import InstanceCapacity, ModelOutcomes, ModelTraffic

BUCKET_S = 1.0  # arrivals and outcomes are kept in buckets of this width


@dataclasses.dataclass(frozen=True, slots=True)
class ModelPolicy:
    min_replicas: int = 0  # 0: the model may scale to zero
    max_replicas: int = 8
    target_utilization: float = 0.7  # of an instance's capacity, in steady state
    keep_alive_s: float = 60.0  # no request for this long: down to min_replicas


@dataclasses.dataclass(frozen=True, slots=True)
class ScalerConfig:
    default: ModelPolicy = ModelPolicy()
    models: Mapping[str, ModelPolicy] = dataclasses.field(default_factory=dict)
    stable_window_s: float = 60.0
    panic_window_s: float = 6.0
    panic_factor: float = 2.0
    tolerance: float = 0.1  # wanted/current within 1 ± this: no change (hysteresis)
    slo_window_s: float = 30.0
    slo_target: float = 0.95
    slo_min_samples: int = 8
    backlog_drain_s: float = 2.0
    default_output_tokens: int = 256  # per request, before any finished
    backoff_base_s: float = 2.0  # wait after a model's first failed load, doubled per failure
    backoff_max_s: float = 60.0
    pending_timeout_s: float = 300.0  # a load not seen ready or failed by then is lost
    # A load whose TE still shows idle (and not failed) this long after it was sent never
    # took (the command was lost, or the TE restarted).
    load_lost_s: float = 5.0
    held_ttl_s: float = 5.0  # a JE's held count is forgotten when it stops reporting
    load_bandwidth: float = 1.0e9  # bytes/s a load reads and packs what its host cache lacks
    preload_window_s: float = 600.0  # demand this recent predicts a load (preload.py; 0: off)

    def policy(self, model: str) -> ModelPolicy:
        return self.models.get(model, self.default)


# -- memory ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Bucket:
    """Running totals of a model's traffic up to the end of the bucket starting at ``at``:
    a window's figures are the difference of two buckets (found by bisection), so a
    decision costs the same whatever the window."""

    at: float  # start of the bucket, unix seconds
    arrivals: int = 0
    prompt_tokens: int = 0
    max_output_tokens: int = 0
    finished: int = 0
    slo_met: int = 0
    output_tokens: int = 0
    misses: int = 0


_ZERO = Bucket(at=0.0)
_TOTALS = (
    "arrivals",
    "prompt_tokens",
    "max_output_tokens",
    "finished",
    "slo_met",
    "output_tokens",
    "misses",
)


@dataclasses.dataclass(frozen=True, slots=True)
class Held:
    count: int
    prompt_tokens: int
    at: float


@dataclasses.dataclass(frozen=True, slots=True)
class ModelMemory:
    buckets: tuple[Bucket, ...] = ()  # oldest first, within the longest window
    last_demand: float = 0.0  # unix seconds of the newest arrival or held job
    held: Mapping[str, Held] = dataclasses.field(default_factory=dict)  # by JE
    failures: int = 0  # failed loads in a row
    failed_at: float = 0.0
    below_since: float | None = None  # wanted < current since then (scale-in hysteresis)
    capacity: InstanceCapacity | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class PendingLoad:
    model: str
    pool_id: str
    since: float
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class ScalerState:
    models: Mapping[str, ModelMemory] = dataclasses.field(default_factory=dict)
    pending: Mapping[str, PendingLoad] = dataclasses.field(default_factory=dict)  # by TE
    draining: Mapping[str, str] = dataclasses.field(default_factory=dict)  # TE -> model
    # TEs drained for another model (``reclaim``): TE -> the model that gets it when idle.
    reserved: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def memory(self, model: str) -> ModelMemory:
        return self.models.get(model, ModelMemory())

    def with_memory(self, model: str, mem: ModelMemory) -> ScalerState:
        return dataclasses.replace(self, models={**self.models, model: mem})


def _add_to_bucket(
    buckets: tuple[Bucket, ...], now: float, keep_s: float, **add: int
) -> tuple[Bucket, ...]:
    start = math.floor(now / BUCKET_S) * BUCKET_S
    # Keep the buckets of the longest window, and the one before them (the base of sums).
    first = bisect.bisect_right(buckets, now - keep_s - BUCKET_S, key=lambda b: b.at)
    kept = buckets[max(first - 1, 0) :]
    last = kept[-1] if kept else Bucket(at=start)
    totals = {k: getattr(last, k) + add.get(k, 0) for k in _TOTALS}
    if kept and last.at == start:
        return (*kept[:-1], Bucket(at=start, **totals))
    return (*kept, Bucket(at=start, **totals))


def _keep_s(cfg: ScalerConfig) -> float:
    return max(cfg.stable_window_s, cfg.slo_window_s, cfg.panic_window_s)


def observe_traffic(
    state: ScalerState,
    je_id: str,
    traffic: Sequence[ModelTraffic],
    *,
    now: float,
    cfg: ScalerConfig,
) -> ScalerState:
    """A JE's report: arrivals since its previous one, and its held jobs now."""
    models = dict(state.models)
    for t in traffic:
        mem = models.get(t.model, ModelMemory())
        buckets = mem.buckets
        if t.arrivals or t.misses:
            buckets = _add_to_bucket(
                buckets,
                now,
                _keep_s(cfg),
                arrivals=t.arrivals,
                prompt_tokens=t.prompt_tokens,
                max_output_tokens=t.max_output_tokens,
                misses=t.misses,
            )
        held = {k: v for k, v in mem.held.items() if k != je_id}
        if t.held > 0:
            held[je_id] = Held(t.held, t.held_prompt_tokens, now)
        demand = now if (t.arrivals or t.held > 0) else mem.last_demand
        models[t.model] = dataclasses.replace(mem, buckets=buckets, held=held, last_demand=demand)
    reported = {t.model for t in traffic}
    for model, mem in models.items():  # this JE holds nothing for the others
        if model not in reported and je_id in mem.held:
            held = {k: v for k, v in mem.held.items() if k != je_id}
            models[model] = dataclasses.replace(mem, held=held)
    return dataclasses.replace(state, models=models)


def observe_outcomes(
    state: ScalerState, outcomes: Sequence[ModelOutcomes], *, now: float, cfg: ScalerConfig
) -> ScalerState:
    """A frontend's report: requests finished since its previous one, and how many met the
    SLO."""
    models = dict(state.models)
    for o in outcomes:
        mem = models.get(o.model, ModelMemory())
        buckets = _add_to_bucket(
            mem.buckets,
            now,
            _keep_s(cfg),
            finished=o.finished,
            slo_met=o.slo_met,
            output_tokens=o.output_tokens,
        )
        models[o.model] = dataclasses.replace(mem, buckets=buckets)
    return dataclasses.replace(state, models=models)


def observe_capacity(state: ScalerState, model: str, capacity: InstanceCapacity) -> ScalerState:
    return state.with_memory(model, dataclasses.replace(state.memory(model), capacity=capacity))


# -- settling what was sent ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class LoadSettled:
    te_id: str
    model: str
    pool_id: str
    ok: bool
    sent_at: float
    reason: str
    error: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class UnloadSettled:
    te_id: str
    model: str


Settled = LoadSettled | UnloadSettled


def observe_view(
    state: ScalerState, tes: Sequence[TEView], *, now: float, cfg: ScalerConfig
) -> tuple[ScalerState, list[Settled]]:
    """Loads and unloads sent earlier that the view now shows done (or failed, or lost
    with their TE); a failed load starts the model's backoff, a ready one ends it."""
    by_id = {te.te_id: te for te in tes}
    settled: list[Settled] = []
    pending = dict(state.pending)
    for te_id, p in state.pending.items():
        te = by_id.get(te_id)
        if te is not None and te.failed_model == p.model and te.state == TEState.IDLE:
            mem = state.memory(p.model)
            state = state.with_memory(
                p.model, dataclasses.replace(mem, failures=mem.failures + 1, failed_at=now)
            )
            settled.append(
                LoadSettled(te_id, p.model, p.pool_id, False, p.since, p.reason, te.error)
            )
            del pending[te_id]
        elif te is not None and te.model == p.model and te.state == TEState.READY:
            settled.append(LoadSettled(te_id, p.model, p.pool_id, True, p.since, p.reason))
            del pending[te_id]
        elif (
            te is None
            or now - p.since > cfg.pending_timeout_s
            or (
                te.state == TEState.IDLE
                and te.failed_model != p.model
                and now - p.since > cfg.load_lost_s
            )
        ):
            # The TE is gone, or the command never took: free the slot for a new decision.
            settled.append(LoadSettled(te_id, p.model, p.pool_id, False, p.since, p.reason, "lost"))
            del pending[te_id]
    draining = dict(state.draining)
    for te_id, model in state.draining.items():
        te = by_id.get(te_id)
        if te is None or te.model != model:
            settled.append(UnloadSettled(te_id, model))
            del draining[te_id]
    for te in tes:
        if te.state == TEState.READY and te.model is not None:
            mem = state.memory(te.model)
            if mem.failures:
                state = state.with_memory(te.model, dataclasses.replace(mem, failures=0))
            if te.capacity is not None and mem.capacity is None:
                state = observe_capacity(state, te.model, te.capacity)
    return dataclasses.replace(state, pending=pending, draining=draining), settled


# -- deciding ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Load:
    te_id: str
    model: str
    reason: str = ""
    weights_from: str | None = None  # another host's weight server to fork from
    multicast: MulticastPlan | None = None


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


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    """Why a model has the replica count it is given: every figure the rule used."""

    model: str
    current: int  # ready + loading, not draining
    ready: int
    wanted: int
    stable_load: float  # instances' worth of work, stable window
    panic_load: float
    backlog: int  # instances the work waiting now needs
    slo_attainment: float | None
    panicking: bool
    idle: bool  # no request within the keep-alive
    reason: str


def load_backoff(failures: int, cfg: ScalerConfig) -> float:
    """Seconds to wait before loading a model again after `failures` failed loads in a row."""
    if failures <= 0:
        return 0.0
    return min(cfg.backoff_max_s, cfg.backoff_base_s * 2.0 ** (failures - 1))


def _window(mem: ModelMemory, now: float, window_s: float) -> Bucket:
    """The traffic of the last ``window_s`` (a bucket partly inside counts whole)."""
    if not mem.buckets:
        return Bucket(at=now - window_s)
    end = mem.buckets[-1]
    i = bisect.bisect_right(mem.buckets, now - window_s - BUCKET_S, key=lambda b: b.at)
    base = mem.buckets[i - 1] if i else _ZERO  # i == 0: everything since the first
    return Bucket(
        at=now - window_s,
        arrivals=end.arrivals - base.arrivals,
        prompt_tokens=end.prompt_tokens - base.prompt_tokens,
        max_output_tokens=end.max_output_tokens - base.max_output_tokens,
        finished=end.finished - base.finished,
        slo_met=end.slo_met - base.slo_met,
        output_tokens=end.output_tokens - base.output_tokens,
        misses=end.misses - base.misses,
    )


def _instances_of_work(
    w: Bucket, window_s: float, output_per_request: float, cap: InstanceCapacity
) -> float:
    """Instances kept busy by the window's traffic: its prompt tokens at the prefill cost
    of its mean prompt, its output tokens at the decode cost of its mean context."""
    if not w.arrivals:
        return 0.0
    prompt = w.prompt_tokens / w.arrivals
    prefill = w.prompt_tokens / cap.prefill_tokens_per_s(round(prompt))
    decode = (
        w.arrivals
        * output_per_request
        / cap.decode_tokens_per_s(round(prompt + output_per_request / 2))
    )
    return (prefill + decode) / window_s


def _mean_prompt(w: Bucket) -> int:
    return round(w.prompt_tokens / w.arrivals) if w.arrivals else 512


def _replicas(instances: float, current: int, tolerance: float) -> int:
    """Instances for ``instances`` worth of work at the target; within ``tolerance`` of the
    current count, the current count (a load wobbling at a threshold changes nothing)."""
    if current and abs(instances / current - 1.0) <= tolerance:
        return current
    return math.ceil(instances - 1e-9)


def target(
    model: str,
    mem: ModelMemory,
    instances: Sequence[TEView],
    *,
    coming: int = 0,
    now: float,
    cfg: ScalerConfig,
) -> Target:
    """The replica count the model should have now, with the figures behind it.
    ``coming``: loads sent that the view does not show yet."""
    pol = cfg.policy(model)
    ready = [te for te in instances if te.state == TEState.READY]
    current = len(instances) + coming
    held = [h for h in mem.held.values() if now - h.at <= cfg.held_ttl_s]
    held_n = sum(h.count for h in held)
    held_tokens = sum(h.prompt_tokens for h in held)
    idle = held_n == 0 and now - mem.last_demand > pol.keep_alive_s
    stable = _window(mem, now, cfg.stable_window_s)
    panic = _window(mem, now, cfg.panic_window_s)
    slo = _window(mem, now, cfg.slo_window_s)
    attainment = slo.slo_met / slo.finished if slo.finished >= cfg.slo_min_samples else None
    if stable.finished:
        out_per_req = stable.output_tokens / stable.finished
    elif stable.arrivals:
        out_per_req = min(stable.max_output_tokens / stable.arrivals, cfg.default_output_tokens)
    else:
        out_per_req = float(cfg.default_output_tokens)
    cap = mem.capacity
    stable_load = panic_load = 0.0
    backlog = 0
    waiting = sum(te.waiting for te in instances) + held_n
    if cap is not None:
        stable_load = _instances_of_work(stable, cfg.stable_window_s, out_per_req, cap)
        panic_load = _instances_of_work(panic, cfg.panic_window_s, out_per_req, cap)
        active = sum(te.load for te in instances) + held_n
        queued_tokens = sum(te.queued_prompt_tokens for te in instances) + held_tokens
        if waiting:  # a queue: the batch slots or the prefill rate are the bottleneck
            backlog = max(
                # Full batches: the slots, not a utilisation target, are the limit.
                math.ceil(active / cap.max_num_seqs),
                math.ceil(
                    queued_tokens
                    / (cap.prefill_tokens_per_s(_mean_prompt(stable)) * cfg.backlog_drain_s)
                ),
            )
    target_u = pol.target_utilization
    wanted = _replicas(stable_load / target_u, current, cfg.tolerance)
    reason = "load"
    panic_wanted = _replicas(panic_load / target_u, current, cfg.tolerance)
    panicking = panic_wanted >= cfg.panic_factor * max(len(ready), 1) and panic_wanted > len(ready)
    if panicking and panic_wanted > wanted:
        wanted, reason = panic_wanted, "burst"
    if backlog > wanted:
        wanted, reason = backlog, "queue"
    if (
        attainment is not None
        and attainment < cfg.slo_target
        and waiting
        and current == len(ready)  # nothing loading: its arrival may be all it needs
    ):
        # One instance beyond what the load asks for, never more: misses that a queue does
        # not cause (a prompt longer than the engine prefills within its SLO) must not
        # ratchet the fleet up to max_replicas.
        wanted, reason = max(wanted, 1) + 1, "slo"
    if idle:
        wanted, reason = 0, "idle"
    elif wanted < 1:
        wanted, reason = 1, "demand"
    if wanted < pol.min_replicas:
        wanted, reason = pol.min_replicas, "min_replicas"
    if wanted > pol.max_replicas:
        wanted, reason = pol.max_replicas, "max_replicas"
    return Target(
        model=model,
        current=current,
        ready=len(ready),
        wanted=wanted,
        stable_load=stable_load,
        panic_load=panic_load,
        backlog=backlog,
        slo_attainment=attainment,
        panicking=panicking,
        idle=idle,
        reason=reason,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class PoolIndex:
    """What a placement weighs of each node pool, read off the view in one pass (a decision
    that places many models builds it once): per (model, pool) the instances serving there,
    whether the model is warm there (loaded there now or lately) and the bytes of it the
    pool's host cache holds; each model's size as any host reports it; idle TEs per pool."""

    serving: Mapping[tuple[str, str], int]
    warm: frozenset[tuple[str, str]]
    resident: Mapping[tuple[str, str], int]
    size: Mapping[str, int]
    idle: Mapping[str, int]


def pool_index(tes: Sequence[TEView]) -> PoolIndex:
    serving: dict[tuple[str, str], int] = {}
    warm: set[tuple[str, str]] = set()
    resident: dict[tuple[str, str], int] = {}
    size: dict[str, int] = {}
    idle: dict[str, int] = {}
    for te in tes:
        pool = te.pool_id
        if te.model is not None:
            warm.add((te.model, pool))
            if te.serving:
                serving[te.model, pool] = serving.get((te.model, pool), 0) + 1
        warm.update((m, pool) for m in te.recent_models)
        if te.state == TEState.IDLE:
            idle[pool] = idle.get(pool, 0) + 1
        for m, cached in te.cached_weights.items():
            size[m] = max(size.get(m, 0), cached.total_bytes)
            resident[m, pool] = max(resident.get((m, pool), 0), cached.resident_bytes)
    return PoolIndex(serving, frozenset(warm), resident, size, idle)


def load_time(
    model: str,
    pool_id: str,
    tes: Sequence[TEView],
    cfg: ScalerConfig,
    index: PoolIndex | None = None,
) -> float:
    """Tangram's ``t_load = (S − S_resident) / B`` of ``model`` on ``pool_id``'s host: S
    the model's bytes as any host's cache reports them, S_resident what this pool's cache
    holds, B ``cfg.load_bandwidth``; inf where no host has ever cached the model (unknown).
    ``index``: ``pool_index(tes)``, where the caller has it."""
    return _load_time(model, pool_id, cfg, index or pool_index(tes))


def _load_time(model: str, pool_id: str, cfg: ScalerConfig, idx: PoolIndex) -> float:
    total = idx.size.get(model, 0)
    if total == 0:
        return math.inf
    return max(total - idx.resident.get((model, pool_id), 0), 0) / cfg.load_bandwidth


def _pool_rank(
    model: str, pool: str, cfg: ScalerConfig, idx: PoolIndex
) -> tuple[int, float, bool, int]:
    """How good ``pool`` is for a new instance of ``model``, smallest best: the first four
    criteria of ``placement_order``."""
    return (
        idx.serving.get((model, pool), 0),
        _load_time(model, pool, cfg, idx),
        (model, pool) not in idx.warm,
        -idx.idle.get(pool, 0),
    )


def fork_source(model: str, pool_id: str, tes: Sequence[TEView]) -> str | None:
    """Where a new instance of ``model`` on ``pool_id`` should fork its weights from: the
    weight server of another pool whose host cache holds all of them, when this pool's
    does not (the first such pool by name); None where this pool's cache holds it or no
    other pool does."""
    here = [te.cached_weights.get(model) for te in tes if te.pool_id == pool_id]
    if any(c is not None and c.resident_bytes >= c.total_bytes for c in here):
        return None
    sources = sorted(
        (te.pool_id, te.weight_server)
        for te in tes
        if te.pool_id != pool_id
        and te.weight_server
        and (c := te.cached_weights.get(model)) is not None
        and c.resident_bytes >= c.total_bytes > 0
    )
    return sources[0][1] if sources else None


def placement_order(
    model: str,
    idle: Sequence[TEView],
    tes: Sequence[TEView],
    cfg: ScalerConfig | None = None,
    index: PoolIndex | None = None,
) -> list[TEView]:
    """Idle TEs in the order a new instance of ``model`` should take them: instances of one
    model spread across node pools (fewest there first); then the pool that loads it
    fastest, by ``load_time`` from its host cache's metadata; then a pool where the model
    was loaded before (its files are in the page cache); then the pool with the most idle
    TEs (the least loaded); within a pool, a TE that ran the model lately, then by id.
    ``index``: ``pool_index(tes)``, where the caller has it."""
    cfg = cfg or ScalerConfig()
    idx = index or pool_index(tes)
    rank = {pool: _pool_rank(model, pool, cfg, idx) for pool in {te.pool_id for te in idle}}
    return sorted(idle, key=lambda te: (rank[te.pool_id], model not in te.recent_models, te.te_id))


def best_pool(
    model: str, idle_by_pool: Mapping[str, Sequence[TEView]], cfg: ScalerConfig, index: PoolIndex
) -> str:
    """The pool of ``placement_order(model, idle, ...)[0]`` (``idle_by_pool``: those TEs by
    pool) without ordering every idle TE: the pools ranked, and only the best-ranked pools'
    TEs compared (a pre-load weighs every recently used model each tick; at 2,000 TEs and
    500 models sorting each model's TEs took the whole tick)."""
    rank = {pool: _pool_rank(model, pool, cfg, index) for pool in idle_by_pool}
    top = min(rank.values())
    return min(
        (te for pool, r in rank.items() if r == top for te in idle_by_pool[pool]),
        key=lambda te: (model not in te.recent_models, te.te_id),
    ).pool_id


def _victims(instances: Sequence[TEView], n: int, *, idle_since: float | None) -> list[TEView]:
    """The ``n`` instances to drain: the least busy, the most recently active last.
    ``idle_since``: only instances with nothing to do and no activity since then."""
    ready = [te for te in instances if te.state == TEState.READY]
    if idle_since is not None:
        ready = [te for te in ready if te.load == 0 and te.last_active <= idle_since]
    ready.sort(key=lambda te: (te.load, te.last_active, te.te_id))
    return ready[:n]


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
    for p in state.pending.values():
        pending_by_model[p.model] = pending_by_model.get(p.model, 0) + 1
    new_pending = dict(state.pending)
    new_draining = dict(state.draining)
    memories = dict(state.models)
    by_model: dict[str, list[TEView]] = {}
    for te in tes:
        if te.model is not None:
            by_model.setdefault(te.model, []).append(te)
    view = list(tes)
    known = set(models)
    for model in sorted(known | set(by_model)):
        mem = memories.get(model, ModelMemory())
        pol = cfg.policy(model)
        if (
            model not in by_model
            and model not in pending_by_model
            and pol.min_replicas == 0
            and now - mem.last_demand > pol.keep_alive_s
            and not mem.held
        ):
            continue  # at zero and no request: nothing to decide (most models, most ticks)
        instances = [
            te for te in by_model.get(model, ()) if te.serving and te.te_id not in state.draining
        ]
        # A load sent but not in the view yet is an instance too (it is coming).
        coming = pending_by_model.get(model, 0) - sum(
            1 for te in instances if te.te_id in state.pending
        )
        t = target(model, mem, instances, coming=max(coming, 0), now=now, cfg=cfg)
        current = t.current
        targets[model] = t
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
                idle.remove(te)
                free.remove(te)
                reserved.pop(te.te_id, None)
                actions.append(
                    Load(te.te_id, model, t.reason, fork_source(model, te.pool_id, view))
                )
                new_pending[te.te_id] = PendingLoad(model, te.pool_id, now, t.reason)
                # Seen by the next placement, so the model's instances spread.
                view = [
                    dataclasses.replace(x, state=TEState.LOADING, model=model)
                    if x.te_id == te.te_id
                    else x
                    for x in view
                ]
        elif t.wanted < current:
            if t.idle:
                # Down to min_replicas (``wanted``), once instances have been idle as long.
                victims = _victims(
                    instances,
                    t.ready - t.wanted,
                    idle_since=now - cfg.policy(model).keep_alive_s,
                )
                reason = "keep-alive expired"
            elif coming > 0 or t.panicking or t.current > t.ready:
                victims, reason = [], ""
                mem = _not_below(mem)
            else:
                since = now if mem.below_since is None else mem.below_since
                mem = dataclasses.replace(mem, below_since=since)
                due = now - since >= cfg.stable_window_s
                victims = _victims(instances, t.ready - t.wanted, idle_since=None) if due else []
                reason = "load fell"
                if victims:
                    mem = dataclasses.replace(mem, below_since=None)
            for te in victims:
                actions.append(Unload(te.te_id, model, reason))
                new_draining[te.te_id] = model
        else:
            mem = _not_below(mem)
        if t.wanted <= current:  # wants no more: what was freed for it is free for all
            reserved = {te_id: m for te_id, m in reserved.items() if m != model}
        memories[model] = mem
    reserved = {te_id: m for te_id, m in reserved.items() if m in targets}
    reclaimed, reserved = reclaim(short, targets, by_model, reserved, new_draining)
    for te_id, model, reason in reclaimed:
        actions.append(Unload(te_id, model, reason))
        new_draining[te_id] = model
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
) -> tuple[list[tuple[str, str, str]], dict[str, str]]:
    """When every TE holds a model, a model that wants more instances than it has (``short``)
    takes them from models that have more than they want: the surplus that scale-in would
    remove once the stable window has passed, removed now for a model with work waiting.
    Starved models (no instance at all) first, then the largest shortfall. The victim is the
    least busy surplus instance (a starved model with no surplus left takes one from the model
    with the most instances, if it has two or more); it drains and is reserved for the model
    it was taken for. Instances already being freed for a model (``reserved``: TE -> model)
    count against its shortfall. Returns (TE, its model, reason) to unload, and the
    reservations with the new ones added."""
    reserved = dict(reserved)
    freeing: dict[str, int] = {}
    for model in reserved.values():
        freeing[model] = freeing.get(model, 0) + 1
    surplus: list[TEView] = []
    for model, t in targets.items():
        if t.wanted >= t.current or t.panicking or t.current > t.ready:
            continue  # needs what it has, or is mid-burst or still loading
        ready = [
            te
            for te in by_model.get(model, ())
            if te.state == TEState.READY and te.te_id not in draining
        ]
        surplus += _victims(ready, t.current - t.wanted, idle_since=None)
    surplus.sort(key=lambda te: (te.load, te.last_active, te.te_id))
    # What each model keeps: a starved model may also take one of the richest model's.
    kept: dict[str, list[TEView]] = {
        m: sorted(
            (te for te in tes if te.state == TEState.READY and te.te_id not in draining),
            key=lambda te: (te.load, te.last_active, te.te_id),
        )
        for m, tes in by_model.items()
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
