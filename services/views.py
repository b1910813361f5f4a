"""The cluster as the policies see it: plain data, not wire messages.

The services build these from the cluster view's heartbeats (``te_view``); the simulator
builds them from its simulated TEs. A policy module (placement, scaling) takes them and
nothing else, so the simulator never forges a heartbeat."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from shared.messages.cluster import CachedWeights, JobShare, TEHeartbeat, TEState
from shared.messages.scaling import InstanceCapacity
from shared.messages.tasks import TaskMode

RECENT_MODELS = 8  # models a TE remembers loading (their files are likely in page cache)


def remember_model(recent: Sequence[str], model: str) -> tuple[str, ...]:
    """A TE's recent models (most recent first, ``TEView.recent_models``) once it loaded
    ``model``."""
    return (model, *(m for m in recent if m != model))[:RECENT_MODELS]


def queued_prompt_tokens(shares: Mapping[str, JobShare]) -> int:
    """A TE's prompt tokens accepted and not yet prefilled (less the prefix each placement
    expected cached): every job executor's share of them (``TEView.queued_prompt_tokens``)."""
    return sum(share.prefill_tokens for share in shares.values())


def queued_import_tokens(shares: Mapping[str, JobShare]) -> int:
    """PD, a decode TE: prompt tokens whose KV it has yet to take in from prefill TEs, every
    job executor's share (``TEView.queued_import_tokens``)."""
    return sum(share.import_tokens for share in shares.values())


@dataclasses.dataclass(frozen=True, slots=True)
class TEView:
    te_id: str
    pool_id: str
    state: TEState
    model: str | None = None
    running: int = 0  # sequences decoding (each holds a decode slot)
    waiting: int = 0  # accepted, not yet running
    queued_prompt_tokens: int = 0  # prompt tokens accepted, not yet prefilled, not expected cached
    queued_import_tokens: int = 0  # PD: prompt tokens whose KV it has yet to take in
    last_active: float = 0.0  # unix seconds of the last task accepted or token produced
    reported_at: float = 0.0  # when these figures were true
    failed_model: str | None = None  # the model whose last load failed here
    error: str | None = None
    recent_models: tuple[str, ...] = ()  # loaded here before (their files are warm)
    capacity: InstanceCapacity | None = None
    weight_server: str = ""  # host:port of its host's weight server ("": none)
    # what its host's weight cache holds, by model
    cached_weights: Mapping[str, CachedWeights] = dataclasses.field(default_factory=dict)
    cache_free_bytes: int = 0  # room left in its host's weight cache
    weight_relay: str = ""  # its host's weight server's multicast address
    relay_address: str = ""  # where it receives a multicast
    # its work by the job executor that placed it, and the placements it had taken then
    shares: Mapping[str, JobShare] = dataclasses.field(default_factory=dict)
    placements: int = 0
    role: TaskMode = TaskMode.COLOCATED  # what it serves its model as (prefill: prompts only)
    kv_address: str = ""  # a prefill TE's KV server, where decode TEs pull
    kv_import: bool = False  # its engine continues requests from imported KV (a decode side)
    lora: bool = False  # its engine serves requests under LoRA adapters
    adapters: frozenset[str] = frozenset()  # the adapters it holds loaded
    device: str = ""  # what its engine runs on ("cpu", "cuda:0"; "": not said)
    # KV its engine can still give new requests, in tokens: free blocks and evictable cached
    # ones, and those a pool sized by demand could still grow by (None: its engine does not
    # say)
    kv_free_tokens: int | None = None
    # Under a device KV budget: what its device's books have not given any pool (None: no
    # budget, or not known), and the floor its model's pool loads with (0: not known)
    device_kv_free_bytes: int | None = None
    kv_floor_bytes: int = 0

    @property
    def load(self) -> int:
        return self.running + self.waiting

    @property
    def serving(self) -> bool:
        """Ready, or becoming ready: counts as an instance of its model."""
        return self.model is not None and self.state in (TEState.READY, TEState.LOADING)


def te_view(hb: TEHeartbeat) -> TEView:
    return TEView(
        te_id=hb.te_id,
        pool_id=hb.pool_id,
        state=hb.state,
        model=hb.model,
        running=hb.running,
        waiting=hb.waiting,
        queued_prompt_tokens=hb.queued_prompt_tokens,
        queued_import_tokens=hb.queued_import_tokens,
        last_active=hb.last_active,
        reported_at=hb.sent_at,
        failed_model=hb.failed_model,
        error=hb.error,
        recent_models=tuple(hb.recent_models),
        capacity=hb.capacity,
        weight_server=hb.weight_server,
        cached_weights=hb.cached_weights,
        cache_free_bytes=hb.cache_free_bytes,
        weight_relay=hb.weight_relay,
        relay_address=hb.relay_address,
        shares=hb.shares,
        placements=hb.placements,
        role=hb.role,
        kv_address=hb.kv_address,
        kv_import=hb.engine_capabilities is not None and hb.engine_capabilities.kv_import,
        lora=hb.engine_capabilities is not None and hb.engine_capabilities.lora,
        adapters=frozenset(hb.adapters),
        device=hb.device or "",
        kv_free_tokens=(hb.free_kv_blocks + hb.growable_kv_blocks) * hb.kv_block_size
        if hb.kv_block_size and hb.total_kv_blocks
        else None,
        device_kv_free_bytes=hb.device_kv_free_bytes,
        kv_floor_bytes=hb.kv_floor_bytes,
    )
