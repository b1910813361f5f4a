"""A discrete-event simulation of a meshserve cluster, driven by the project's own policies.

The point: judge a scheduling or scaling policy on a fleet far larger than this machine, on
real traces. The decisions come from the modules the services run, called with the same
kind of state they see in production:
- admission: the JE's ``services.job_executor.admission.shed`` on each new request (a 503
  at once when every ready instance's queue is full and no capacity is coming), with the
  JE's moving mean of output tokens;
- placement: the JE's ``services.job_executor.holding.next_step`` (place, hold, give up)
  over the cluster view (``services.views.TEView``, stale by up to one heartbeat interval)
  corrected by the JE's ``ledger.PlacementLedger`` (each placement counted until the TE
  says it ended, as the JE does; here the notices arrive at once); a job nobody can take is held
  and placed on the view that shows an instance ready, and fails after the placement
  timeout as a 503 would;
- scaling: ``services.scaler.state`` — ``observe_traffic`` (the JE's reports every
  ``report_s``, at once when a held job has no instance coming), ``observe_outcomes`` (the
  frontend's SLO counts, from ``services.frontend.outcomes``), ``observe_view`` — and
  ``services.scaler.policy.decide`` (scale out and in per model on load, drain before
  unload, scale to zero after the keep-alive, placement across pools), with the state the
  scaler service keeps;
- iterations: the torch engine's ``scheduler.schedule`` (continuous batching, admission by
  KV blocks and prefill budget, preemption by recompute).

Only the engines are replaced, by a profiled cost model (``costmodel.EngineProfile``): how
long an iteration takes for its decodes and prefills, how long a model takes to load, how
many KV blocks the engine has. Network hops cost ``network_s`` each.

- routing: the JE's ``services.job_executor.routing`` policy (``SimConfig.routing``) over
  each TE's cached prefix of the prompt, which the simulator knows exactly (a precise index);
- prefix caching: each instance keeps an LRU of the trace's chained block keys
  (``loadgen.prefix_sim``) as large as its KV cache; a request admitted with a cached
  prefix prefills only the rest (the scheduler sees it as the engine shows it);
- host weight caches: each node pool has one (``SimConfig.host_cache_bytes``; 0: off),
  modelled one entry per model (``loadgen.weight_cache_sim``: the simulated models share no
  tensors), evicted by the real ``eviction.choose_victims``, never an entry a TE of the
  pool has loading, ready or draining. A load maps the weights where its pool's cache holds
  them (``EngineProfile.cached_load_s``), forks them where the scaler's ``Load`` names
  another pool's weight server (``fork_source``; bytes over ``fork_bandwidth``, then
  mapped), else reads the checkpoint (``load_s``); what it forked or read is stored after
  it. TEs report their pool's cache in their views (``cached_weights``,
  ``cache_free_bytes``, ``weight_server``), refreshed with the next heartbeat after it
  changes, so ``placement_order`` weighs ``load_time`` as in production. Each scaler tick
  runs the real ``preload.preloads`` as the service does (the views less the TEs its
  decision took, the same ``tried`` memory); the TE pre-loading is ``PRELOADING`` for as
  long as a load from the same source takes, then stores the model and is idle again. Its
  time counts in ``SimStats.preload_seconds``, not in ``instance_seconds`` (no engine).

- PD disaggregation: the JE's ``disaggregation.decide`` after routing picked the decode
  instance (prefill-role TEs take no whole requests, as in the JE), and
  ``PdDecision.wanted`` for the traffic report the scaler sizes prefill instances by
  (``SimConfig.max_prefill_replicas``; the scaler's ``Load.role``). A disaggregated request
  runs its prompt on the prefill TE (scheduled like any prompt there, first token
  included); its KV (the tokens the decode TE lacks, ``EngineProfile.kv_bytes_per_token``
  each) streams layer by layer during that prefill, so it lands at the later of the prefill's
  end and its start plus the bytes over ``kv_bandwidth``, plus one hop; each TE's link
  carries one transfer at a time (a transfer waits for both ends' links to be free). The
  prefill TE holds the blocks until then (its lease). The decode TE then admits the request like any other
  (its blocks from the free pool, only the token after the prompt to compute), and the
  first chunk the client gets carries the prefill's token and the first decoded one, as the
  TE sends them.

- many instances per device (LLM-Mesh): ``SimConfig.slots_per_device`` instances share each
  device, taking turns ordered by the device arbiter's ``shared.headroom.next_turn`` (or
  first come, or time-sliced as uncoordinated processes are); with ``SimConfig.shadow`` a
  placement is first validated by the TE's ``services.job_executor.shadow.validate`` on its
  device (each profile as a performance model: ``EngineProfile.perf_model``), a refusal
  tries another instance and, when every ready instance refused and nothing is coming, is a
  503 (``admission.device_busy``). ``gpu_devices`` of the fleet run each model's GPU
  profile; the scaler places new instances on CPUs first where the model's CPU instances
  meet the SLO (``scaler.pools.placement_order``). With ``SimConfig.kv_sizing`` each
  instance's KV pool follows its requests as a TE's does (``kv_pool.KvPool`` over the
  simulated blocks, after each iteration and at each heartbeat while idle) within its
  device's whole cache, the device's books kept by ``kv_sizing.make_room`` as its arbiter
  keeps them: grows in order, the others squeezed while one waits, a load waiting up to
  ``kv_room_wait_s`` for its pool's floor before it fails; a TE's reported KV room counts
  what its pool could still grow into. Else each instance holds an even share. With
  ``SimConfig.kv_preemption`` too, a grow that has waited a second, every other pool
  squeezed, may preempt a smaller neighbour (``kv_sizing.preemption``: each of its
  requests validated on an instance of its model on another device, as the devices stand):
  its requests move there, recomputed, and it unloads.

Not modelled yet (they grow with the policy issues): TE failures (so no PD fallbacks);
multicast loads (``plan_multicasts`` needs relay addresses, which the simulated TEs do not
report, so scale-outs fork one by one); a host cache holding part of a model (a real store
keeps the tensors that fit; here a model is cached whole or not at all); the store after a
load taking time (here the weights are cached the moment the load is done).
``instant_loads`` gives λScale's ideal: the same policy with instances that are ready the
moment they are asked for (``simulate --compare-ideal``); it turns host caches off.

Results are ``loadgen.results.Result`` objects, so a simulated run is summarised, plotted
and compared exactly like a replayed one.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from loadgen.costmodel import EngineProfile
from loadgen.fleet import FleetTimeline
from loadgen.plan import Planned
from loadgen.prefix_sim import PrefixLRU, chain_keys
from loadgen.results import Result
from loadgen.stats import summary as latency_summary
from loadgen.weight_cache_sim import HostCacheModel
from services.frontend.outcomes import Outcomes
from services.job_executor.admission import (
    INITIAL_MEAN_OUTPUT_TOKENS,
    device_busy,
    mean_output_tokens,
    shed,
)
from services.job_executor.disaggregation import Demand, PdConfig, decide, prefill_instances
from services.job_executor.holding import GiveUp, Hold, PendingJob, next_step
from services.job_executor.ledger import PlacementLedger
from services.job_executor.output_length import OutputPredictor
from services.job_executor.placement import Request
from services.job_executor.routing import DEFAULT_ROUTING, RoutingConfig, spread_of
from services.job_executor.shadow import InstanceView, Verdict, validate
from services.job_executor.traffic import RateMeter, TrafficLedger
from services.scaler.config import scaler_config
from services.scaler.policy import Load, Unload
from services.scaler.state import (
    ScalerConfig,
    ScalerState,
    observe_capacity,
    observe_outcomes,
    observe_traffic,
)
from services.scaler.tick import tick
from services.task_executor.engines.torch_engine.scheduler import (
    SchedulerConfig,
    SeqView,
    admission_head,
    blocks_for,
    enqueue,
    pacing,
    queue_due,
    schedule,
    tpot_slack,
)
from services.task_executor.kv_pool import KvPool, floor_blocks
from services.task_executor.kv_sizing import (
    PREEMPT_AFTER_S,
    DeviceOp,
    Neighbour,
    elsewhere,
    make_room,
    preemption,
)
from services.task_executor.weight_cache.eviction import EvictionConfig
from services.views import TEView, queued_import_tokens, queued_prompt_tokens, remember_model
from shared.headroom import RequestView, earliest_deadline, next_turn, request_view, urgency
from shared.messages.cluster import JobShare, TEState
from shared.messages.tasks import TaskMode
from shared.perf_model import PerfModel
from shared.settings import ModelScaling, Settings
from shared.slo import SLO

# Policies compare times with unix-like clocks (a demand at 0.0 means "never"): the
# simulated clock starts far from zero.
EPOCH = 1_000_000.0
JE_ID = "je-sim"  # the one simulated job executor
# How the instances on one device share it (``SimConfig.sharing``).
Sharing = Literal["uncoordinated", "fifo", "headroom"]
SHARING: tuple[Sharing, ...] = ("uncoordinated", "fifo", "headroom")


@dataclasses.dataclass(frozen=True, slots=True)
class SimConfig:
    devices: int = 4  # each holds ``slots_per_device`` TEs, each serving one model at a time
    pool_size: int = 4  # TEs per node pool
    heartbeat_s: float = 1.0
    keep_alive_s: float = 60.0
    min_replicas: int = 0
    max_replicas: int = 8
    target_utilization: float = 0.7
    stable_window_s: float = 60.0
    panic_window_s: float = 6.0
    placement_timeout_s: float = 60.0
    network_s: float = 0.0005  # one hop: frontend->JE->TE placement, TE->frontend tokens
    scaler_period_s: float = 0.5  # the scaler's tick while it has work
    report_s: float = 0.5  # the JE's traffic reports; the frontend reports outcomes each 1 s
    slo: SLO = dataclasses.field(
        default_factory=SLO
    )  # what the frontend counts as met, for the scaler
    instant_loads: bool = False  # λScale's ideal: an instance is ready the moment it is asked
    record_gaps: bool = True  # keep every inter-token gap (memory: 8 bytes per token)
    routing: RoutingConfig = DEFAULT_ROUTING
    prefix_caching: bool = True  # instances reuse the K/V of prompt prefixes they computed
    # admission control (the JE's MESHSERVE_MAX_QUEUED_PER_SLOT): 0 never refuses
    max_queued_per_slot: int = 4
    # Each node pool's host weight cache, bytes (0: off). The real default is a quarter of
    # the host's memory: here, of a 128 GiB host.
    host_cache_bytes: int = 32 << 30
    load_bandwidth: float = 1.0e9  # MESHSERVE_HOST_CACHE_LOAD_BANDWIDTH: t_load, eviction cost
    cache_horizon_s: float = 600.0  # MESHSERVE_HOST_CACHE_HORIZON: eviction's look ahead
    fork_bandwidth: float = 1.25e9  # bytes/s a fork receives from another pool (10 Gb/s)
    preload_window_s: float = 600.0  # MESHSERVE_PRELOAD_WINDOW (0: no pre-loads)
    slo_target: float = 0.95  # MESHSERVE_SLO_TARGET
    # MESHSERVE_MODEL_SCALING: per-model bounds over the defaults above
    model_scaling: Mapping[str, ModelScaling] = dataclasses.field(default_factory=dict)
    # PD disaggregation: the JE's rule (MESHSERVE_PD*), the scaler's prefill instances
    # (MESHSERVE_MAX_PREFILL_REPLICAS; 0: none, so no request is disaggregated), and the
    # bytes/s a decode TE pulls a prefill TE's KV at (10 Gb/s TCP; shared memory is faster).
    pd: PdConfig = dataclasses.field(default_factory=PdConfig)
    max_prefill_replicas: int = 0
    kv_bandwidth: float = 1.25e9
    # Many instances per device (LLM-Mesh): a device holds up to ``slots_per_device``
    # instances at once (a TE each, the device's KV cache split evenly among them), and they
    # share it as ``sharing`` says: "uncoordinated" (processes the OS time-slices: an
    # iteration takes as many times longer as the device has instances with work), "fifo"
    # (one iteration at a time, in the order the instances asked for their turn) or
    # "headroom" (one at a time, the earliest deadline first: ``shared.headroom.next_turn``,
    # as the device arbiter grants turns). ``shadow``: the JE validates each placement
    # against the device's next iterations (``services.job_executor.shadow.validate``) and
    # tries another instance, holds the request, or refuses it (``admission.device_busy``).
    slots_per_device: int = 1
    sharing: Sharing = "headroom"
    shadow: bool = False
    # KV sized by demand (MESHSERVE_KV_SIZING with a device budget, LLM-Mesh): each
    # instance's pool follows the requests it holds (``kv_pool.KvPool``, as a TE sizes it,
    # ``kv_shrink_after_s`` its lazy shrink) within its device's whole KV cache, the device's
    # books kept as its arbiter keeps them (``kv_sizing.make_room``: grows in order, the
    # others told to shrink while one waits). Off: each instance holds an even share.
    kv_sizing: bool = False
    kv_shrink_after_s: float = 30.0
    kv_room_wait_s: float = 30.0  # MESHSERVE_KV_ROOM_WAIT: a load's wait for its pool's floor
    # A grow that waits may preempt a smaller neighbour whose requests pass shadow
    # validation elsewhere (``kv_sizing.preemption``)
    kv_preemption: bool = False
    # Of ``devices``, the last ``gpu_devices`` are GPUs: instances there run their model's
    # GPU profile (``Simulation(gpu_profiles=...)``), in node pools of their own.
    gpu_devices: int = 0
    # How long a late prompt waits behind those in time (None: MESHSERVE_LATE_YIELD's default).
    late_yield_s: float | None = None

    def settings(self) -> Settings:
        """The simulated cluster's settings, as far as they decide anything: the scaler
        service builds its policy's configuration from these (``scaler_config``)."""
        return Settings.load(
            {},
            scaler={
                "keep_alive": self.keep_alive_s,
                "min_replicas": self.min_replicas,
                "max_replicas": self.max_replicas,
                "target_utilization": self.target_utilization,
                "model_scaling": dict(self.model_scaling),
                "stable_window": self.stable_window_s,
                "panic_window": self.panic_window_s,
                "preload_window": self.preload_window_s,
                "slo_ttft": self.slo.ttft_s,
                "slo_ttft_per_token": self.slo.ttft_per_input_token_s,
                "slo_tpot": self.slo.tpot_s,
                "slo_target": self.slo_target,
                "max_prefill_replicas": self.max_prefill_replicas,
            },
            host_cache={"load_bandwidth": self.load_bandwidth},
            torch={} if self.late_yield_s is None else {"late_yield": self.late_yield_s},
        )

    def scaler_config(self) -> ScalerConfig:
        return scaler_config(self.settings())

    def eviction_config(self) -> EvictionConfig:
        """As ``HostWeightCache.from_settings`` builds it."""
        return EvictionConfig(self.load_bandwidth, self.cache_horizon_s)

    @property
    def host_cache(self) -> bool:
        """Pools keep weights (instant loads need none: the cache is off for them)."""
        return self.host_cache_bytes > 0 and not self.instant_loads


@dataclasses.dataclass(slots=True)
class SimStats:
    events: int = 0
    iterations: int = 0
    loads: int = 0
    unloads: int = 0
    preemptions: int = 0
    timeouts: int = 0
    shed: int = 0  # refused at once by admission control
    max_busy_devices: int = 0
    peak_replicas: dict[str, int] = dataclasses.field(default_factory=dict)
    # TEs loading, serving or draining a model, until the replay's last request ended (the
    # horizon every fleet is measured over: an always-on fleet's instances run on past it
    # too, uncounted); after it, the instances that wait out their keep-alive.
    instance_seconds: float = 0.0
    tail_instance_seconds: float = 0.0
    held: int = 0  # requests that waited for an instance
    held_wait_s: float = 0.0  # their waits, summed
    prompt_tokens: int = 0  # of requests placed
    matched_tokens: int = 0  # at placement, the cached prefix of the instance chosen
    oracle_tokens: int = 0  # at placement, the longest cached prefix any instance held
    cached_tokens: int = 0  # at first admission, what the instance's cache still held
    routed: dict[str, int] = dataclasses.field(default_factory=dict)  # by routing branch
    # Host weight caches: where each load's weights came from (cache: mapped; fork: from
    # another pool's cache; disk: the checkpoint; instant: instant_loads), pre-loads, and
    # what eviction took.
    loads_by_source: dict[str, int] = dataclasses.field(default_factory=dict)
    preloads_sent: int = 0
    preloads_done: int = 0
    preload_seconds: float = 0.0  # TEs pre-loading (not in instance_seconds: no engine)
    evictions: int = 0
    evicted_bytes: int = 0
    uncached_loads: int = 0  # loads and pre-loads whose weights found no room in the cache
    # Requests that arrived while their model had no instance ready (at zero, or its first
    # instance still loading): how many, and their TTFT percentiles (seconds).
    cold_requests: int = 0
    cold_ttft_s: dict[str, float] = dataclasses.field(default_factory=dict)
    # PD: requests whose prompt ran on a prefill instance, why each placement went the way
    # it did (where the model had prefill instances), and the KV bytes moved.
    disaggregated: int = 0
    pd_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    kv_bytes: int = 0
    prefill_loads: int = 0
    # Shared devices: iterations granted as turns, those granted to an instance whose most
    # urgent request was already late, placements shadow validation refused (by reason),
    # and requests refused because every instance's device was too busy.
    turns: int = 0
    late_turns: int = 0
    shadow_refused: dict[str, int] = dataclasses.field(default_factory=dict)
    device_busy: int = 0
    # KV sized by demand: instances told to shrink, another of their device waiting to grow;
    # loads that waited for room for their pool's floor, and those that failed for want of it
    kv_squeezes: int = 0
    kv_load_waits: int = 0
    kv_load_failures: int = 0
    # ... and neighbours preempted for a grow that waited, their requests moved elsewhere
    kv_preemptions: int = 0
    kv_moved: int = 0
    # The control plane's work (loadgen/control_plane.py): the JE's placement steps (each
    # try, held requests' retries too) and the wall time the decision functions took here,
    # and the changes of TE state that make the cluster manager push a view; by second of
    # simulated time.
    placements: int = 0
    placement_wall_s: float = 0.0
    placements_by_s: dict[int, int] = dataclasses.field(default_factory=dict)
    view_changes: int = 0
    view_changes_by_s: dict[int, int] = dataclasses.field(default_factory=dict)

    @property
    def weight_cache_hit_rate(self) -> float:
        """Loads that mapped their weights from their pool's host cache."""
        return self.loads_by_source.get("cache", 0) / self.loads if self.loads else 0.0

    @property
    def hit_rate(self) -> float:
        """Prompt tokens the engines took from their prefix caches."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def matched_rate(self) -> float:
        """Prompt tokens the chosen instances held when the router chose them."""
        return self.matched_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def oracle_hit_rate(self) -> float:
        """The same for a router that always picks the instance holding the most: compare
        with ``matched_rate`` (both at placement, on the same caches)."""
        return self.oracle_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclasses.dataclass(slots=True, eq=False)
class _Seq:
    plan: Planned
    result: Result
    prompt: int  # tokens to prefill (prompt, plus outputs when recomputed after preemption)
    generated: int = 0
    blocks: int = 0
    computed: int = 0  # tokens whose K/V the cache holds (a chunked prompt's, mid-way)
    last_token_at: float = 0.0
    first_token_at: float = 0.0
    held_at: float | None = None
    job: PendingJob | None = None
    keys: tuple[int, ...] = ()  # chained keys of the trace's shared prompt blocks
    shared_blocks: int = 0  # of blocks, those it shares from the prefix cache
    matched: int = 0  # the cached prefix the router expected where it placed it
    placed: bool = False  # routed once (a later placement is a retry: not counted again)
    admitted: bool = False  # admitted to an engine once (a later one recomputes)
    placement: int = 0  # its TE's number for it (TaskAccepted.seq)
    due: float = math.inf  # when its first token is due at its TE (the TTFT target)
    # PD. A prefill task: the request it prefills for, and that request's decode TE.
    kv_for: _Seq | None = None
    decode_te: _TE | None = None
    started_at: float = 0.0  # a prefill task: admitted (its KV starts streaming)
    # A request whose prompt KV came from a prefill TE, until its decode TE admits it.
    imported: bool = False
    import_tokens: int = 0  # PD, on its decode TE: prompt tokens whose KV is on its way
    busy: frozenset[str] = frozenset()  # TEs whose shadow validation refused it (this view)

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
    since: float = EPOCH  # when it left IDLE (instance-seconds)
    recent_models: tuple[str, ...] = ()
    cache: PrefixLRU | None = None  # its prefix cache, while a model is loaded
    host: HostCacheModel | None = None  # its node pool's host weight cache
    weight_server: str = ""  # its pool's weight server ("" without a host cache)
    weights: str = ""  # where the weights of its load or pre-load come from
    preloading: str | None = None  # the model it pre-loads
    placements: int = 0  # tasks it took (TaskAccepted.seq of the last)
    role: TaskMode = TaskMode.COLOCATED  # what it loaded its model as (LoadModel.role)
    transfers: int = 0  # PD, a prefill TE: KV it holds until a decode TE has pulled it
    incoming: list[_Seq] = dataclasses.field(default_factory=list)  # PD, decode: KV due
    link_free_at: float = 0.0  # PD: when its KV link is done with the transfers it carries
    device: str = ""  # the device it shares with the other TEs there
    kind: str = "cpu"  # that device's kind: "cpu" or "gpu"
    kv: KvPool | None = None  # its KV pool sized by demand (SimConfig.kv_sizing)
    pool_blocks: int = 0  # the blocks its KV pool holds (free_blocks of them unused)
    kv_room: float = math.inf  # bytes of KV its device's books let it hold now
    squeeze_left: bool = False  # told to shrink and held back by blocks in use
    load_s: float = 0.0  # how long its load takes (after the room for its KV, if it waits)
    books: _Device | None = None  # its device, whose books its KV pool grows within

    def growable_blocks(self) -> int:
        """Blocks its pool could still grow by: up to the device's whole cache, as far as
        the device's books have room (``TEHeartbeat.growable_kv_blocks``; each TE of the
        device counts the same free memory, as a TE reports it)."""
        if self.kv is None or self.books is None or self.profile is None:
            return 0
        bb = self.kv.engine.kv_block_bytes
        free = (
            max(0, self.books.kv_free_bytes()) // bb
            if self.books.kv_budget
            else self.profile.kv_blocks
        )
        return max(0, min(self.profile.kv_blocks - self.pool_blocks, free))

    def cached_prefix(self, seq: _Seq, *, touch: bool = False) -> int:
        """Prompt tokens of ``seq`` this instance holds: whole engine blocks, never the whole
        prompt (its last token is computed to sample from)."""
        if self.cache is None or not seq.keys or self.profile is None:
            return 0
        tokens = self.cache.match(seq.keys, touch=touch) * seq.plan.block_size
        bs = self.profile.block_size
        return min(tokens, seq.prompt - 1) // bs * bs

    def view(self, now: float) -> TEView:
        profile = self.profile if self.state == TEState.READY else None
        share = self.share()
        return TEView(
            te_id=self.te_id,
            pool_id=self.pool_id,
            state=self.state,
            model=self.model,
            running=len(self.running),
            waiting=len(self.waiting),
            # as a TE counts it: prompts not started or still prefilling, less the prefix the
            # router expected cached (all of them placed by the one JE)
            queued_prompt_tokens=queued_prompt_tokens({JE_ID: share}),
            queued_import_tokens=queued_import_tokens({JE_ID: share}),
            last_active=self.last_active,
            reported_at=now,
            recent_models=self.recent_models,
            weight_server=self.weight_server,
            cached_weights=self.host.residencies() if self.host is not None else {},
            cache_free_bytes=self.host.free_bytes() if self.host is not None else 0,
            # what a ready TE reports, and admission sizes its queue by
            capacity=profile.capacity() if profile is not None else None,
            shares={JE_ID: share} if share.sequences else {},
            placements=self.placements,
            role=self.role,
            kv_address=f"{self.te_id}:kv" if profile and self.role == TaskMode.PREFILL else "",
            kv_import=profile is not None and profile.kv_bytes_per_token > 0,
            device="cuda" if self.kind == "gpu" else "cpu",
            # as a TE reports it: its pool's free blocks, and those it could still grow by
            kv_free_tokens=(self.free_blocks + self.growable_blocks()) * profile.block_size
            if profile
            else None,
            # as a TE under a device KV budget reports it (idle or not), and its pool's floor
            device_kv_free_bytes=max(0, self.books.kv_free_bytes())
            if self.books is not None and self.books.kv_budget
            else None,
            kv_floor_bytes=_floor_bytes(profile) if profile and self.kv is not None else 0,
        )

    def share(self) -> JobShare:
        """Its work, all placed by the one simulated JE (``TEHeartbeat.shares``)."""
        seqs = list(itertools.chain(self.waiting, self.running, self.incoming))
        return JobShare(
            sequences=len(seqs),
            decoding=sum(1 for s in seqs if s.generated),
            prefill_tokens=sum(s.prompt - s.matched for s in seqs if not s.generated),
            import_tokens=sum(s.import_tokens for s in seqs if not s.generated),
            oldest=min((s.placement for s in seqs), default=0),
        )


@dataclasses.dataclass(slots=True, eq=False)
class _Device:
    """One device and the instances on it (``SimConfig.slots_per_device`` TEs)."""

    device_id: str
    tes: list[_TE] = dataclasses.field(default_factory=list)
    active: _TE | None = None  # turns: the instance whose iteration runs
    wanting: dict[_TE, float] = dataclasses.field(default_factory=dict)  # asked at
    # KV sized by demand: its books, as its arbiter keeps them (bytes, by TE id)
    kv_budget: int = 0  # the whole KV cache of the device (0: not known yet)
    holds: dict[str, int] = dataclasses.field(default_factory=dict)
    reserved: dict[str, int] = dataclasses.field(default_factory=dict)
    needs: dict[str, DeviceOp] = dataclasses.field(default_factory=dict)
    squeezed: set[str] = dataclasses.field(default_factory=set)
    need_since: dict[str, float] = dataclasses.field(default_factory=dict)  # a grow waiting
    preempt_after: float = 0.0  # when it may next look for a neighbour to preempt

    def kv_used_bytes(self) -> int:
        """What its books gave the pools: held and granted."""
        return sum(self.holds.values()) + sum(self.reserved.values())

    def kv_free_bytes(self) -> int:
        """What its books have not given any pool."""
        return self.kv_budget - self.kv_used_bytes()


def _block_bytes(profile: EngineProfile) -> int:
    """Memory one KV block of ``profile`` takes (every layer's K and V)."""
    return profile.block_size * max(1, profile.kv_bytes_per_token)


def _floor_bytes(profile: EngineProfile) -> int:
    """What a load's KV pool of ``profile`` waits for room for (``factory.kv_floor_bytes``)."""
    blocks = floor_blocks(profile.max_model_len, profile.block_size, profile.kv_blocks)
    return blocks * _block_bytes(profile)


class _KvOf:
    """A simulated TE's KV pool as ``KvPool`` resizes an engine's (``KvResizer``): never
    below the blocks its requests use, never above the device's whole cache."""

    def __init__(self, te: _TE, profile: EngineProfile) -> None:
        self.te = te
        self.block_size = profile.block_size
        self._block_bytes = _block_bytes(profile)
        self._most = profile.kv_blocks

    @property
    def kv_blocks(self) -> tuple[int, int]:
        return self.te.pool_blocks, self._most

    @property
    def kv_block_bytes(self) -> int:
        return self._block_bytes

    def resize_kv(self, blocks: int) -> int:
        te = self.te
        size = min(max(blocks, te.pool_blocks - te.free_blocks), self._most)
        te.free_blocks += size - te.pool_blocks
        te.pool_blocks = size
        return size


class Simulation:
    def __init__(
        self,
        planned: Sequence[Planned],
        profiles: Mapping[str, EngineProfile],
        cfg: SimConfig,
        gpu_profiles: Mapping[str, EngineProfile] | None = None,
        *,
        fleet: FleetTimeline | None = None,
    ) -> None:
        models = {p.model for p in planned}
        missing = sorted(models - set(profiles))
        if missing:
            raise ValueError(f"no engine profile for model(s) {missing}")
        gpus = min(max(cfg.gpu_devices, 0), cfg.devices)
        gpu_missing = sorted(models - set(gpu_profiles or {})) if gpus else []
        if gpu_missing:
            raise ValueError(f"no GPU engine profile for model(s) {gpu_missing}")
        self.cfg = cfg
        self.profiles = profiles
        self.gpu_profiles = gpu_profiles or {}
        self.planned = sorted(planned, key=lambda p: p.arrival_s)
        self.stats = SimStats()
        self._fleet = fleet
        self._slots = max(1, cfg.slots_per_device)
        self._turn_taking = self._slots > 1 and cfg.sharing != "uncoordinated"
        self.tes: list[_TE] = []
        self._devices: dict[str, _Device] = {}
        per_kind = {"cpu": 0, "gpu": 0}
        for d in range(cfg.devices):
            kind = "gpu" if d >= cfg.devices - gpus else "cpu"
            device = self._devices[f"dev-{d:05d}"] = _Device(f"dev-{d:05d}")
            for _ in range(self._slots):
                n, per_kind[kind] = per_kind[kind], per_kind[kind] + 1
                pool = f"{'gpu-' if kind == 'gpu' else ''}pool-{n // max(cfg.pool_size, 1):04d}"
                te = _TE(te_id=f"te-{len(self.tes):05d}", pool_id=pool)
                te.device, te.kind, te.books = device.device_id, kind, device
                device.tes.append(te)
                self.tes.append(te)
        self._perf: dict[int, tuple[EngineProfile, PerfModel]] = {}  # id(profile): its model
        self._by_id = {te.te_id: te for te in self.tes}
        self._pools: dict[str, list[_TE]] = {}
        for te in self.tes:
            self._pools.setdefault(te.pool_id, []).append(te)
        self._hosts: dict[str, HostCacheModel] = {}  # by weight server
        if cfg.host_cache:
            eviction = cfg.eviction_config()
            for pool_id, tes in self._pools.items():
                host = HostCacheModel(cfg.host_cache_bytes, eviction)
                server = f"{pool_id}:7070"
                self._hosts[server] = host
                for te in tes:
                    te.host, te.weight_server = host, server
        self.now = EPOCH
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self._queued = 0  # events other than heartbeats
        # What the policies see: the last report of each TE, refreshed every interval.
        self._view: dict[str, TEView] = {te.te_id: te.view(EPOCH) for te in self.tes}
        self._by_model: dict[str, set[str]] = {}  # model -> TEs whose view names it
        self._ledger = PlacementLedger(JE_ID)  # the JE's count of what the views do not show
        self._mean_output = INITIAL_MEAN_OUTPUT_TOKENS  # the JE's, for admission
        self._dirty: set[str] = set()  # TEs whose state changed since the last report
        self._held: dict[str, list[_Seq]] = {}  # model -> jobs waiting for an instance
        # The scaler: its memory, as the service keeps it; the JE's and frontend's reports.
        settings = cfg.settings()
        self._scfg = scaler_config(settings)
        self._late_yield_s = settings.torch.late_yield.total_seconds()
        self._scaler = ScalerState()
        for model in sorted({p.model for p in planned}):
            self._scaler = observe_capacity(self._scaler, model, profiles[model].capacity())
        self._traffic = TrafficLedger()  # the JE's, since its last report
        # The JE's PD rule (the CLI builds it from the settings: ``pd_config``), its
        # output-length predictor and arrival rates (what a heat map's cell needs).
        self._pd = cfg.pd
        self._outputs = OutputPredictor()
        self._rates = RateMeter()
        self._outcomes = Outcomes(cfg.slo)
        # As a TE paces its engine: with the capacity it measured and the SLO's TPOT.
        self._pacing = {
            (kind, m): pacing(
                p.capacity(),
                tpot_s=cfg.slo.tpot_s,
                ceiling=p.max_prefill_tokens,
                ttft_s=cfg.slo.ttft_s,
                ttft_per_token_s=cfg.slo.ttft_per_input_token_s,
            )
            for kind, by_model in (("cpu", profiles), ("gpu", self.gpu_profiles))
            for m, p in by_model.items()
            if p.paced
        }
        self._reports_due = False
        self._round_robin = 0
        self._scaler_at: float | None = None  # when the next scaler tick is due
        self._models = sorted({p.model for p in planned})
        self._preloaded: dict[tuple[str, str], float] = {}  # (model, pool) -> sent at
        self._ready: dict[str, int] = {}  # model -> instances ready (truth, not the view)
        self._cold: list[Result] = []  # requests that found no instance of their model ready
        self.results: list[Result] = []
        self._spans: list[tuple[float, float]] = []  # (since, until) a TE held a model

    # -- event queue ----------------------------------------------------------------------

    def _at(self, t: float, kind: str, arg: object = None) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, arg))
        self._queued += kind not in ("heartbeat", "report")

    def run(self) -> list[Result]:
        for p in self.planned:
            self._at(EPOCH + p.arrival_s, "arrive", p)
        self._at(EPOCH + self.cfg.heartbeat_s, "heartbeat")
        self._at(EPOCH + self.cfg.report_s, "report")
        handlers: dict[str, Callable[[Any], None]] = {
            "arrive": self._arrive,
            "place": self._place_held,
            "iteration": self._iteration_done,
            "loaded": self._loaded,
            "preloaded": self._preloaded_done,
            "heartbeat": self._heartbeat,
            "report": self._report_traffic,
            "scaler": self._scaler_tick,
            "expire": self._expire,
            "kv_done": self._kv_done,
            "kv_room_timeout": self._kv_room_timeout,
        }
        while self._events:
            t, _, kind, arg = heapq.heappop(self._events)
            if kind in ("heartbeat", "report"):
                if not self._queued and not self._busy():
                    continue  # only periodic events left and nothing can change any more
            else:
                self._queued -= 1
            self.now = t
            self.stats.events += 1
            handlers[kind](arg)
        if self._fleet is not None:
            self._fleet.close(self.now - EPOCH)
        for te in self.tes:
            if te.state == TEState.PRELOADING:
                self.stats.preload_seconds += self.now - te.since
            elif te.state != TEState.IDLE:
                self._spans.append((te.since, self.now))
        end = EPOCH + max((r.sent_s + (r.e2e_s or 0.0) for r in self.results), default=0.0)
        for since, until in self._spans:
            self.stats.instance_seconds += max(min(until, end) - since, 0.0)
            self.stats.tail_instance_seconds += max(until - max(since, end), 0.0)
        self.stats.cold_requests = len(self._cold)
        self.stats.cold_ttft_s = latency_summary(
            [r.ttft_s for r in self._cold if r.ttft_s is not None]
        )
        self.results.sort(key=lambda r: r.index)
        return self.results

    def _busy(self) -> bool:
        """Instances still up: the periodic events go on until they scale to min_replicas."""
        up = sum(1 for te in self.tes if te.state != TEState.IDLE)
        floor = 0
        for model in self._models:
            own = self.cfg.model_scaling.get(model)
            least = own.min_replicas if own is not None else None
            floor += self.cfg.min_replicas if least is None else least
        return up > floor

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
        if not self._ready.get(p.model):
            self._cold.append(result)
        seq = _Seq(plan=p, result=result, prompt=p.input_tokens)
        if self.cfg.prefix_caching and p.hash_ids and p.block_size:
            seq.keys = chain_keys(p.hash_ids[: p.input_tokens // p.block_size])
        seq.job = PendingJob(model=p.model, deadline=self.now + self.cfg.placement_timeout_s)
        self._traffic.arrived(p.model, p.input_tokens, p.output_tokens)
        self._rates.arrived(p.model, self.now)
        self._reports_due = True
        self._mean_output = mean_output_tokens(self._mean_output, p.output_tokens)
        verdict = shed(
            p.model,
            self._view.values(),
            self._ledger.unreported,
            max_queued_per_slot=self.cfg.max_queued_per_slot,
            mean_output_tokens=self._mean_output,
        )
        if verdict is not None:  # the JE's admission control: 503 at once
            self._refuse(seq, "overloaded: every instance is saturated")
            self.stats.shed += 1
            self._schedule_scaler(self.cfg.network_s, urgent=True)
            return
        if not self._try_place(seq):
            self._held.setdefault(p.model, []).append(seq)
            seq.held_at = self.now
            self._traffic.held(p.model, p.input_tokens)
            self._reports_due = True
            self.stats.held += 1
            self._at(seq.job.deadline, "expire", seq)

    def _try_place(self, seq: _Seq) -> bool:
        """The JE's step (``holding.next_step``) on the view it has: True when the job left
        its hands (placed, or refused at once), False when it is held."""
        t0 = time.perf_counter()
        try:
            return self._place_step(seq)
        finally:
            st = self.stats
            st.placements += 1
            st.placement_wall_s += time.perf_counter() - t0
            second = int(self.now - EPOCH)
            st.placements_by_s[second] = st.placements_by_s.get(second, 0) + 1

    def _place_step(self, seq: _Seq) -> bool:
        model = seq.plan.model
        assert seq.job is not None
        every = [self._view[t] for t in self._by_model.get(model, ())]
        # Prefill instances take prefill tasks only: routing and admission see the rest.
        tes = [v for v in every if v.role != TaskMode.PREFILL]
        cached = {
            v.te_id: c
            for v in tes
            if v.state == TEState.READY and (c := self._by_id[v.te_id].cached_prefix(seq))
        }
        self._round_robin += 1
        request = Request(
            prompt_tokens=seq.prompt,
            cached_tokens=cached,
            spread=spread_of(self.cfg.routing, self._round_robin, seq.plan.key),
            ttft_left_s=EPOCH
            + seq.result.sent_s
            + self.cfg.slo.ttft_limit_s(seq.plan.input_tokens)
            - self.now,
        )
        step = next_step(
            seq.job,
            tes,
            self._ledger.unreported,
            now=self.now,
            request=request,
            routing=self.cfg.routing,
        )
        if isinstance(step, Hold):
            if seq.busy and device_busy(model, list(self._view.values()), seq.busy):
                # Every instance's device refused it and no capacity is coming: a 503 now.
                self.stats.device_busy += 1
                if seq.held_at is not None:
                    self._traffic.released(model, seq.plan.input_tokens)
                    seq.held_at = None
                self._refuse(seq, "overloaded: every instance's device is too busy")
                self._schedule_scaler(self.cfg.network_s, urgent=True)
                return True
            if step.urgent:
                self._schedule_scaler(self.cfg.network_s, urgent=True)
            return False
        if isinstance(step, GiveUp):
            return False  # its expire event fails it
        matched = cached.get(step.te_id, 0)
        key = seq.plan.key
        te = self._by_id[step.te_id]
        if te.state != TEState.READY or te.model != model:
            # The view was stale: the TE unloads or drains. It refuses (its placement,
            # counted and taken back, leaves the ledger as it was); the JE tries again.
            seq.job = dataclasses.replace(seq.job, refused=seq.job.refused | {te.te_id})
            return self._try_place(seq)
        if self.cfg.shadow:
            verdict = self._shadow(te, seq)
            if not verdict.ok:  # the TE refuses (DEVICE_BUSY): the JE tries another
                why = self.stats.shadow_refused
                why[verdict.reason] = why.get(verdict.reason, 0) + 1
                seq.job = dataclasses.replace(seq.job, refused=seq.job.refused | {te.te_id})
                seq.busy = seq.busy | {te.te_id}
                return self._try_place(seq)
        prefill_te = self._disaggregate(seq, self._view[step.te_id], matched, every)
        uncached = seq.prompt - matched
        work = (0, uncached) if prefill_te else (uncached, 0)  # prefill, or KV taken in
        self._ledger.placed(step.te_id, key, *work)
        te.placements += 1
        seq.placement = te.placements
        self._ledger.accepted(key, te.placements)
        self._outputs.placed(key, model, seq.plan.input_tokens)
        if seq.held_at is not None:
            self.stats.held_wait_s += self.now - seq.held_at
            self._traffic.released(model, seq.plan.input_tokens)
            self._reports_due = True
            seq.held_at = None
        self.stats.routed[step.branch] = self.stats.routed.get(step.branch, 0) + 1
        seq.matched = matched
        if not seq.placed:
            seq.placed = True
            self.stats.prompt_tokens += seq.plan.input_tokens
            self.stats.matched_tokens += matched
            self.stats.oracle_tokens += max(cached.values(), default=0)
        # In deadline order, as the engine queues: due from its arrival, as the TE hands
        # the engine its request (``EngineRequest.arrival``).
        paced = self._pacing.get((te.kind, model))
        seq.due = EPOCH + seq.result.sent_s + paced.ttft_limit_s(seq.prompt) if paced else math.inf
        te.last_active = self.now
        if prefill_te is not None:  # the decode TE waits for the KV
            self._traffic.prefill_placed(model, seq.prompt - matched)  # as the JE counts it
            self._start_prefill(seq, te, prefill_te)
            return True
        self._enqueue(te, seq)
        return True

    def _enqueue(self, te: _TE, seq: _Seq) -> None:
        """In deadline order, as the engine queues."""
        enqueue(te.waiting, seq, lambda s: queue_due(s.due, started=s.generated > 0))
        self._dirty.add(te.te_id)
        self._kick(te, delay=2 * self.cfg.network_s)

    # -- PD disaggregation --------------------------------------------------------------------

    def _disaggregate(
        self, seq: _Seq, decode: TEView, matched: int, every: Sequence[TEView]
    ) -> _TE | None:
        """The JE's PD decision for a request routed to ``decode``: the prefill TE its prompt
        runs on, or None. Its prefill work goes into the traffic report once."""
        model = seq.plan.model
        prefill_tes = prefill_instances(model, every)
        assert seq.job is not None
        pd = decide(
            self._pd,
            decode=decode,
            prompt_tokens=seq.prompt,
            cached_tokens=matched,
            max_tokens=seq.plan.output_tokens,
            prefill_tes=[v for v in prefill_tes if v.te_id not in seq.job.refused],
            unreported=self._ledger.unreported,
            demand=self._demand(seq, every),
        )
        if pd.wanted and not seq.placed:
            self._traffic.prefill_wanted(model, seq.prompt - matched)
        prefill = self._by_id[pd.prefill_te] if pd.prefill_te else None
        reason = pd.reason
        if prefill is not None and (prefill.state != TEState.READY or prefill.model != model):
            prefill, reason = None, "prefill instance refused"  # a stale view
        if prefill_tes and self._pd.mode != "never":  # the JE says it where PD is in play
            self.stats.pd_reasons[reason] = self.stats.pd_reasons.get(reason, 0) + 1
            seq.result.disaggregated = prefill is not None
        return prefill

    def _demand(self, seq: _Seq, every: Sequence[TEView]) -> Demand | None:
        """As the JE's: the predicted output and the rate per instance, for a heat map."""
        model = seq.plan.model
        if model not in self._pd.heatmaps:
            return None
        n = sum(1 for v in every if v.state == TEState.READY)  # all roles, as the JE
        return Demand(
            output_tokens=self._outputs.predict(
                model, seq.plan.input_tokens, seq.plan.output_tokens
            ),
            rate_per_instance=self._rates.rate(model, self.now) / max(n, 1),
        )

    def _start_prefill(self, seq: _Seq, decode: _TE, prefill: _TE) -> None:
        """The prefill task (key ``<request>/prefill``) on ``prefill``; ``seq`` waits for
        its KV, its decode TE expecting it."""
        task = _Seq(
            plan=seq.plan,
            result=seq.result,
            prompt=seq.plan.input_tokens,
            keys=seq.keys,
            kv_for=seq,
            decode_te=decode,
            due=seq.due,
        )
        task.matched = prefill.cached_prefix(task)
        key = f"{seq.plan.key}/prefill"
        self._ledger.placed(prefill.te_id, key, task.prompt - task.matched)
        prefill.placements += 1
        task.placement = prefill.placements
        self._ledger.accepted(key, task.placement)
        seq.import_tokens = seq.prompt - seq.matched  # its KV, coming
        seq.matched = seq.prompt  # no prefill work on its decode TE
        self.stats.disaggregated += 1
        decode.incoming.append(seq)
        prefill.last_active = self.now
        self._enqueue(prefill, task)

    def _prefilled(self, te: _TE, task: _Seq) -> None:
        """A prefill task's prompt is done: its blocks stay leased until the decode TE has
        pulled what it lacks, streamed layer by layer since the prefill started."""
        assert task.kv_for is not None and task.decode_te is not None and te.profile is not None
        te.running.remove(task)
        if te.cache is not None and task.keys:
            te.cache.insert(task.keys, task.plan.block_size)
        held = task.decode_te.cached_prefix(task.kv_for)
        nbytes = (task.plan.input_tokens - held) * te.profile.kv_bytes_per_token
        self.stats.kv_bytes += nbytes
        # Each TE's link carries one transfer at a time, out of a prefill TE or into a
        # decode TE: one that finds either end busy waits for it.
        decode = task.decode_te
        start = max(task.started_at, te.link_free_at, decode.link_free_at)
        te.link_free_at = decode.link_free_at = start + nbytes / self.cfg.kv_bandwidth
        pulled = max(self.now, te.link_free_at)
        te.transfers += 1
        self._at(pulled + self.cfg.network_s, "kv_done", (te, task))

    def _kv_done(self, arg: tuple[_TE, _Seq]) -> None:
        """The decode TE has the KV: the prefill TE's lease ends (its blocks go back), and
        the request joins the decode TE's queue with its prompt's KV and the prefill's
        token."""
        te, task = arg
        seq, decode = task.kv_for, task.decode_te
        assert seq is not None and decode is not None
        te.transfers -= 1
        te.free_blocks += task.blocks - task.shared_blocks
        task.blocks = task.shared_blocks = 0
        self._ledger.ended(f"{seq.plan.key}/prefill", te.te_id)
        self._dirty.add(te.te_id)
        self._kick(te)
        self._maybe_unloaded(te)
        decode.incoming.remove(seq)
        seq.generated, seq.imported, seq.import_tokens = 1, True, 0
        seq.prompt = seq.num_tokens
        seq.admitted = True  # its prompt was computed (and counted) on the prefill TE
        self._ledger.prefilled(seq.plan.key, decode.te_id)
        self._enqueue(decode, seq)
        self._maybe_unloaded(decode)

    def _place_held(self, model: str) -> None:
        held = self._held.pop(model, [])
        still = []
        for s in held:
            if s.result.error is not None:
                continue
            assert s.job is not None
            s.job = dataclasses.replace(s.job, refused=frozenset())  # a new view
            s.busy = frozenset()
            if not self._try_place(s):
                still.append(s)
        if still:
            self._held[model] = still

    def _expire(self, seq: _Seq) -> None:
        held = self._held.get(seq.plan.model)
        if held is None or seq not in held:
            return
        held.remove(seq)
        if not held:
            del self._held[seq.plan.model]
        self.stats.timeouts += 1
        self._traffic.released(seq.plan.model, seq.plan.input_tokens)
        self._reports_due = True
        self._refuse(seq, "no_capacity: no instance could take the request in time")

    def _refuse(self, seq: _Seq, error: str) -> None:
        """A 503 for the request: a miss in the JE's traffic, a failure in the outcomes."""
        seq.result.status = 503
        seq.result.error = error
        self._traffic.missed(seq.plan.model)
        self._reports_due = True
        self._outcomes.record(
            seq.plan.model,
            ok=False,
            prompt_tokens=seq.plan.input_tokens,
            output_tokens=0,
            ttft_s=None,
            tpot_s=None,
        )

    def _report_traffic(self, _: object) -> None:
        """The JEs' traffic reports and the frontends' outcome reports reach the scaler."""
        if self._reports_due:
            self._deliver_reports()
        self._at(self.now + self.cfg.report_s, "report")

    def _deliver_reports(self) -> None:
        models = self._traffic.report()
        self._scaler = observe_traffic(self._scaler, JE_ID, models, now=self.now, cfg=self._scfg)
        if outcomes := self._outcomes.take():
            self._scaler = observe_outcomes(self._scaler, outcomes, now=self.now, cfg=self._scfg)
        self._reports_due = bool(self._traffic)
        self._schedule_scaler()

    # -- cluster view -------------------------------------------------------------------------

    def _report(self, te: _TE) -> None:
        """A TE's heartbeat reaches the view (and the JE's ledger)."""
        old = self._view[te.te_id]
        if old.model is not None and old.model != te.model:
            self._by_model[old.model].discard(te.te_id)
        v = te.view(self.now)
        self._view[te.te_id] = v
        self._ledger.report(v)
        if v.model is not None:
            self._by_model.setdefault(v.model, set()).add(te.te_id)
        self._dirty.discard(te.te_id)

    def _state_changed(self, te: _TE) -> None:
        """A TE beats at once when its state changes (as the service does); the cluster
        manager pushes the new view; jobs held for an instance retry on it."""
        st = self.stats
        st.view_changes += 1
        second = int(self.now - EPOCH)
        st.view_changes_by_s[second] = st.view_changes_by_s.get(second, 0) + 1
        self._report(te)
        for model in self._held:
            self._at(self.now + self.cfg.network_s, "place", model)
        self._schedule_scaler(self.cfg.network_s)

    def _heartbeat(self, _: object) -> None:
        for te_id in list(self._dirty):
            self._report(self._by_id[te_id])
        for te in self.tes:  # an idle TE looks at its pool too (its lazy shrink)
            if te.kv is not None and not te.busy:
                self._size_kv(te)
        busy = sum(1 for te in self.tes if te.state != TEState.IDLE)
        self.stats.max_busy_devices = max(self.stats.max_busy_devices, busy)
        for model in self._held:
            self._at(self.now + self.cfg.network_s, "place", model)
        self._at(self.now + self.cfg.heartbeat_s, "heartbeat")

    # -- scaler ---------------------------------------------------------------------------------

    def _schedule_scaler(self, delay: float | None = None, *, urgent: bool = False) -> None:
        """The scaler wakes on an urgent report and on view changes, and ticks while it
        has work."""
        if urgent and self._reports_due:
            self._deliver_reports()
        at = self.now + (self.cfg.scaler_period_s if delay is None else delay)
        if self._scaler_at is None or at < self._scaler_at:
            self._scaler_at = at
            self._at(at, "scaler", at)

    def _scaler_tick(self, due: float) -> None:
        if due != self._scaler_at:
            return  # superseded by an earlier tick
        self._scaler_at = None
        views = list(self._view.values())
        step = tick(
            self._scaler,
            views,
            models=self._models,
            now=self.now,
            cfg=self._scfg,
            tried=self._preloaded,
        )
        self._scaler, decision = step.state, step.decision
        for action in decision.actions:
            te = self._by_id[action.te_id]
            if isinstance(action, Load) and te.state == TEState.IDLE:
                profile = self._profile(te, action.model)
                te.state, te.model, te.profile = TEState.LOADING, action.model, profile
                te.role = action.role
                self.stats.prefill_loads += action.role == TaskMode.PREFILL
                te.since = self.now
                te.epoch += 1
                self._state_changed(te)
                self.stats.loads += 1
                if self.cfg.instant_loads:
                    te.weights, load_s = "instant", 0.0
                else:
                    te.weights = self._weights_source(te, action.model, action.weights_from)
                    load_s = fill_s(profile, te.weights, self.cfg.fork_bandwidth)
                by_source = self.stats.loads_by_source
                by_source[te.weights] = by_source.get(te.weights, 0) + 1
                te.load_s = self.cfg.network_s + load_s
                if self.cfg.kv_sizing:
                    self._kv_reserve(te, profile)  # its grant starts the load
                else:
                    self._at(self.now + te.load_s, "loaded", (te, te.epoch))
            elif isinstance(action, Unload) and te.state == TEState.READY:
                self._drain(te)
        for model, t in decision.targets.items():
            self.stats.peak_replicas[model] = max(self.stats.peak_replicas.get(model, 0), t.current)
        if self._fleet is not None:
            self._fleet.note(self.now - EPOCH, decision.targets)
        for p in step.preloads:
            self._preloaded[p.model, p.pool_id] = self.now
            self._preload(self._by_id[p.te_id], p.model, p.weights_from)
        if self._held or self._busy() or self._reports_due:
            self._schedule_scaler()

    # -- host weight caches ------------------------------------------------------------------

    def _weights_source(self, te: _TE, model: str, weights_from: str | None) -> str:
        """Where a load or pre-load on ``te`` takes ``model``'s weights from, as the TE's
        cache session does: its pool's cache, else the weight server it was told to fork
        from (where that cache still holds them), else the checkpoint."""
        if te.host is None:
            return "disk"
        if model in te.host:
            return "cache"
        source = self._hosts.get(weights_from) if weights_from else None
        return "fork" if source is not None and model in source else "disk"

    def _preload(self, te: _TE, model: str, weights_from: str | None) -> None:
        """``PreloadModel``: an idle TE makes the model's weights into its pool's cache, no
        engine (a TE that is not idle refuses, and the scaler does not retry it)."""
        self.stats.preloads_sent += 1
        if te.state != TEState.IDLE:
            return
        te.state, te.preloading, te.since = TEState.PRELOADING, model, self.now
        te.epoch += 1
        te.weights = self._weights_source(te, model, weights_from)
        done = fill_s(self._profile(te, model), te.weights, self.cfg.fork_bandwidth)
        self._state_changed(te)
        self._at(self.now + self.cfg.network_s + done, "preloaded", (te, te.epoch))

    def _preloaded_done(self, arg: tuple[_TE, int]) -> None:
        te, epoch = arg
        if te.epoch != epoch or te.state != TEState.PRELOADING or te.preloading is None:
            return
        self._into_host_cache(te, te.preloading)
        self.stats.preloads_done += 1
        self.stats.preload_seconds += self.now - te.since
        te.state, te.preloading = TEState.IDLE, None
        te.epoch += 1
        self._state_changed(te)

    def _into_host_cache(self, te: _TE, model: str) -> None:
        """After a load or pre-load through its pool's cache: what it built or fetched is
        stored (room made by eviction), and its use recorded. The pool's TEs report the
        change with their next heartbeat (the real ones read the cache every few seconds)."""
        host = te.host
        if host is None or te.weights == "instant":
            return
        if te.weights != "cache":
            in_use = {
                t.model
                for t in self._pools[te.pool_id]
                if t.model is not None
                and t.state in (TEState.LOADING, TEState.READY, TEState.DRAINING)
            }
            size = self._profile(te, model).weight_size()
            stored = host.store(model, size, self.now, in_use)
            self.stats.evictions += len(stored.evicted)
            self.stats.evicted_bytes += stored.evicted_bytes
            self.stats.uncached_loads += not stored.cached
        host.record(model, self.now)
        self._dirty.update(t.te_id for t in self._pools[te.pool_id])

    def _drain(self, te: _TE) -> None:
        """A ready TE stops taking requests and unloads once its last one finished."""
        te.state = TEState.DRAINING
        assert te.model is not None
        self._ready[te.model] -= 1
        self._state_changed(te)
        self._maybe_unloaded(te)

    def _maybe_unloaded(self, te: _TE) -> None:
        """A draining TE unloads once its last request finished."""
        if te.state != TEState.DRAINING or te.running or te.waiting or te.busy:
            return
        if te.transfers or te.incoming:  # PD: KV leased out, or due in
            return
        te.state, te.model, te.profile, te.cache = TEState.IDLE, None, None, None
        te.role = TaskMode.COLOCATED
        if te.kv is not None:  # its KV goes back to the device's books at once
            te.kv, te.pool_blocks, te.free_blocks, te.squeeze_left = None, 0, 0, False
            self._kv_hold(te, 0)
            self._devices[te.device].need_since.pop(te.te_id, None)
        te.epoch += 1
        self._state_changed(te)
        self.stats.unloads += 1
        self._spans.append((te.since, self.now))

    def _loaded(self, arg: tuple[_TE, int]) -> None:
        te, epoch = arg
        if te.epoch != epoch or te.state != TEState.LOADING:
            return
        assert te.profile is not None and te.model is not None
        te.state = TEState.READY
        te.free_blocks = te.profile.kv_blocks // self._slots  # its share of the device's
        if self.cfg.prefix_caching:  # (the same size whether its pool is sized by demand)
            te.cache = PrefixLRU(te.free_blocks * te.profile.block_size)
        if self.cfg.kv_sizing:  # the whole cache, shrunk to its floor as it enters the books
            te.free_blocks = te.pool_blocks = te.profile.kv_blocks
            te.kv = KvPool(
                _KvOf(te, te.profile),
                max_model_len=te.profile.max_model_len,
                shrink_after_s=self.cfg.kv_shrink_after_s,
            )
            self._size_kv(te, loaded=True)
        te.last_active = self.now
        te.recent_models = remember_model(te.recent_models, te.model)
        self._ready[te.model] = self._ready.get(te.model, 0) + 1
        self._into_host_cache(te, te.model)
        self._state_changed(te)

    # -- engine -------------------------------------------------------------------------------

    def _kick(self, te: _TE, delay: float = 0.0) -> None:
        if not te.busy and (te.running or te.waiting):
            te.busy = True
            self._at(self.now + delay, "iteration", (te, None))

    def _iteration_done(self, arg: tuple[_TE, dict[_Seq, int] | None]) -> None:
        te, batch = arg
        if batch is not None:
            self._finish_iteration(te, batch)
        self._size_kv(te)  # as a TE, after each iteration
        te.busy = False
        if not self._turn_taking:
            self._start_iteration(te)
        else:
            device = self._devices[te.device]
            if device.active is te:
                device.active = None
            if te.running or te.waiting:
                device.wanting.setdefault(te, self.now)
                te.busy = True  # until its turn: no second kick
            self._grant_turn(device)
        self._maybe_unloaded(te)

    # -- KV sized by demand ----------------------------------------------------------------------

    def _size_kv(self, te: _TE, *, loaded: bool = False, squeeze: bool = False) -> None:
        """``te``'s pool sized by what it holds, as a TE sizes it (``TaskLoop._size_kv``):
        a grow only into the room its device's books grant, and it asks for the rest."""
        if te.kv is None:
            return
        squeeze = squeeze or te.squeeze_left
        held = [
            (s.plan.input_tokens, s.plan.output_tokens)
            for s in itertools.chain(te.running, te.waiting, te.incoming)
        ]
        room = 0.0 if loaded else te.kv_room
        plan = te.kv.plan(held, self.now, room_bytes=room, squeeze=squeeze or loaded)
        before = blocks = te.pool_blocks
        bb = te.kv.engine.kv_block_bytes
        if plan.blocks is not None:
            blocks = te.kv.resize(plan.blocks)
            if blocks > before:
                self._kick(te)  # room for what waits
        te.squeeze_left = squeeze and plan.blocks is not None and blocks > plan.blocks
        if blocks != before or loaded:
            self._kv_hold(te, blocks * bb)
        if plan.need_bytes is not None:
            self._kv_need(te, plan.need_bytes)
        elif te.te_id in self._devices[te.device].needs:  # it no longer waits (kv_enough)
            self._kv_hold(te, te.pool_blocks * bb)
        if te.te_id not in self._devices[te.device].needs:  # its wait, if any, is over
            self._devices[te.device].need_since.pop(te.te_id, None)

    def _kv_reserve(self, te: _TE, profile: EngineProfile) -> None:
        """Room in the device's books for a load's pool floor before the load starts
        (``TaskLoop.reserve_kv``, asked as urgent as now): the grant starts the load
        (``_make_room``); it waits for it, the others told to shrink, for up to
        ``kv_room_wait_s`` (``MESHSERVE_KV_ROOM_WAIT``), and fails after
        (``_kv_room_timeout``)."""
        device = self._devices[te.device]
        self._kv_budget(device, profile)
        self._kv_hold(te, 0)
        self._kv_need(te, _floor_bytes(profile), urgency=self.now)
        if te.te_id not in device.needs:
            return
        self.stats.kv_load_waits += 1
        self._at(self.now + self.cfg.kv_room_wait_s, "kv_room_timeout", (te, te.epoch))

    def _kv_room_timeout(self, arg: tuple[_TE, int]) -> None:
        """A load that found no room for its KV in time fails (``NoKvRoom``): its ask
        withdrawn, the TE idle again."""
        te, epoch = arg
        device = self._devices[te.device]
        if te.epoch != epoch or te.state != TEState.LOADING or te.te_id not in device.needs:
            return
        self._kv_hold(te, 0)
        device.need_since.pop(te.te_id, None)
        te.state, te.model, te.profile = TEState.IDLE, None, None
        te.epoch += 1
        self.stats.kv_load_failures += 1
        self._spans.append((te.since, self.now))
        self._state_changed(te)

    @staticmethod
    def _kv_budget(device: _Device, profile: EngineProfile) -> int:
        """The device's KV in bytes: the whole cache its first model's profile has there
        (MESHSERVE_DEVICE_KV_BYTES)."""
        if not device.kv_budget:
            device.kv_budget = profile.kv_blocks * _block_bytes(profile)
        return device.kv_budget

    def _kv_hold(self, te: _TE, nbytes: int) -> None:
        """``te``'s pool holds ``nbytes`` now (``hold``): its books' entry, its asks cleared."""
        device = self._devices[te.device]
        if te.profile is not None:
            self._kv_budget(device, te.profile)
        device.holds[te.te_id] = nbytes
        device.reserved.pop(te.te_id, None)
        device.needs.pop(te.te_id, None)  # (its wait goes on if it asks again: _size_kv)
        device.squeezed.discard(te.te_id)
        te.kv_room = nbytes
        self._make_room(device)

    def _kv_need(self, te: _TE, total: int, urgency: float | None = None) -> None:
        """``te`` wants its pool to hold ``total`` bytes (``need``): room at once where the
        books have it, else a grow that waits (``DeviceArbiter._ask_room``)."""
        device = self._devices[te.device]
        total = min(total, device.kv_budget) if device.kv_budget else total
        have = device.holds.get(te.te_id, 0) + device.reserved.get(te.te_id, 0)
        if total <= have:
            device.needs.pop(te.te_id, None)
            device.need_since.pop(te.te_id, None)
            te.kv_room = have
            return
        if urgency is None:  # a grow: as urgent as its most urgent request
            urgency = earliest_deadline(self._held_views(te))
        device.need_since.setdefault(te.te_id, self.now)
        device.needs[te.te_id] = DeviceOp(
            "grow", te.te_id, total - have, urgency=urgency if math.isfinite(urgency) else 1e18
        )
        self._make_room(device)

    def _make_room(self, device: _Device) -> None:
        """The device's waiting grows granted as its arbiter grants them
        (``kv_sizing.make_room``), the others told to shrink while one waits."""
        if not device.needs:
            return
        room = make_room(
            list(device.needs.values()),
            device.kv_used_bytes(),
            device.kv_budget,
            {t: t in device.squeezed for t, held in device.holds.items() if held},
        )
        granted = []
        rest = {op.instance: op for op in room.wait}  # a grow granted in part waits for the rest
        for op in room.grant:
            te = self._by_id[op.instance]
            device.reserved[te.te_id] = device.reserved.get(te.te_id, 0) + op.bytes
            if op.instance in rest:
                device.needs[te.te_id] = rest[op.instance]
            else:
                del device.needs[te.te_id]
                device.need_since.pop(te.te_id, None)
            te.kv_room = device.holds.get(te.te_id, 0) + device.reserved[te.te_id]
            granted.append(te)
        for name in room.squeeze:
            device.squeezed.add(name)
            self.stats.kv_squeezes += 1
        for name in room.squeeze:
            self._size_kv(self._by_id[name], squeeze=True)
        for te in granted:
            if te.state == TEState.LOADING and te.kv is None:  # a load's floor
                if te.te_id not in device.needs:  # all of it: the load starts
                    self._at(self.now + te.load_s, "loaded", (te, te.epoch))
            else:
                self._size_kv(te)  # it grows into its room (a TE, at its next iteration)
        if self.cfg.kv_preemption and room.wait and not room.squeeze:
            self._preempt_for(device, room.wait[0])

    def _preempt_for(self, device: _Device, op: DeviceOp) -> None:
        """The device's first waiting grow, every other pool already told to shrink: once it
        has waited ``PREEMPT_AFTER_S``, its instance may preempt a smaller neighbour
        (``kv_sizing.preemption``, LLM-Mesh) each of whose requests passes shadow validation
        on an instance of its model on another device. They move there (each recomputes
        its prompt and what it generated, as a request preempted for blocks does, its
        output the same) and the neighbour unloads: its pool leaves the books for the grow.
        Looked at once a second per device at most (each look plays many devices forward)."""
        since = device.need_since.get(op.instance)
        if since is None or self.now - since < PREEMPT_AFTER_S or self.now < device.preempt_after:
            return
        device.preempt_after = self.now + PREEMPT_AFTER_S
        blocked = self._by_id[op.instance]
        if blocked.state != TEState.READY or op.kind != "grow":
            return
        views = {v.instance: v for v in self._device_views(device)}
        neighbours = [
            Neighbour(views[t.te_id], t.model or "", device.holds.get(t.te_id, 0))
            for t in device.tes
            if t is not blocked
            and t.te_id in views
            and t.state == TEState.READY
            and t.role == TaskMode.COLOCATED
            and not t.incoming
            and not t.transfers
            and not (t.busy and t not in device.wanting)  # no iteration in flight
        ]
        if not neighbours:
            return
        models = {n.model for n in neighbours}
        targets = elsewhere(  # each look plays many devices: only those with a target
            (
                (self._device_views(other), takes)
                for other in self._devices.values()
                if other is not device
                and (
                    takes := {
                        t.te_id: t.model or ""
                        for t in other.tes
                        if t.state == TEState.READY
                        and t.role == TaskMode.COLOCATED
                        and t.model in models
                    }
                )
            ),
            models,
        )
        if not targets:
            return
        free = max(0, device.kv_free_bytes())
        decided = preemption(views[blocked.te_id], op.bytes, free, neighbours, targets, self.now)
        if decided is not None:
            self._move_out(self._by_id[decided.neighbour], decided.moves)

    def _move_out(self, te: _TE, moves: Mapping[str, str]) -> None:
        """A preempted neighbour's requests go where ``moves`` says, recomputed there, and
        the neighbour unloads."""
        device = self._devices[te.device]
        if te in device.wanting:  # waiting for its turn: it no longer needs one
            del device.wanting[te]
            te.busy = False
        seqs = list(itertools.chain(te.running, te.waiting))
        te.running.clear()
        te.waiting.clear()
        self.stats.kv_preemptions += 1
        for s in seqs:
            key = s.plan.key
            te.free_blocks += s.blocks - s.shared_blocks
            s.blocks = s.shared_blocks = s.computed = s.matched = 0
            s.prompt = s.num_tokens  # recomputed from all its tokens, as a preempted request
            self._ledger.ended(key, te.te_id)
            target = self._by_id[moves[key]]
            self._ledger.placed(target.te_id, key, s.prompt, 0)
            target.placements += 1
            s.placement = target.placements
            self._ledger.accepted(key, target.placements)
            if s.generated:  # it decodes there (the TE's report says so), its prefill is due
                self._ledger.prefilled(key, target.te_id)
            self.stats.kv_moved += 1
            self._enqueue(target, s)
        self._drain(te)

    # -- shared devices ------------------------------------------------------------------------

    def _profile(self, te: _TE, model: str) -> EngineProfile:
        """The model's profile on ``te``'s kind of device."""
        return (self.gpu_profiles if te.kind == "gpu" else self.profiles)[model]

    def _perf_model(self, profile: EngineProfile) -> PerfModel:
        """Its performance model (``EngineProfile.perf_model``), built once."""
        got = self._perf.get(id(profile))
        if got is None:
            got = self._perf[id(profile)] = (profile, profile.perf_model())
        return got[1]

    def _request_view(self, s: _Seq) -> RequestView:
        """A request as its deadlines and shadow validation see it (as the TE's)."""
        n = s.plan.input_tokens
        return request_view(
            self.cfg.slo,
            arrival=EPOCH + s.result.sent_s,
            prompt_tokens=n,
            expected_output=1 if s.kv_for is not None else s.plan.output_tokens,
            computed_tokens=n if s.generated else min(max(s.computed, s.matched), n - 1),
            output_tokens=s.generated,
            id=f"{s.plan.key}/prefill" if s.kv_for is not None else s.plan.key,
        )

    def _held_views(self, te: _TE) -> list[RequestView]:
        """The requests ``te`` holds, running first then the head of its queue."""
        head = itertools.islice(te.waiting, 4 * (te.profile.max_num_seqs if te.profile else 1))
        return [self._request_view(s) for s in itertools.chain(te.running, head)]

    def _grant_turn(self, device: _Device) -> None:
        """The device is free: the next turn to the instance whose most urgent request is
        due first (``next_turn`` over each one's ``urgency``, as its engine orders prompts:
        those late by less than the late yield, behind; "fifo": the one that asked first)."""
        while device.active is None and device.wanting:
            if self.cfg.sharing == "headroom":
                claims = {
                    t.te_id: urgency(self._held_views(t), self.now, self._late_yield_s)
                    for t in device.wanting
                }
                chosen = next_turn(claims)
                te = next(t for t in device.wanting if t.te_id == chosen) if chosen else None
                if te is None:  # nothing held anywhere: the first that asked
                    te = min(device.wanting, key=lambda t: (device.wanting[t], t.te_id))
                elif claims[te.te_id].deadline < self.now:
                    self.stats.late_turns += 1
            else:
                te = min(device.wanting, key=lambda t: (device.wanting[t], t.te_id))
            del device.wanting[te]
            te.busy = False
            self._start_iteration(te)  # the device is its until the iteration ends
            self._maybe_unloaded(te)

    def _device_views(self, device: _Device) -> tuple[InstanceView, ...]:
        """The device's instances as shadow validation sees them (the arbiter's books of
        requests)."""
        views = []
        for t in device.tes:
            if t.profile is None or t.state not in (TEState.READY, TEState.DRAINING):
                continue
            views.append(
                InstanceView(
                    instance=t.te_id,
                    perf=self._perf_model(t.profile),
                    requests=tuple(
                        self._request_view(s) for s in itertools.chain(t.running, t.waiting)
                    ),
                    max_num_seqs=t.profile.max_num_seqs,
                    max_prefill_tokens=t.profile.max_prefill_tokens,
                    late_yield_s=self._late_yield_s,
                )
            )
        return tuple(views)

    def _shadow(self, te: _TE, seq: _Seq) -> Verdict:
        """Shadow validation on ``te``'s device (``shadow.validate``), as the TE asks it."""
        views = list(self._device_views(self._devices[te.device]))
        return validate(views, te.te_id, self._request_view(seq), self.now)

    def _ttft_left(self, s: _Seq) -> float:
        """As the engine's ``_ttft_left``: -inf once it produced tokens, inf without a target."""
        if s.generated:
            return -math.inf
        return s.due - self.now if s.due != math.inf else math.inf

    def _start_iteration(self, te: _TE) -> None:
        prof = te.profile
        if prof is None or not (te.running or te.waiting):
            return
        device = self._devices[te.device]
        if self._turn_taking and device.active not in (None, te):
            device.wanting.setdefault(te, self.now)  # its turn comes when the device is free
            te.busy = True
            return
        bs = prof.block_size
        paced = self._pacing.get((te.kind, prof.model))
        running = [
            SeqView(
                str(id(s)),
                s.num_tokens,
                s.blocks,
                s.computed,
                tpot_slack_s=(
                    tpot_slack(paced.tpot_s, s.generated, self.now - s.first_token_at)
                    if paced is not None and s.generated
                    else None
                ),
                ttft_left_s=self._ttft_left(s),
            )
            for s in te.running
        ]
        # The scheduler admits in queue order and stops at the first that does not fit: only
        # the head of the queue can matter (a long queue would make every iteration O(n)).
        head = admission_head(te.waiting, prof.max_num_seqs, self._ttft_left, self._late_yield_s)
        hits = {s: te.cached_prefix(s) for s in head}
        waiting = [
            SeqView(
                str(id(s)),
                s.prompt,
                hits[s] // bs,
                # imported (PD): its prompt's KV is here, past the prefix this cache holds
                num_cached_tokens=s.plan.input_tokens if s.imported else hits[s],
                ttft_left_s=self._ttft_left(s),
            )
            for s in head
        ]
        sched = SchedulerConfig(
            block_size=bs,
            max_num_seqs=prof.max_num_seqs,
            max_prefill_tokens=prof.max_prefill_tokens,
            chunked_prefill=prof.chunked_prefill,
            pacing=paced,
            late_yield_s=self._late_yield_s,
        )
        decision = schedule(running, waiting, te.free_blocks, sched)
        if decision.preempt:
            gone = set(decision.preempt)
            for s in [s for s in te.running if str(id(s)) in gone][::-1]:
                te.running.remove(s)
                te.free_blocks += s.blocks - s.shared_blocks
                s.blocks = s.shared_blocks = 0
                s.computed = 0
                s.prompt = s.num_tokens  # recomputed from all its tokens
                te.waiting.appendleft(s)
                self.stats.preemptions += 1
        going_on = set(decision.running)
        ran = [s for s in te.running if str(id(s)) in going_on]
        prefill = head[: len(decision.prefill)]  # the head's first, as the engine admits
        for s in prefill:
            te.waiting.remove(s)
        # Admitted: running from now on, as the engine counts them (a heartbeat during this
        # iteration reports them, and the JE's ledger keeps them).
        te.running.extend(prefill)
        for s in prefill:
            hit = hits.get(s, 0)
            if hit:
                te.cached_prefix(s, touch=True)
            s.computed, s.blocks, s.shared_blocks = hit, hit // bs, hit // bs
            if s.imported:  # the rest of its prompt's KV is the import's, in new blocks
                s.computed, s.imported = s.plan.input_tokens, False
            if s.kv_for is not None and not s.started_at:
                s.started_at = self.now  # its KV streams from now on, layer by layer
            if not s.admitted:
                s.admitted = True
                self.stats.cached_tokens += hit
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
            if decision.preempt:  # the engine schedules again at once (its loop goes on)
                self._kick(te)
            return  # nothing fits (a prompt larger than the cache): stays queued
        step = prof.iteration_s(len(ends) - len(chunks), ctx, chunks, cached)
        if self._slots > 1 and not self._turn_taking:  # time-sliced with the others
            step *= 1 + sum(1 for t in device.tes if t is not te and (t.busy or t.running))
        if self._turn_taking:
            device.active = te
            self.stats.turns += 1
        self.stats.iterations += 1
        te.busy = True
        self._at(self.now + step, "iteration", (te, ends))

    def _finish_iteration(self, te: _TE, ends: dict[_Seq, int]) -> None:
        """``ends``: how many tokens each request that ran has in the cache now."""
        arrive = self.now + self.cfg.network_s  # the token reaches the client
        te.last_active = self.now
        for s, end in ends.items():
            s.computed = end
            if end < s.num_tokens:
                continue  # a prompt chunk: the prompt goes on in the next iteration
            if s.kv_for is not None:
                self._prefilled(te, s)  # a prefill task: its token goes with the KV
                continue
            if not s.generated and te.cache is not None and s.keys:
                te.cache.insert(s.keys, s.plan.block_size)  # its prompt's blocks stay
            s.generated += 1
            if s.generated == 1 and s.plan.output_tokens > 1:  # the TE tells the JE
                self._ledger.prefilled(s.plan.key, te.te_id)
            r = s.result
            if r.ttft_s is None:
                r.ttft_s = arrive - EPOCH - r.sent_s
                s.first_token_at = arrive
                if r.disaggregated and self.cfg.record_gaps:  # the prefill's token came first
                    r.gaps_s.append(0.0)
            elif self.cfg.record_gaps:
                r.gaps_s.append(arrive - s.last_token_at)
            s.last_token_at = arrive
            if s.generated >= s.plan.output_tokens:
                self._ledger.ended(s.plan.key, te.te_id)
                self._outputs.ended(s.plan.key, s.generated)
                te.running.remove(s)
                te.free_blocks += s.blocks - s.shared_blocks
                s.blocks = s.shared_blocks = 0
                r.e2e_s = arrive - EPOCH - r.sent_s
                r.status = 200
                r.prompt_tokens = s.plan.input_tokens
                r.completion_tokens = s.generated
                tpot = (arrive - s.first_token_at) / (s.generated - 1) if s.generated > 1 else None
                self._outcomes.record(
                    s.plan.model,
                    ok=True,
                    prompt_tokens=s.plan.input_tokens,
                    output_tokens=s.generated,
                    ttft_s=r.ttft_s,
                    tpot_s=tpot,
                )
                self._reports_due = True
        self._dirty.add(te.te_id)


def fill_s(profile: EngineProfile, source: str, fork_bandwidth: float) -> float:
    """How long a load takes by where its weights come from: mapped from the pool's cache;
    forked (the bytes over the network, then mapped as from the cache); read and packed
    from the checkpoint (``load_s``). A pre-load takes as long as a load from the same
    source: what it saves on the engine it spends storing the weights."""
    if source == "cache":
        return profile.cached_load_s()
    if source == "fork":
        return profile.weight_size() / fork_bandwidth + profile.cached_load_s()
    return profile.load_s


def simulate(
    planned: Sequence[Planned],
    profiles: Mapping[str, EngineProfile],
    cfg: SimConfig,
    gpu_profiles: Mapping[str, EngineProfile] | None = None,
    *,
    fleet: FleetTimeline | None = None,
) -> tuple[list[Result], SimStats]:
    """The requests' results and the run's figures; ``fleet``, where given, takes every
    scaler tick's targets (each model's fleet over time)."""
    sim = Simulation(planned, profiles, cfg, gpu_profiles, fleet=fleet)
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
