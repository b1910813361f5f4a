"""Membership policy, pure: which members are dead, and which heartbeat changes the view."""

from __future__ import annotations

from collections.abc import Mapping

from shared.messages.cluster import FEHeartbeat, JEHeartbeat, TEHeartbeat

Member = TEHeartbeat | JEHeartbeat | FEHeartbeat


def expired(last_seen: Mapping[str, float], *, now: float, timeout: float) -> list[str]:
    """Members silent for longer than the liveness timeout."""
    return sorted(mid for mid, seen in last_seen.items() if now - seen > timeout)


def identity(m: Member) -> tuple[object, ...]:
    """The part of a heartbeat whose change must reach JEs at once. Load figures change
    every beat and go out with the periodic view instead."""
    if isinstance(m, TEHeartbeat):
        return (m.state, m.model, m.engine, m.device, m.max_model_len, m.error, m.pool_id)
    return ("je",) if isinstance(m, JEHeartbeat) else ("frontend",)


def member_id(m: Member) -> str:
    if isinstance(m, TEHeartbeat):
        return m.te_id
    return m.je_id if isinstance(m, JEHeartbeat) else m.frontend_id
