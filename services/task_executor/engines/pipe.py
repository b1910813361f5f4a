"""The wire of an engine's child process (``process.py``): calls from the TE, replies from the
child, msgspec Structs encoded with msgpack. Nothing is pickled: the engine's factory is named
by import path and plain arguments, errors cross as their type name and message.

This module imports only msgspec and the protocol's types: it runs in the child, whose
interpreter may be another venv's (vLLM's CPU build) that has none of the TE's packages."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from services.task_executor.engines.base import (
    Engine,
    EngineCapabilities,
    EngineOutput,
    EngineRequest,
    EngineStats,
    PrefillBudget,
)
from shared.messages.kv import KvEvent


class FactorySpec(msgspec.Struct, kw_only=True):
    """How the child builds its engine: ``target`` ("package.module:Qualified.name") called
    with ``args`` and ``kwargs`` (plain values: paths travel as strings)."""

    target: str
    args: list[Any] = msgspec.field(default_factory=list)
    kwargs: dict[str, Any] = msgspec.field(default_factory=dict)

    @classmethod
    def of(cls, factory: Callable[..., Engine], *args: Any, **kwargs: Any) -> FactorySpec:
        """The spec of a module-level class or function (or a ``functools.partial`` of one)
        called with these arguments."""
        while isinstance(factory, functools.partial):
            args, kwargs = (*factory.args, *args), {**factory.keywords, **kwargs}
            factory = factory.func
        qualname = getattr(factory, "__qualname__", "")
        if not qualname or "<" in qualname:
            raise TypeError(f"{factory!r} is not importable by name (a module-level callable)")
        return cls(
            target=f"{factory.__module__}:{qualname}",
            args=[_plain(a) for a in args],
            kwargs={k: _plain(v) for k, v in kwargs.items()},
        )

    def build(self) -> Engine:
        module, _, qualname = self.target.partition(":")
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        engine: Engine = obj(*self.args, **self.kwargs)
        return engine


def _plain(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else value


# --- calls (TE -> child) ----------------------------------------------------------------------


class Build(msgspec.Struct, tag=True, kw_only=True):
    factory: FactorySpec


class AddRequest(msgspec.Struct, tag=True, kw_only=True):
    request: EngineRequest


class Abort(msgspec.Struct, tag=True, kw_only=True):
    request_id: str


class Step(msgspec.Struct, tag=True):
    pass


class DrainKvEvents(msgspec.Struct, tag=True):
    pass


class Close(msgspec.Struct, tag=True):
    """Close the engine; the reply carries the events closing produced, then the child exits."""


class LoadAdapter(msgspec.Struct, tag=True, kw_only=True):
    """``LoraServing.load_adapter``: serve the peft adapter in directory ``path`` as ``name``."""

    name: str
    path: str


class UnloadAdapter(msgspec.Struct, tag=True, kw_only=True):
    """``LoraServing.unload_adapter``; answered with ``Unloaded``."""

    name: str


class PinAdapter(msgspec.Struct, tag=True, kw_only=True):
    """``LoraServing.pin_adapter``."""

    name: str
    pinned: bool


Call = (
    Build
    | AddRequest
    | Abort
    | Step
    | DrainKvEvents
    | Close
    | LoadAdapter
    | UnloadAdapter
    | PinAdapter
)


# --- results (child -> TE) --------------------------------------------------------------------


class Built(msgspec.Struct, tag=True, kw_only=True):
    """What the TE mirrors of the engine built."""

    name: str
    device: str
    max_model_len: int
    capabilities: EngineCapabilities
    prefill_budget: PrefillBudget
    block_size: int = 0  # of its KV events; 0 where it declares none


class Done(msgspec.Struct, tag=True):
    pass


class Outputs(msgspec.Struct, tag=True, kw_only=True):
    outputs: list[EngineOutput]


class Events(msgspec.Struct, tag=True, kw_only=True):
    events: list[KvEvent]


class Unloaded(msgspec.Struct, tag=True, kw_only=True):
    found: bool  # whether the adapter was loaded


# Exceptions the TE tells apart (a refused prompt is a ValueError: the client's error) are
# raised again as their own type; any other arrives as an EngineError naming it.
_REBUILT: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        ValueError,
        KeyError,
        TypeError,
        RuntimeError,
        NotImplementedError,
        MemoryError,
        OSError,
        FileNotFoundError,
        ImportError,
        ModuleNotFoundError,
    )
}


class EngineError(RuntimeError):
    """An error of the engine in the child process, of a type not rebuilt here."""


class Failed(msgspec.Struct, tag=True, kw_only=True):
    kind: str  # the exception's class name
    message: str
    traceback: str = ""

    @classmethod
    def of(cls, e: BaseException) -> Failed:
        import traceback

        message = str(e.args[0]) if len(e.args) == 1 else str(e)
        return cls(
            kind=type(e).__name__, message=message, traceback="".join(traceback.format_exception(e))
        )

    def exception(self) -> Exception:
        cls = _REBUILT.get(self.kind)
        e = cls(self.message) if cls is not None else EngineError(f"{self.kind}: {self.message}")
        if self.traceback:
            e.add_note(f"in the engine process:\n{self.traceback}")
        return e


Result = Built | Done | Outputs | Events | Unloaded | Failed


class Reply(msgspec.Struct, kw_only=True):
    """Every reply also carries the engine's load after the call, and the LoRA adapters it
    holds (where it serves them), which the parent mirrors."""

    result: Result
    stats: EngineStats
    has_work: bool
    adapters: list[str] = msgspec.field(default_factory=list)


_encoder = msgspec.msgpack.Encoder()
_calls = msgspec.msgpack.Decoder(Call)
_replies = msgspec.msgpack.Decoder(Reply)


def encode(msg: Call | Reply) -> bytes:
    return _encoder.encode(msg)


def decode_call(data: bytes) -> Call:
    call: Call = _calls.decode(data)
    return call


def decode_reply(data: bytes) -> Reply:
    return _replies.decode(data)
