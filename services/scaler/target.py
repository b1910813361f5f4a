"""How many instances a model should have now (``target``), with every figure behind it
(``Target``). Pure. The rule (DeepServe §6, Dynamo's SLA planner, Knative's two windows):

- Load is measured in instances' worth of work. A request rate ``r`` with ``p`` prompt and
  ``o`` output tokens per request needs ``r·p·prefill(p) + r·o·decode(p + o/2)`` instances,
  where ``prefill(n)`` and ``decode(c)`` are one instance's seconds per token for a prompt
  of n tokens and at a context of c tokens (``InstanceCapacity``, measured once per model
  and engine: attention makes long prompts and long contexts dearer per token). Rates come
  from the JEs' arrivals over a stable window (60 s) and a panic window (6 s); in a model's
  first minute the stable rate is over the seconds seen (``observed_s``, at least the panic
  window), not the whole window. ``o`` is the mean output of recently finished requests.
- Wanted replicas: the stable load over the target utilisation; the panic load likewise
  when it asks for at least ``panic_factor`` × the ready instances (a burst); while
  requests queue, the work waiting (sequences over ``max_num_seqs`` slots, queued prompt
  tokens over what one instance prefills in ``backlog_drain_s``); and one more than all
  that while recent requests miss their SLO with requests queueing. Within ``tolerance``
  of the current count, the current count. At least one while any request arrived within
  the keep-alive or is held; clamped to [min, max] replicas.
- After SLO misses (the SLO window's attainment below target within the last
  ``slo_memory_s``, 5 minutes), scale-in goes no lower than the peak: the most instances
  the panic window's load asked for (``burst``, at the target utilisation, whether
  panicking or not) at any tick of the stable window (Knative's scale-down delay). A fleet
  sized to the mean of bursty traffic misses TTFTs at every burst, a load taking seconds,
  and a burst seen within the last minute is the best guess that another comes; where
  every request meets its SLO the mean's fleet is enough, and holding the peaks of mere
  noise would cost instances (a fifth more on the Azure conversation trace).
- PD disaggregation (``max_prefill_replicas`` > 0): the job executors report the prompt
  tokens their PD rule would send to a prefill instance (``pd_prompt_tokens``: the part the
  decode instance lacks). That work, at the prefill cost of its mean prompt, sizes the
  prefill instances (over the target utilisation, within ``tolerance``, at most
  ``max_prefill_replicas``; none once idle), or, while prompts queue at them, as many as
  drain that queue in ``backlog_drain_s``; what the prefill instances did compute
  (``pd_placed_tokens``, at most their count's worth) leaves the other instances' load.
  Prefill instances scale in after the stable window, like the others.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from services.scaler.state import Bucket, ModelMemory, ScalerConfig, observed_s, peak, window
from services.views import TEView
from shared.messages.cluster import TEState
from shared.messages.scaling import InstanceCapacity


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
    # PD: prefill instances up or coming, wanted, and their work (instances' worth, stable
    # window); wanted is the current count where the scaler does not manage them.
    prefill_current: int = 0
    prefill_wanted: int = 0
    prefill_load: float = 0.0
    # Instances the panic window's load asks for now (at the target utilisation), and,
    # after recent SLO misses, the most it asked for within the stable window, now included
    # (else 0): scale-in goes no lower.
    burst: int = 0
    peak: int = 0
    missing: bool = False  # the SLO window's attainment is below the target now


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


def _prefill_instances(tokens: int, w: Bucket, window_s: float, cap: InstanceCapacity) -> float:
    """Instances kept busy by ``tokens`` of the window's prompts at a prefill instance's
    rate: ``pd_prompt_tokens`` (what the PD rule sends to prefill instances) or
    ``pd_placed_tokens`` (what they did compute)."""
    return tokens / cap.prefill_tokens_per_s(_mean_pd_prompt(w)) / window_s if tokens else 0.0


def _mean_prompt(w: Bucket) -> int:
    return round(w.prompt_tokens / w.arrivals) if w.arrivals else 512


def _mean_pd_prompt(w: Bucket) -> int:
    """The mean prompt a prefill instance computes (of all prompts, before there is one)."""
    return round(w.pd_prompt_tokens / w.pd_arrivals) if w.pd_arrivals else _mean_prompt(w)


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
    prefill: Sequence[TEView] = (),
    prefill_coming: int = 0,
    now: float,
    cfg: ScalerConfig,
) -> Target:
    """The replica count the model should have now, with the figures behind it.
    ``instances``: its instances that take whole requests; ``prefill``: its prefill
    instances (PD); ``coming``, ``prefill_coming``: loads sent that the view does not show
    yet."""
    pol = cfg.policy(model)
    ready = [te for te in instances if te.state == TEState.READY]
    current = len(instances) + coming
    held = [h for h in mem.held.values() if now - h.at <= cfg.held_ttl_s]
    held_n = sum(h.count for h in held)
    held_tokens = sum(h.prompt_tokens for h in held)
    idle = held_n == 0 and now - mem.last_demand > pol.keep_alive_s
    stable = window(mem, now, cfg.stable_window_s)
    # The stable window's seconds of traffic seen (a new model's first minute: fewer, but
    # never less than the panic window).
    stable_s = observed_s(mem, now, cfg.stable_window_s, cfg.panic_window_s)
    panic = window(mem, now, cfg.panic_window_s)
    slo = window(mem, now, cfg.slo_window_s)
    attainment = slo.slo_met / slo.finished if slo.finished >= cfg.slo_min_samples else None
    missing = attainment is not None and attainment < cfg.slo_target
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
    prefill_current = len(prefill) + prefill_coming
    prefill_load = prefill_panic = 0.0
    if cap is not None:
        stable_load = _instances_of_work(stable, stable_s, out_per_req, cap)
        panic_load = _instances_of_work(panic, cfg.panic_window_s, out_per_req, cap)
        prefill_load = _prefill_instances(stable.pd_prompt_tokens, stable, stable_s, cap)
        prefill_panic = _prefill_instances(panic.pd_prompt_tokens, panic, cfg.panic_window_s, cap)
        # What the prefill instances took of it is not the others' work (what the rule
        # wanted to send them, and they could carry, may be more: a prompt stays where a
        # prefill instance would start it later).
        taken = _prefill_instances(stable.pd_placed_tokens, stable, stable_s, cap)
        taken_panic = _prefill_instances(panic.pd_placed_tokens, panic, cfg.panic_window_s, cap)
        stable_load -= min(taken, prefill_current)
        panic_load -= min(taken_panic, prefill_current)
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
        missing
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
    prefill_wanted = prefill_current
    if pol.max_prefill_replicas:
        work = max(prefill_load, prefill_panic) if panicking else prefill_load
        prefill_wanted = _replicas(work / target_u, prefill_current, cfg.tolerance)
        queued = sum(te.queued_prompt_tokens for te in prefill)
        if queued and cap is not None:  # prompts wait at the prefill instances: drain them
            rate = cap.prefill_tokens_per_s(_mean_pd_prompt(stable))
            prefill_wanted = max(prefill_wanted, math.ceil(queued / (rate * cfg.backlog_drain_s)))
        prefill_wanted = 0 if idle else min(prefill_wanted, pol.max_prefill_replicas)
    burst = math.ceil(panic_load / target_u - 1e-9)
    # After misses only: where every request meets its SLO, the mean's fleet is enough.
    missed = missing or now - mem.missed_at < cfg.slo_memory_s
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
        prefill_current=prefill_current,
        prefill_wanted=prefill_wanted,
        prefill_load=prefill_load,
        burst=burst,
        peak=max(peak(mem, now, cfg.stable_window_s), burst) if missed else 0,
        missing=missing,
    )
