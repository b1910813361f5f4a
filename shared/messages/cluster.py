"""Membership, health and the cluster view the cluster manager pushes to everybody."""

from __future__ import annotations

import enum

import msgspec

from shared.messages.base import Message


class TEState(enum.StrEnum):
    IDLE = "idle"  # pre-warmed, no model: the scaler may assign one
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"  # finishing its requests, takes no new ones


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
    capabilities: list[str] = msgspec.field(default_factory=list)
    max_model_len: int = 0
    running: int = 0
    waiting: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    last_active: float = 0.0  # unix seconds of the last task accepted or token produced
    error: str | None = None  # why the last load failed
    sent_at: float = 0.0  # unix seconds; load reported here includes tasks placed before it
    failed_model: str | None = None  # the model whose last load failed (see error)
    generated_tokens: int = 0  # tokens this TE has produced since it started


class JEHeartbeat(Message):
    je_id: str
    host: str
    pid: int
    started_at: float
    inflight: int = 0


class Leave(Message):
    """Sent by a member that shuts down cleanly, so the view changes without waiting for
    the liveness deadline."""

    member_id: str


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
    models: list[ModelInfo] = msgspec.field(default_factory=list)
