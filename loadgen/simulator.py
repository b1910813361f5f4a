"""A discrete-event simulation of a meshserve cluster, driven by the project's own policies.

The point: judge a scheduling or scaling policy on a fleet far larger than this machine, on
real traces. The decisions come from the modules the services run, called with the same
kind of state they see in production:
- placement: ``services.job_executor.scheduling.pick_te`` over the cluster view (TE
  heartbeats, stale by up to one heartbeat interval) plus the tasks placed since each
  report, as the JE does; a job nobody can take is held, its model's demand goes to the
  scaler, and it fails after the placement timeout as a 503 would;
- scaling: ``services.scaler.policy.decide`` (scale from zero onto idle pre-warmed TEs,
  scale to zero after the keep-alive), on the same view and its pending loads;
- iterations: the torch engine's ``scheduler.schedule`` (continuous batching, admission by
  KV blocks and prefill budget, preemption by recompute).

Only the engines are replaced, by a profiled cost model (``costmodel.EngineProfile``): how
long an iteration takes for its decodes and prefills, how long a model takes to load, how
many KV blocks the engine has. Network hops cost ``network_s`` each.

Not modelled yet (they grow with the policy issues): prefix caching, PD disaggregation,
several instances of one model (the scaler policy does not ask for them), TE failures.

Results are ``loadgen.results.Result`` objects, so a simulated run is summarised, plotted
and compared exactly like a replayed one.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from loadgen.costmodel import EngineProfile
from loadgen.plan import Planned
from loadgen.results import Result
from services.job_executor.scheduling import pick_te
from services.scaler.policy import Load, ScalerConfig, Unload, decide
from services.task_executor.engines.torch_engine.kv_cache import blocks_for
from services.task_executor.engines.torch_engine.scheduler import (
    SchedulerConfig,
    SeqView,
    schedule,
)
from shared.messages.cluster import TEHeartbeat, TEState

# Policies compare times with unix-like clocks (a demand at 0.0 means "never"): the
# simulated clock starts far from zero.
EPOCH = 1_000_000.0


@dataclasses.dataclass(frozen=True, slots=True)
class SimConfig:
    devices: int = 4  # TEs, each able to serve one model at a time
    pool_size: int = 4  # TEs per node pool
    heartbeat_s: float = 1.0
    keep_alive_s: float = 60.0
    placement_timeout_s: float = 60.0
    network_s: float = 0.0005  # one hop: frontend->JE->TE placement, TE->frontend tokens
    scaler_period_s: float = 0.5  # the scaler's tick while it has work
    record_gaps: bool = True  # keep every inter-token gap (memory: 8 bytes per token)


@dataclasses.dataclass(slots=True)
class SimStats:
    events: int = 0
    iterations: int = 0
    loads: int = 0
    unloads: int = 0
    preemptions: int = 0
    timeouts: int = 0
    max_busy_devices: int = 0


@dataclasses.dataclass(slots=True, eq=False)
class _Seq:
    plan: Planned
    result: Result
    prompt: int  # tokens to prefill (prompt, plus outputs when recomputed after preemption)
    generated: int = 0
    blocks: int = 0
    computed: int = 0  # tokens whose K/V the cache holds (a chunked prompt's, mid-way)
    last_token_at: float = 0.0

    @property
    def num_tokens(self) -> int:
        """Tokens whose K/V the cache holds once this request's next iteration ran."""
        return self.plan.input_tokens + self.generated


@dataclasses.dataclass(slots=True, eq=False)
class _TE:
    te_id: str
    pool_id: str
    state: TEState = TEState.IDLE
    model: str | None = None
    profile: EngineProfile | None = None
    running: list[_Seq] = dataclasses.field(default_factory=list)  # oldest first
    waiting: deque[_Seq] = dataclasses.field(default_factory=deque)
    free_blocks: int = 0
    busy: bool = False
    last_active: float = EPOCH
    epoch: int = 0  # bumped on unload, so a stale event is ignored

    def heartbeat(self, now: float) -> TEHeartbeat:
        return TEHeartbeat(
            te_id=self.te_id,
            pool_id=self.pool_id,
            host="sim",
            pid=0,
            state=self.state,
            started_at=EPOCH,
            model=self.model,
            running=len(self.running),
            waiting=len(self.waiting),
            free_kv_blocks=self.free_blocks,
            total_kv_blocks=self.profile.kv_blocks if self.profile else 0,
            last_active=self.last_active,
            sent_at=now,
        )


class Simulation:
    def __init__(
        self, planned: Sequence[Planned], profiles: Mapping[str, EngineProfile], cfg: SimConfig
    ) -> None:
        missing = sorted({p.model for p in planned} - set(profiles))
        if missing:
            raise ValueError(f"no engine profile for model(s) {missing}")
        self.cfg = cfg
        self.profiles = profiles
        self.planned = sorted(planned, key=lambda p: p.arrival_s)
        self.stats = SimStats()
        self.tes = [
            _TE(te_id=f"te-{i:05d}", pool_id=f"pool-{i // max(cfg.pool_size, 1):04d}")
            for i in range(cfg.devices)
        ]
        self._by_id = {te.te_id: te for te in self.tes}
        self.now = EPOCH
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self._queued = 0  # events other than heartbeats
        # What the policies see: the last heartbeat of each TE, refreshed every interval.
        self._view: dict[str, TEHeartbeat] = {te.te_id: te.heartbeat(EPOCH) for te in self.tes}
        self._by_model: dict[str, set[str]] = {}  # model -> TEs whose view names it
        self._placed: dict[str, int] = {}  # te -> tasks placed since its last report
        self._dirty: set[str] = set()  # TEs whose state changed since the last report
        self._held: dict[str, list[_Seq]] = {}  # model -> jobs waiting for an instance
        self._demands: dict[str, float] = {}
        self._pending: dict[str, str] = {}  # te -> model: loads not yet in the view
        self._scaler_at: float | None = None  # when the next scaler tick is due
        self.results: list[Result] = []

    # -- event queue ----------------------------------------------------------------------

    def _at(self, t: float, kind: str, arg: object = None) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, arg))
        self._queued += kind != "heartbeat"

    def run(self) -> list[Result]:
        for p in self.planned:
            self._at(EPOCH + p.arrival_s, "arrive", p)
        self._at(EPOCH + self.cfg.heartbeat_s, "heartbeat")
        handlers: dict[str, Callable[[Any], None]] = {
            "arrive": self._arrive,
            "place": self._place_held,
            "iteration": self._iteration_done,
            "loaded": self._loaded,
            "heartbeat": self._heartbeat,
            "scaler": self._scaler_tick,
            "expire": self._expire,
        }
        while self._events:
            t, _, kind, arg = heapq.heappop(self._events)
            if kind != "heartbeat":
                self._queued -= 1
            elif not self._queued:
                break  # only heartbeats left: nothing can change any more
            self.now = t
            self.stats.events += 1
            handlers[kind](arg)
        self.results.sort(key=lambda r: r.index)
        return self.results

    # -- frontend and job executor ----------------------------------------------------------

    def _arrive(self, p: Planned) -> None:
        t = self.now - EPOCH
        result = Result(
            index=p.index,
            model=p.model,
            scheduled_s=p.arrival_s,
            sent_s=t,
            input_tokens=p.input_tokens,
            output_tokens=p.output_tokens,
            trace_input_tokens=p.trace_input_tokens,
            trace_output_tokens=p.trace_output_tokens,
            clipped_prompt=p.clipped_prompt,
            clipped_output=p.clipped_output,
            trace_model=p.trace_model,
            session_id=p.session_id,
        )
        self.results.append(result)
        seq = _Seq(plan=p, result=result, prompt=p.input_tokens)
        if not self._try_place(seq):
            self._held.setdefault(p.model, []).append(seq)
            self._at(self.now + self.cfg.placement_timeout_s, "expire", seq)

    def _try_place(self, seq: _Seq) -> bool:
        model = seq.plan.model
        tes = [self._view[t] for t in self._by_model.get(model, ())]
        decision = pick_te(model, tes, self._placed)
        if decision.te_id is None:
            if decision.scale_up or not tes:
                self._demand(model)
            return False
        self._placed[decision.te_id] = self._placed.get(decision.te_id, 0) + 1
        te = self._by_id[decision.te_id]
        if te.state != TEState.READY or te.model != model:
            # The view was stale: the TE unloaded since. The JE would be refused and retry.
            return False
        te.waiting.append(seq)
        te.last_active = self.now
        self._dirty.add(te.te_id)
        self._kick(te, delay=2 * self.cfg.network_s)
        return True

    def _place_held(self, model: str) -> None:
        held = self._held.pop(model, [])
        still = [s for s in held if s.result.error is None and not self._try_place(s)]
        if still:
            self._held[model] = still

    def _expire(self, seq: _Seq) -> None:
        held = self._held.get(seq.plan.model)
        if held is None or seq not in held:
            return
        held.remove(seq)
        if not held:
            del self._held[seq.plan.model]
        seq.result.status = 503
        seq.result.error = "no_capacity: no instance could take the request in time"
        self.stats.timeouts += 1

    # -- cluster view -------------------------------------------------------------------------

    def _report(self, te: _TE) -> None:
        """A TE's heartbeat reaches the view (and resets the JE's placed-since count)."""
        old = self._view[te.te_id]
        if old.model is not None and old.model != te.model:
            self._by_model[old.model].discard(te.te_id)
        hb = te.heartbeat(self.now)
        self._view[te.te_id] = hb
        self._placed.pop(te.te_id, None)
        if hb.model is not None:
            self._by_model.setdefault(hb.model, set()).add(te.te_id)
            if self._pending.get(te.te_id) == hb.model:
                del self._pending[te.te_id]
        self._dirty.discard(te.te_id)

    def _state_changed(self, te: _TE) -> None:
        """A TE beats at once when its state changes (as the service does); jobs held for
        an instance retry on the new view."""
        self._report(te)
        for model in self._held:
            self._at(self.now + self.cfg.network_s, "place", model)
        self._schedule_scaler(self.cfg.network_s)

    def _heartbeat(self, _: object) -> None:
        for te_id in list(self._dirty):
            self._report(self._by_id[te_id])
        busy = sum(1 for te in self.tes if te.state != TEState.IDLE)
        self.stats.max_busy_devices = max(self.stats.max_busy_devices, busy)
        for model in self._held:
            self._at(self.now + self.cfg.network_s, "place", model)
        self._at(self.now + self.cfg.heartbeat_s, "heartbeat")

    # -- scaler ---------------------------------------------------------------------------------

    def _demand(self, model: str) -> None:
        self._demands[model] = self.now
        self._schedule_scaler(self.cfg.network_s)

    def _schedule_scaler(self, delay: float | None = None) -> None:
        """The scaler wakes on demand and on view changes, and ticks while it has work."""
        at = self.now + (self.cfg.scaler_period_s if delay is None else delay)
        if self._scaler_at is None or at < self._scaler_at:
            self._scaler_at = at
            self._at(at, "scaler", at)

    def _scaler_tick(self, due: float) -> None:
        if due != self._scaler_at:
            return  # superseded by an earlier tick
        self._scaler_at = None
        cfg = ScalerConfig(keep_alive_s=self.cfg.keep_alive_s)
        view = list(self._view.values())
        for action in decide(view, self._demands, self._pending, now=self.now, cfg=cfg):
            te = self._by_id[action.te_id]
            if isinstance(action, Load) and te.state == TEState.IDLE:
                self._pending[te.te_id] = action.model
                profile = self.profiles[action.model]
                te.state, te.model, te.profile = TEState.LOADING, action.model, profile
                te.epoch += 1
                self._state_changed(te)
                self.stats.loads += 1
                self._at(self.now + self.cfg.network_s + profile.load_s, "loaded", (te, te.epoch))
            elif (
                isinstance(action, Unload)
                and te.state == TEState.READY
                and not (te.running or te.waiting or te.busy)
            ):
                te.state, te.model, te.profile = TEState.IDLE, None, None
                te.epoch += 1
                self._state_changed(te)
                self.stats.unloads += 1
        # Forget demands nothing waits for any more (the service's demand TTL).
        for model, at in list(self._demands.items()):
            if model not in self._held and self.now - at > cfg.demand_ttl_s:
                del self._demands[model]
        if self._held or self._pending or any(te.state == TEState.READY for te in self.tes):
            self._schedule_scaler()

    def _loaded(self, arg: tuple[_TE, int]) -> None:
        te, epoch = arg
        if te.epoch != epoch or te.state != TEState.LOADING:
            return
        assert te.profile is not None
        te.state = TEState.READY
        te.free_blocks = te.profile.kv_blocks
        te.last_active = self.now
        self._state_changed(te)

    # -- engine -------------------------------------------------------------------------------

    def _kick(self, te: _TE, delay: float = 0.0) -> None:
        if not te.busy and (te.running or te.waiting):
            te.busy = True
            self._at(self.now + delay, "iteration", (te, None))

    def _iteration_done(self, arg: tuple[_TE, tuple[dict[_Seq, int], list[_Seq]] | None]) -> None:
        te, batch = arg
        if batch is not None:
            self._finish_iteration(te, *batch)
        te.busy = False
        self._start_iteration(te)

    def _start_iteration(self, te: _TE) -> None:
        prof = te.profile
        if prof is None or not (te.running or te.waiting):
            return
        bs = prof.block_size
        running = [SeqView(str(id(s)), s.num_tokens, s.blocks, s.computed) for s in te.running]
        # The scheduler admits in queue order and stops at the first that does not fit: only
        # the head of the queue can matter (a long queue would make every iteration O(n)).
        head = itertools.islice(te.waiting, prof.max_num_seqs)
        waiting = [SeqView(str(id(s)), s.prompt, 0) for s in head]
        sched = SchedulerConfig(
            block_size=bs,
            max_num_seqs=prof.max_num_seqs,
            max_prefill_tokens=prof.max_prefill_tokens,
            chunked_prefill=prof.chunked_prefill,
        )
        decision = schedule(running, waiting, te.free_blocks, sched)
        if decision.preempt:
            gone = set(decision.preempt)
            for s in [s for s in te.running if str(id(s)) in gone][::-1]:
                te.running.remove(s)
                te.free_blocks += s.blocks
                s.blocks = 0
                s.computed = 0
                s.prompt = s.num_tokens  # recomputed from all its tokens
                te.waiting.appendleft(s)
                self.stats.preemptions += 1
        going_on = set(decision.running)
        ran = [s for s in te.running if str(id(s)) in going_on]
        prefill = [te.waiting.popleft() for _ in range(len(decision.prefill))]
        ctx = 0
        chunks: list[int] = []  # prompt tokens each prefilling request computes now
        cached: list[int] = []  # and those of its prompt computed before
        ends: dict[_Seq, int] = {}
        for s in ran + prefill:
            end = ends[s] = decision.cache_len[str(id(s))]
            need = blocks_for(end, bs) - s.blocks
            s.blocks += need
            te.free_blocks -= need
            if end - s.computed == 1 and s.computed:  # a decode (a new prompt has none)
                ctx += end
            else:
                chunks.append(end - s.computed)
                cached.append(s.computed)
        if not ends:
            return  # nothing fits (a prompt larger than the cache): stays queued
        step = prof.iteration_s(len(ends) - len(chunks), ctx, chunks, cached)
        self.stats.iterations += 1
        te.busy = True
        self._at(self.now + step, "iteration", (te, (ends, prefill)))

    def _finish_iteration(self, te: _TE, ends: dict[_Seq, int], prefill: list[_Seq]) -> None:
        """``ends``: how many tokens each request that ran has in the cache now."""
        arrive = self.now + self.cfg.network_s  # the token reaches the client
        te.last_active = self.now
        for s in prefill:
            te.running.append(s)
        for s, end in ends.items():
            s.computed = end
            if end < s.num_tokens:
                continue  # a prompt chunk: the prompt goes on in the next iteration
            s.generated += 1
            r = s.result
            if r.ttft_s is None:
                r.ttft_s = arrive - EPOCH - r.sent_s
            elif self.cfg.record_gaps:
                r.gaps_s.append(arrive - s.last_token_at)
            s.last_token_at = arrive
            if s.generated >= s.plan.output_tokens:
                te.running.remove(s)
                te.free_blocks += s.blocks
                s.blocks = 0
                r.e2e_s = arrive - EPOCH - r.sent_s
                r.status = 200
                r.prompt_tokens = s.plan.input_tokens
                r.completion_tokens = s.generated
        self._dirty.add(te.te_id)


def simulate(
    planned: Sequence[Planned], profiles: Mapping[str, EngineProfile], cfg: SimConfig
) -> tuple[list[Result], SimStats]:
    sim = Simulation(planned, profiles, cfg)
    results = sim.run()
    return results, sim.stats


def calibrate_emit_s(
    planned: Sequence[Planned],
    profile: EngineProfile,
    cfg: SimConfig,
    target_tpot_s: float,
    *,
    iterations: int = 24,
) -> float:
    """The ``emit_s`` (per streamed token, outside the engine) for which the simulated median
    TPOT of ``planned`` equals ``target_tpot_s``, measured by a replay of the same requests.
    Bisection: the median TPOT grows with ``emit_s``. 0 when the engine alone is slower."""
    from loadgen.stats import percentile

    def tpot(emit_s: float) -> float:
        prof = dataclasses.replace(profile, emit_s=emit_s)
        results, _ = simulate(planned, {p.model: prof for p in planned}, cfg)
        values = [t for r in results if (t := r.tpot_s) is not None]
        return percentile(values, 50) if values else 0.0

    lo, hi = 0.0, max(target_tpot_s, 1e-4)
    if tpot(lo) >= target_tpot_s:
        return 0.0
    while tpot(hi) < target_tpot_s and hi < 10.0:
        hi *= 2
    for _ in range(iterations):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tpot(mid) < target_tpot_s else (lo, mid)
    return (lo + hi) / 2
