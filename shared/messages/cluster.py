"""Membership, health and the cluster view the cluster manager pushes to everybody."""

from __future__ import annotations

import enum

import msgspec

from shared.messages.base import Message
from shared.messages.scaling import InstanceCapacity
from shared.messages.tasks import TaskMode


class TEState(enum.StrEnum):
    IDLE = "idle"  # pre-warmed, no model: the scaler may assign one
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"  # finishing its requests, takes no new ones
    PRELOADING = "preloading"  # no model: putting one's weights into its host's cache
    TRAINING = "training"  # no model: running a stage of a fine-tuning job


class EngineCapabilities(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What an engine can do beyond generating, as it declares it. Each flag but
    ``prefix_cache`` promises the methods of one sub-protocol
    (``services/task_executor/engines/capabilities.py``), checked when a model loads; the TE
    reports the flags in its heartbeat, so routers and the scaler read them from the view."""

    modes: frozenset[TaskMode] = frozenset({TaskMode.COLOCATED})
    prefix_cache: bool = False  # reuses the KV of cached prompt prefixes (reports cached tokens)
    kv_events: bool = False  # publishes what enters and leaves its prefix cache (KvEventSource)
    kv_export: bool = False  # hands a request's KV to another instance (KvExporter)
    kv_import: bool = False  # continues a request from another instance's KV (KvImporter)
    prefix_pinning: bool = False  # keeps a prefix cached under a cache id (PrefixPinning)
    host_kv_tier: bool = False  # moves cached blocks to host memory and back (HostKvTier)
    weight_source: bool = False  # builds from weights handed to it (a TensorSource)
    prefill_pacing: bool = False  # sizes each iteration's prompt tokens from its costs
    lora: bool = False  # serves requests under LoRA adapters it loads (LoraServing)
    kv_resize: bool = False  # its KV pool grows and shrinks, memory with it (KvResizer)


class CachedWeights(msgspec.Struct, frozen=True):
    """How much of a model's weights a host's weight cache holds (Tangram's S_resident of S)."""

    resident_bytes: int
    total_bytes: int


class JobShare(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The part of a TE's work that one job executor placed, as the TE counts it."""

    sequences: int = 0  # accepted, not ended (queued, prefilling or decoding)
    decoding: int = 0  # of those, past their first token
    prefill_tokens: int = 0  # prompt tokens of the others, less the prefix expected cached
    # PD, a decode TE: prompt tokens whose KV a prefill TE computed and this TE has yet to
    # take in (it will allocate KV for them)
    import_tokens: int = 0
    oldest: int = 0  # the TE's number (TaskAccepted.seq) of the oldest it holds; 0: none


class TEHeartbeat(Message):
    te_id: str
    pool_id: str
    host: str
    pid: int
    state: TEState
    started_at: float
    model: str | None = None
    engine: str | None = None
    device: str | None = None
    max_model_len: int = 0
    running: int = 0
    waiting: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    kv_block_size: int = 0  # tokens a KV block holds (0: not said)
    # blocks its KV pool, sized by demand (MESHSERVE_KV_SIZING), could still grow by: up to
    # what its engine allocated, as far as its device's KV budget has room
    growable_kv_blocks: int = 0
    # Under a device KV budget (MESHSERVE_DEVICE_KV_BYTES): what its device's books have not
    # given any pool (None: no budget, or not heard yet), and the floor of the loaded
    # model's pool (what a load of it waits for room for; 0: not known)
    device_kv_free_bytes: int | None = None
    kv_floor_bytes: int = 0
    last_active: float = 0.0  # unix seconds of the last task accepted or token produced
    error: str | None = None  # why the last load failed
    sent_at: float = 0.0  # unix seconds; load reported here includes tasks placed before it
    failed_model: str | None = None  # the model whose last load failed (see error)
    generated_tokens: int = 0  # tokens this TE has produced since it started
    engine_capabilities: EngineCapabilities | None = None  # of the loaded engine; None if idle
    # prompt tokens of accepted requests not yet prefilled, less the prefixes the router
    # expected in the prefix cache (ChatTask.matched_tokens)
    queued_prompt_tokens: int = 0
    queued_import_tokens: int = 0  # PD: prompt tokens whose KV it has yet to take in
    recent_models: list[str] = msgspec.field(
        default_factory=list
    )  # loaded here before, newest first
    capacity: InstanceCapacity | None = (
        None  # of the loaded model here, as the load measured or got it
    )
    load_steps: dict[str, float] = msgspec.field(default_factory=dict)  # of the last load, seconds
    ready_at: float = 0.0  # unix seconds the loaded model turned ready
    engine_reason: str = ""  # why this engine (engines/choice.py): for the loaded model, or any
    # host:port of this host's weight server (the node pool's), where others can fork from
    weight_server: str = ""
    # what this host's weight cache holds, by model (those loaded on the host before)
    cached_weights: dict[str, CachedWeights] = msgspec.field(default_factory=dict)
    cache_free_bytes: int = 0  # room left in its host's weight cache (0: none, or no cache)
    weight_relay: str = ""  # host:port where its host's weight server sends multicasts from
    relay_address: str = ""  # host:port where this TE receives a multicast
    # its work by the job executor that placed it (JobShare), and how many placements it had
    # taken when it counted it (TaskAccepted.seq of the last)
    shares: dict[str, JobShare] = msgspec.field(default_factory=dict)
    placements: int = 0
    role: TaskMode = TaskMode.COLOCATED  # what it loaded its model as (LoadModel.role)
    kv_address: str = ""  # host:port of its KV server (a prefill TE): decode TEs pull there
    # Prompt KV leases it held for decode TEs that ended, by how (released, rejected,
    # disconnected, expired, cancelled, failed, closed), since it started: the frontend
    # exports the growth.
    kv_lease_ends: dict[str, int] = msgspec.field(default_factory=dict)
    # A training TE: the fine-tuning stage it runs (``job/attempt``, training.runner)
    training: str = ""
    # The LoRA adapters its engine holds loaded (routing prefers a TE that holds a request's)
    adapters: list[str] = msgspec.field(default_factory=list)
    # Its prefix cache since it loaded its model: prompt tokens looked up, and found there
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class JEHeartbeat(Message):
    je_id: str
    host: str
    pid: int
    started_at: float
    inflight: int = 0


class FEHeartbeat(Message):
    """A frontend is alive. TEs stop the generations of a frontend declared gone: nobody
    would read their tokens."""

    frontend_id: str
    host: str
    pid: int
    started_at: float
    streams: int = 0  # requests it is answering now


class Leave(Message):
    """Sent by a member that shuts down cleanly, so the view changes without waiting for
    the liveness deadline."""

    member_id: str


class MemberDown(Message):
    """Published by the cluster manager when it declares a member gone (silent past the
    liveness deadline, or left): whoever depends on it moves on at once."""

    member_id: str
    reason: str = ""


class ModelInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: str
    path: str
    architecture: str
    max_context: int
    created: int
    owned_by: str = "meshserve"


class GetView(Message):
    pass


class ClusterView(Message):
    """The whole cluster as the cluster manager sees it. version grows on every change."""

    cluster: str
    version: int
    generated_at: float
    tes: list[TEHeartbeat] = msgspec.field(default_factory=list)
    jes: list[JEHeartbeat] = msgspec.field(default_factory=list)
    frontends: list[FEHeartbeat] = msgspec.field(default_factory=list)
    models: list[ModelInfo] = msgspec.field(default_factory=list)
