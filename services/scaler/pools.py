"""Where a new instance of a model goes: CPU devices before GPUs where the model's
instances on a CPU meet the SLO (LLM-Mesh: small models on CPUs leave the GPUs to what needs
them), then node pools ranked for it (spread, then the time to load it from the pool's host
cache, then warmth, then idleness; ``placement_order``, ``best_pool``), that load time
(``load_time``) and, where the pool's cache lacks the model, the weight server to fork it
from (``fork_source``). Pure; ``PoolIndex`` is what a placement reads off the view, built
once per decision.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from services.scaler.state import ScalerConfig
from services.views import TEView
from shared.messages.cluster import TEState
from shared.messages.scaling import InstanceCapacity
from shared.slo import SLO

# Profiled times are stretched by this much before they are held against the SLO (as
# shadow validation does).
SLO_MARGIN = 0.10


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
    # per model, the costs one of its instances on a CPU reported (where one did)
    cpu_capacity: Mapping[str, InstanceCapacity] = dataclasses.field(default_factory=dict)
    # per model, the floor of its KV pool under a device budget, as an instance reported it
    kv_floor: Mapping[str, int] = dataclasses.field(default_factory=dict)


def device_kind(te: TEView) -> str:
    """What a TE's engine runs on, without an index: "cpu", "cuda" ("": not said)."""
    return te.device.split(":", 1)[0]


def meets_slo(capacity: InstanceCapacity, slo: SLO, margin: float = SLO_MARGIN) -> bool:
    """Whether an instance with these costs serves within ``slo`` (its times stretched by
    ``margin``): a full batch's decode step within the TPOT limit, and a prompt as long as
    the TTFT floor covers (``ttft_s / ttft_per_input_token_s`` tokens, 1,024 by default)
    prefilled within that floor."""
    n = slo.ttft_s / slo.ttft_per_input_token_s if slo.ttft_per_input_token_s > 0 else 1024
    prefill = capacity.prefill_s * n + capacity.prefill_attention_s * n * n
    step = capacity.decode_step_s or capacity.decode_s * capacity.max_num_seqs  # older stores
    return (1 + margin) * step <= slo.tpot_s and ((1 + margin) * prefill <= slo.ttft_s)


def pool_index(tes: Sequence[TEView]) -> PoolIndex:
    serving: dict[tuple[str, str], int] = {}
    warm: set[tuple[str, str]] = set()
    resident: dict[tuple[str, str], int] = {}
    size: dict[str, int] = {}
    idle: dict[str, int] = {}
    cpu: dict[str, InstanceCapacity] = {}
    floor: dict[str, int] = {}
    for te in tes:
        pool = te.pool_id
        if te.model is not None:
            warm.add((te.model, pool))
            if te.kv_floor_bytes:
                floor[te.model] = max(floor.get(te.model, 0), te.kv_floor_bytes)
            if te.capacity is not None and device_kind(te) == "cpu":
                cpu.setdefault(te.model, te.capacity)
            if te.serving:
                serving[te.model, pool] = serving.get((te.model, pool), 0) + 1
        warm.update((m, pool) for m in te.recent_models)
        if te.state == TEState.IDLE:
            idle[pool] = idle.get(pool, 0) + 1
        for m, cached in te.cached_weights.items():
            size[m] = max(size.get(m, 0), cached.total_bytes)
            resident[m, pool] = max(resident.get((m, pool), 0), cached.resident_bytes)
    return PoolIndex(serving, frozenset(warm), resident, size, idle, cpu, floor)


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


def short_of_room(te: TEView, floor: int) -> bool:
    """Whether ``te``'s device lacks room now for a pool of ``floor`` bytes in its KV
    books (under a device budget, ``MESHSERVE_DEVICE_KV_BYTES``): a load there would wait
    for its neighbours to shrink, and fail after ``MESHSERVE_KV_ROOM_WAIT`` if they cannot.
    False where either is not known."""
    return te.device_kv_free_bytes is not None and floor > 0 and te.device_kv_free_bytes < floor


def placement_order(
    model: str,
    idle: Sequence[TEView],
    tes: Sequence[TEView],
    cfg: ScalerConfig | None = None,
    index: PoolIndex | None = None,
) -> list[TEView]:
    """Idle TEs in the order a new instance of ``model`` should take them: CPU devices first
    where an instance of the model on a CPU reported costs that meet the SLO
    (``meets_slo``), other devices first otherwise (a model never run on a CPU goes to a GPU
    while one is free: its CPU costs are unknown); then devices whose KV books have room now
    for the model's pool (``short_of_room``, its floor as an instance of it reported it: a
    load on a full device waits for its neighbours to shrink, and fails if they cannot);
    then instances of one model spread across node pools (fewest there first); then the
    pool that loads it fastest, by ``load_time`` from its host cache's metadata; then a pool where the model
    was loaded before (its files are in the page cache); then the pool with the most idle
    TEs (the least loaded); within a pool, a TE that ran the model lately, then by id.
    ``index``: ``pool_index(tes)``, where the caller has it."""
    cfg = cfg or ScalerConfig()
    idx = index or pool_index(tes)
    rank = {pool: _pool_rank(model, pool, cfg, idx) for pool in {te.pool_id for te in idle}}
    cpu = idx.cpu_capacity.get(model)
    cpu_first = cpu is not None and meets_slo(cpu, cfg.slo)
    floor = idx.kv_floor.get(model, 0)
    return sorted(
        idle,
        key=lambda te: (
            (device_kind(te) == "cpu") != cpu_first,
            short_of_room(te, floor),
            rank[te.pool_id],
            model not in te.recent_models,
            te.te_id,
        ),
    )


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
