"""Scaling demands and the commands that load, unload and drain task executors."""

from __future__ import annotations

from shared.messages.base import Message


class ScaleUp(Message):
    """A JE holds jobs for a model that has no instance able to take them."""

    model: str
    waiting: int = 1
    je_id: str = ""


class LoadModel(Message):
    model: str
    path: str


class UnloadModel(Message):
    reason: str = ""


class Drain(Message):
    """Finish running requests, accept no new ones, then exit."""


class ControlAck(Message):
    te_id: str
    ok: bool
    error: str | None = None
