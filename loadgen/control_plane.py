"""What a fleet asks of its control plane, and where the control plane gives out first.

The simulator counts the control plane's work as it replays a trace on a fleet
(``SimStats``: the JE's placement steps, timed as the real decision functions run them, and
the TE state changes that make the cluster manager push a view). This module adds what the
services do per message, measured here on real messages (``measure``: a view of the fleet's
size encoded and decoded with the bus's codec, a TE heartbeat decoded), and turns both into
rates and utilisations (``needs``, pure):

- placements per second per job executor (the busiest second of the trace, spread over the
  JEs), and the CPU they cost the JE;
- view pushes per second: one per change of a TE's state (the cluster manager pushes at once)
  and one every heartbeat interval regardless; each is the whole view, encoded once by the
  cluster manager and decoded by every subscriber (frontends, job executors, scalers, cluster
  managers watching);
- heartbeats per second into the cluster manager;
- the view's size against NATS's ``max_payload`` (1 MiB unless the server raises it: a
  larger message is refused outright), and the bytes the pushes put on the wire.

The first limit is the resource with the highest utilisation (a core of each service, the
payload bound, a 10 Gb/s link); ``needs`` also says at how many TEs each one reaches 100%."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping

from shared.messages import decoder_for, encode
from shared.messages.cluster import (
    CachedWeights,
    ClusterView,
    EngineCapabilities,
    JobShare,
    TEHeartbeat,
    TEState,
)
from shared.messages.scaling import InstanceCapacity
from shared.messages.tasks import TaskMode

NATS_MAX_PAYLOAD = 1 << 20  # nats-server's default max_payload
LINK_BYTES_S = 1.25e9  # 10 Gb/s


@dataclasses.dataclass(frozen=True, slots=True)
class Fleet:
    tes: int
    hosts: int
    job_executors: int = 2
    frontends: int = 2
    scalers: int = 2
    cluster_managers: int = 2
    heartbeat_s: float = 1.0

    @property
    def view_subscribers(self) -> int:
        # Every replica keeps the view: frontends, JEs, scalers and the standby managers.
        return self.frontends + self.job_executors + self.scalers + self.cluster_managers - 1


@dataclasses.dataclass(frozen=True, slots=True)
class Costs:
    """Seconds and bytes per message on this host (``measure``)."""

    view_bytes_per_te: float
    view_encode_s_per_te: float
    view_decode_s_per_te: float
    heartbeat_decode_s: float
    placement_s: float  # one placement step of the JE's decision functions (the simulation's)


@dataclasses.dataclass(frozen=True, slots=True)
class Work:
    """What the simulation counted."""

    placements: int
    placements_by_s: Mapping[int, int]
    view_changes_by_s: Mapping[int, int]
    duration_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class Limit:
    resource: str
    utilisation: float  # at the trace's busiest second; 1.0: saturated
    at_tes: float | None  # fleet size at which it reaches 1.0 at this load per TE (None: never)
    detail: str


@dataclasses.dataclass(frozen=True, slots=True)
class ControlPlane:
    fleet: Fleet
    placements_per_s_per_je: float  # busiest second
    mean_placements_per_s_per_je: float
    view_pushes_per_s: float  # busiest second: its changes, plus the periodic push
    heartbeats_per_s: float
    view_bytes: float
    view_wire_bytes_per_s: float  # pushes × size × subscribers
    limits: tuple[Limit, ...]  # highest utilisation first

    @property
    def first(self) -> Limit:
        return self.limits[0]


def needs(work: Work, fleet: Fleet, costs: Costs) -> ControlPlane:
    """Rates at the trace's busiest second and the utilisation each puts on its resource."""
    n = fleet.tes
    peak_place = max(work.placements_by_s.values(), default=0)
    peak_changes = max(work.view_changes_by_s.values(), default=0)
    per_je = peak_place / fleet.job_executors
    pushes = peak_changes + 1.0 / fleet.heartbeat_s
    heartbeats = (n + fleet.job_executors + fleet.frontends) / fleet.heartbeat_s
    view_bytes = costs.view_bytes_per_te * n
    wire = pushes * view_bytes * fleet.view_subscribers
    decode = costs.view_decode_s_per_te * n
    encode = costs.view_encode_s_per_te * n
    # Busy fraction of one core of each service, and how it grows with the fleet: placements
    # and changes grow with the traffic a fleet of n TEs carries (∝ n), view sizes with n, so
    # a per-view cost times a rate grows with n²; heartbeats ∝ n.
    # Busy fraction of one core of each service, split in what grows with the fleet as n (at
    # the same load per TE: placements, changes and heartbeats ∝ n) and as n² (a rate ∝ n
    # times a view's size ∝ n).
    je = (per_je * costs.placement_s, pushes * decode)
    cm = (heartbeats * costs.heartbeat_decode_s, pushes * encode)
    sub = (0.0, pushes * decode)
    link = (0.0, wire / LINK_BYTES_S)
    limits = [
        Limit("job executor CPU", sum(je), _at(n, *je), f"{per_je:.0f} placements/s + views"),
        Limit(
            "cluster manager CPU", sum(cm), _at(n, *cm), f"{heartbeats:.0f} heartbeats/s + views"
        ),
        Limit("view decode CPU (each subscriber)", sum(sub), _at(n, *sub), f"{pushes:.1f} views/s"),
        Limit(
            "NATS max_payload (view size)",
            view_bytes / NATS_MAX_PAYLOAD,
            NATS_MAX_PAYLOAD / costs.view_bytes_per_te,
            f"{view_bytes / 1e6:.2f} MB a view, {costs.view_bytes_per_te:.0f} B a TE",
        ),
        Limit(
            "view bytes on a 10 Gb/s link",
            sum(link),
            _at(n, *link),
            f"{wire / 1e6:.1f} MB/s to {fleet.view_subscribers} subscribers",
        ),
    ]
    limits.sort(key=lambda lim: lim.utilisation, reverse=True)
    duration = max(work.duration_s, 1e-9)
    return ControlPlane(
        fleet=fleet,
        placements_per_s_per_je=per_je,
        mean_placements_per_s_per_je=work.placements / duration / fleet.job_executors,
        view_pushes_per_s=pushes,
        heartbeats_per_s=heartbeats,
        view_bytes=view_bytes,
        view_wire_bytes_per_s=wire,
        limits=tuple(limits),
    )


def _at(n: int, linear: float, quadratic: float) -> float | None:
    """The fleet size at which ``linear·k + quadratic·k²`` reaches 1 (k: size over ``n``)."""
    if quadratic > 0:
        k = (-linear + (linear * linear + 4 * quadratic) ** 0.5) / (2 * quadratic)
    elif linear > 0:
        k = 1 / linear
    else:
        return None
    return n * k


def measure(placement_s: float, *, tes: int = 1000, repeat: int = 5) -> Costs:
    """Time the real messages on this host: a ClusterView of ``tes`` TEs (each heartbeat
    with what a busy GPU TE reports: a loaded model, capabilities, capacity, four cached
    models, two job executors' shares) through the bus's codec, and one heartbeat decoded."""
    beats = [representative_heartbeat(i) for i in range(tes)]
    view = ClusterView(
        cluster="c", version=1, generated_at=time.time(), tes=beats, jes=[], frontends=[]
    )
    views, one = decoder_for(ClusterView), decoder_for(TEHeartbeat)
    blob = encode(view)
    enc = _best(lambda: encode(view), repeat)
    dec = _best(lambda: views.decode(blob), repeat)
    hb = encode(beats[0])
    hb_dec = _best(lambda: one.decode(hb), repeat * 100)
    return Costs(
        view_bytes_per_te=len(blob) / tes,
        view_encode_s_per_te=enc / tes,
        view_decode_s_per_te=dec / tes,
        heartbeat_decode_s=hb_dec,
        placement_s=placement_s,
    )


def _best(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def representative_heartbeat(i: int) -> TEHeartbeat:
    now = time.time()
    pool = f"pool-{i // 10:04d}"
    models = [f"org/model-{(i + k) % 40:02d}-7b-instruct" for k in range(4)]
    return TEHeartbeat(
        te_id=f"te-{pool}-{i % 10}-{i:04x}",
        pool_id=pool,
        host=f"gpu-node-{i // 10:04d}",
        pid=1000 + i,
        state=TEState.READY,
        started_at=now,
        model=models[0],
        engine="torch",
        device=f"cuda:{i % 10}",
        max_model_len=32768,
        running=12,
        waiting=3,
        free_kv_blocks=1234,
        total_kv_blocks=4096,
        last_active=now,
        sent_at=now,
        generated_tokens=123456,
        engine_capabilities=EngineCapabilities(
            modes=frozenset({TaskMode.COLOCATED}),
            prefix_cache=True,
            kv_events=True,
            kv_export=True,
            kv_import=True,
            weight_source=True,
        ),
        queued_prompt_tokens=2048,
        recent_models=models[:3],
        capacity=InstanceCapacity(
            prefill_s=1e-4,
            prefill_attention_s=1e-8,
            decode_s=0.01,
            decode_context_s=1e-6,
            max_num_seqs=64,
            engine="torch",
            device="cuda",
            measured_at=now,
        ),
        load_steps={"te_load_fetch": 0.5, "te_load_build": 1.2, "te_first_token": 0.1},
        ready_at=now,
        engine_reason="torch: the default",
        weight_server=f"10.0.{i // 10 % 256}.{i // 2560 + 1}:7000",
        cached_weights={m: CachedWeights(14 << 30, 14 << 30) for m in models},
        cache_free_bytes=64 << 30,
        shares={
            f"je-{k:08x}": JobShare(sequences=7, decoding=5, prefill_tokens=1000) for k in (1, 2)
        },
        placements=99999,
        kv_address=f"10.0.{i // 10 % 256}.{i // 2560 + 1}:7100",
        prefix_cache_queries=10**7,
        prefix_cache_hits=10**6,
    )


def lines(cp: ControlPlane) -> list[str]:
    """The report's lines."""
    f = cp.fleet
    out = [
        f"control plane for {f.tes} TEs on {f.hosts} hosts ({f.job_executors} job executors, "
        f"{f.view_subscribers} view subscribers): placements/s per JE {cp.placements_per_s_per_je:.0f} "
        f"at the busiest second (mean {cp.mean_placements_per_s_per_je:.1f}), view pushes/s "
        f"{cp.view_pushes_per_s:.1f}, heartbeats/s {cp.heartbeats_per_s:.0f}, a view "
        f"{cp.view_bytes / 1e6:.2f} MB, {cp.view_wire_bytes_per_s / 1e6:.1f} MB/s of views",
    ]
    for lim in cp.limits:
        at = f", 100% at ~{lim.at_tes:,.0f} TEs" if lim.at_tes is not None else ""
        out.append(f"  {lim.resource}: {100 * lim.utilisation:.1f}%{at} ({lim.detail})")
    out.append(f"  first limit: {cp.first.resource}")
    return out


def to_json(cp: ControlPlane) -> dict[str, object]:
    return dataclasses.asdict(cp) | {"first_limit": cp.first.resource}
