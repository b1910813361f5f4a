"""What the scaler's policy knows, and how each observation updates it. Pure: a state and
an observation in, the new state out (frozen dataclasses; nothing passed in is changed).

- ``ScalerConfig`` (with a ``ModelPolicy`` per model): the rule's parameters.
- ``ScalerState``: per model its ``ModelMemory`` (traffic and outcomes in ``Bucket``s of
  running totals, held jobs, failed loads, scale-in hysteresis, instance capacity), and the
  loads and unloads sent but not yet seen done.
- ``observe_traffic`` (a JE's report), ``observe_outcomes`` (a frontend's),
  ``observe_capacity`` and ``observe_view`` (the cluster view: which loads and unloads
  settled, as ``LoadSettled`` and ``UnloadSettled``).
- ``window``: a model's traffic over the last seconds, the difference of two buckets.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Mapping, Sequence

from services.views import TEView
from shared.messages.cluster import TEState
from shared.messages.scaling import InstanceCapacity, ModelOutcomes, ModelTraffic
from shared.messages.tasks import TaskMode
from shared.slo import SLO

BUCKET_S = 1.0  # arrivals and outcomes are kept in buckets of this width


@dataclasses.dataclass(frozen=True, slots=True)
class ModelPolicy:
    min_replicas: int = 0  # 0: the model may scale to zero
    max_replicas: int = 8
    target_utilization: float = 0.7  # of an instance's capacity, in steady state
    keep_alive_s: float = 60.0  # no request for this long: down to min_replicas
    # PD disaggregation: most prefill instances (0: the scaler loads none, and leaves alone
    # any an operator loaded until the keep-alive).
    max_prefill_replicas: int = 0


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
    # After the SLO window's attainment was last below the target, for this long scale-in
    # keeps the peak of the stable window (target.py).
    slo_memory_s: float = 300.0
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
    slo: SLO = dataclasses.field(default_factory=SLO)  # placement: CPU before GPU

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
    pd_arrivals: int = 0  # placed with a prompt the PD rule sends to a prefill instance
    pd_prompt_tokens: int = 0  # the prompt tokens they compute there
    pd_placed_tokens: int = 0  # of all prompt tokens, those prefill instances computed


_ZERO = Bucket(at=0.0)
_TOTALS = (
    "arrivals",
    "prompt_tokens",
    "max_output_tokens",
    "finished",
    "slo_met",
    "output_tokens",
    "misses",
    "pd_arrivals",
    "pd_prompt_tokens",
    "pd_placed_tokens",
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
    prefill_below_since: float | None = None  # the same for its prefill instances
    # When ``reclaim`` last took one of its prefill instances for a model short of
    # whole-request instances: none is loaded again for a stable window (no ping-pong).
    prefill_yielded_at: float = -math.inf
    capacity: InstanceCapacity | None = None
    # The instances its panic window asked for (``Target.burst``) at the ticks of the last
    # stable window, as (when, count), each count above every later one: the first is the
    # window's peak (``peak``), which scale-in does not go below.
    peaks: tuple[tuple[float, int], ...] = ()
    missed_at: float = -math.inf  # when the SLO window's attainment was last below target


@dataclasses.dataclass(frozen=True, slots=True)
class PendingLoad:
    model: str
    pool_id: str
    since: float
    reason: str
    role: TaskMode = TaskMode.COLOCATED


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
        if t.arrivals or t.misses or t.pd_arrivals:
            buckets = _add_to_bucket(
                buckets,
                now,
                _keep_s(cfg),
                arrivals=t.arrivals,
                prompt_tokens=t.prompt_tokens,
                max_output_tokens=t.max_output_tokens,
                misses=t.misses,
                pd_arrivals=t.pd_arrivals,
                pd_prompt_tokens=t.pd_prompt_tokens,
                pd_placed_tokens=t.pd_placed_tokens,
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


# -- reading a window --------------------------------------------------------------------------


def note_peak(mem: ModelMemory, now: float, count: int, window_s: float) -> ModelMemory:
    """``count`` instances asked for now, remembered for ``window_s`` (``peak``): what is
    older, or no more than it, is dropped (it can never be the peak again)."""
    kept = tuple((at, n) for at, n in mem.peaks if now - at < window_s and n > count)
    return dataclasses.replace(mem, peaks=(*kept, (now, count)))


def peak(mem: ModelMemory, now: float, window_s: float) -> int:
    """The most instances asked for (``note_peak``) within the last ``window_s``."""
    return max((n for at, n in mem.peaks if now - at < window_s), default=0)


def observed_s(mem: ModelMemory, now: float, window_s: float, floor_s: float) -> float:
    """How much of the last ``window_s`` the memory has seen the model for: the whole
    window, or, in a model's first window (its first traffic since the scaler started),
    the time since its first bucket, at least ``floor_s``. A rate over the window divides
    by this: a model seconds old would otherwise look a fraction as busy as it is. (A
    model back from a quiet spell keeps its last bucket before it, so its window counts
    the quiet time as such.)"""
    if not mem.buckets:
        return window_s
    # The first bucket counts whole, as ``window`` counts a bucket partly inside.
    return min(window_s, max(floor_s, now - mem.buckets[0].at + BUCKET_S))


def window(mem: ModelMemory, now: float, window_s: float) -> Bucket:
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
        pd_arrivals=end.pd_arrivals - base.pd_arrivals,
        pd_prompt_tokens=end.pd_prompt_tokens - base.pd_prompt_tokens,
        pd_placed_tokens=end.pd_placed_tokens - base.pd_placed_tokens,
    )
