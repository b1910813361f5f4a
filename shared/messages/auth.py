"""Messages about API keys."""

from __future__ import annotations

from shared.messages.base import Message


class KeyRevoked(Message):
    """An API key was revoked: every frontend forgets it now, not when its cache expires."""

    key_hash: str  # SHA-256 hex of the key
