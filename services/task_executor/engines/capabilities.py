"""What an engine can do beyond generating: one sub-protocol per capability, and the check,
made when a model loads, that every capability an engine declares is backed by its methods.

An engine declares its capabilities as data (``Engine.capabilities``, an
``EngineCapabilities``); ``bind_features`` checks the declaration against the sub-protocols
once and hands the TE typed handles (``EngineFeatures``), each the engine itself or None. The
TE uses those handles and never probes an engine for a method: a capability it was not
declared does not exist for it, and a declaration the engine cannot keep fails the load.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from services.task_executor.engines.base import Engine, EngineRequest
from shared.messages.kv import KvEvent
from shared.messages.scaling import InstanceCapacity
from shared.messages.tasks import TaskMode

if TYPE_CHECKING:
    import torch

    from services.task_executor.engines.torch_engine.kv_stream import KvSink
    from services.task_executor.engines.torch_engine.kv_transfer import KvExport, KvLayout


def check_role(engine: Engine, role: TaskMode) -> None:
    """An instance loaded as ``role`` runs that role's tasks: prefill tasks (``prefill``), or
    colocated and decode tasks (``colocated``, ``decode``); its engine must declare them."""
    modes = engine.capabilities.modes
    needs = (
        {role}
        if role == TaskMode.PREFILL
        else {TaskMode.COLOCATED} | ({TaskMode.DECODE} if role == TaskMode.DECODE else set())
    )
    if not needs <= modes:
        raise CapabilityError(
            f"the {engine.name} engine cannot serve as a {role} instance (it runs "
            f"{', '.join(sorted(modes))} tasks; an engine in a child process, vLLM or "
            "OpenVINO, hands no KV to another instance)"
        )


class CapabilityError(Exception):
    """An engine declares a capability it does not implement, or is asked for one it lacks."""


@runtime_checkable
class KvEventSource(Protocol):
    """``kv_events``: what entered and left the prefix cache, for a global prompt index."""

    block_size: int  # tokens per block: the granularity of the chained hashes

    def drain_kv_events(self) -> list[KvEvent]:
        """The events since the last call, in order (also after close, which clears the
        cache: the clearing events come out once)."""
        ...


@runtime_checkable
class KvExporter(Protocol):
    """``kv_export``: a request's KV leaves for another instance (PD: the prefill side)."""

    def add_request(
        self, request: EngineRequest, *, retain_kv: bool = False, kv_sink: KvSink | None = None
    ) -> None:
        """``retain_kv``: keep the request's KV after it finishes, for ``export_kv``;
        ``kv_sink``: stream the prompt's KV there, layer by layer, as it is computed."""
        ...

    def export_kv(
        self, request_id: str, *, release: bool = False, first_token: int = 0
    ) -> KvExport: ...

    @property
    def kv_layout(self) -> KvLayout:
        """One token's KV here (layers, KV heads, head dim, dtype)."""
        ...


@runtime_checkable
class KvImporter(Protocol):
    """``kv_import``: a request continues from KV computed elsewhere (PD: the decode side)."""

    model_fingerprint: str  # the weights' name: an import from other weights is refused

    def import_kv(self, export: KvExport, request: EngineRequest) -> None: ...

    def held_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """Leading tokens whose KV it holds already (an import brings only the rest)."""
        ...

    @property
    def kv_layout(self) -> KvLayout:
        """One token's KV here: what a pull of the rest of a prompt brings, per token."""
        ...


@runtime_checkable
class PrefixPinning(Protocol):
    """``prefix_pinning``: a prefix stays cached under a cache id (context caching)."""

    def pin_prefix(self, cache_id: str, token_ids: Sequence[int]) -> int: ...

    def unpin_prefix(self, cache_id: str) -> bool: ...

    def pinned_prefix(self, cache_id: str) -> tuple[list[int], int] | None: ...


@runtime_checkable
class HostKvTier(Protocol):
    """``host_kv_tier``: cached blocks move to host memory and back."""

    def offload_kv(self, block_hashes: Sequence[int]) -> int: ...

    def populate_kv(self, block_hashes: Sequence[int]) -> int: ...


@runtime_checkable
class PrefillPacing(Protocol):
    """``prefill_pacing``: each iteration's prompt tokens are sized from the engine's measured
    costs, so running decodes keep a TPOT target and prompts take the rest."""

    def pace_prefill(
        self,
        capacity: InstanceCapacity,
        tpot_s: float,
        *,
        ttft_s: float = 0.0,
        ttft_per_token_s: float = 0.0,
    ) -> None:
        """From now on, pace with these costs (the instance's measured capacity) and keep
        iterations with decodes under ``tpot_s``; with ``ttft_s``, prompts go by the deadline
        of their TTFT target, ``max(ttft_s, tokens * ttft_per_token_s)`` after arrival."""
        ...

    @property
    def late_yield_s(self) -> float:
        """Prompts late by less than this go behind every prompt still in time
        (``shared.headroom.yields``; 0: none do, or prompts have no deadlines yet): the TE
        claims its device's turns as its engine will serve them."""
        ...


@runtime_checkable
class LoraServing(Protocol):
    """``lora``: requests run under LoRA adapters (``EngineRequest.adapter``) the engine loads
    by name; many adapters, and the base model, share one batch."""

    def load_adapter(self, name: str, path: str) -> None:
        """Serve the peft LoRA adapter in directory ``path`` as ``name`` (idempotent).
        ValueError for an adapter the engine cannot serve, OSError for unreadable files."""
        ...

    def unload_adapter(self, name: str) -> bool:
        """Stop serving ``name``; False if it was not loaded. ValueError while requests use it."""
        ...

    def pin_adapter(self, name: str, pinned: bool) -> None:
        """A pinned adapter keeps its device slot once it has one."""
        ...

    def adapters(self) -> list[str]:
        """The adapters in device slots now."""
        ...


class TensorSource(Protocol):
    """``weight_source``: named tensors an engine builds its weights from instead of reading
    the checkpoint itself (a checkpoint's safetensors files, or a host cache holding them).
    Names and layouts are the checkpoint's (Hugging Face names)."""

    def names(self) -> Iterable[str]: ...

    def __contains__(self, name: object) -> bool: ...

    def get(self, name: str) -> torch.Tensor: ...


@runtime_checkable
class KvResizer(Protocol):
    """``kv_resize``: the KV pool follows demand (LLM-Mesh; the sizes from
    ``task_executor/kv_sizing.py``): a shrink gives its memory back to the device."""

    block_size: int  # tokens a block holds

    def resize_kv(self, blocks: int) -> int:
        """Use ``blocks`` blocks from now, at most what was allocated at load and no fewer
        than the blocks in use need (cached prefixes above the new size are evicted).
        Returns the size it has now."""
        ...

    @property
    def kv_blocks(self) -> tuple[int, int]:
        """(blocks it may use now, blocks it could grow to)."""
        ...

    @property
    def kv_block_bytes(self) -> int:
        """Memory one block takes (every layer's K and V): what a resize frees or needs."""
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class EngineFeatures:
    """The capabilities of one loaded engine, as typed handles (None: not declared)."""

    kv_events: KvEventSource | None = None
    kv_export: KvExporter | None = None
    kv_import: KvImporter | None = None
    prefix_pinning: PrefixPinning | None = None
    host_kv_tier: HostKvTier | None = None
    prefill_pacing: PrefillPacing | None = None
    lora: LoraServing | None = None
    kv_resize: KvResizer | None = None


def bind_features(engine: Engine) -> EngineFeatures:
    """Check the engine's declared capabilities against its methods (CapabilityError for a
    declaration it cannot keep) and return the handles for those it declares."""
    caps = engine.capabilities
    if caps.kv_events and not caps.prefix_cache:
        raise CapabilityError(f"the {engine.name} engine declares kv_events without prefix_cache")
    # A prefill task hands its KV on; a decode task continues from KV it is handed.
    if TaskMode.PREFILL in caps.modes and not caps.kv_export:
        raise CapabilityError(f"the {engine.name} engine declares prefill without kv_export")
    if TaskMode.DECODE in caps.modes and not caps.kv_import:
        raise CapabilityError(f"the {engine.name} engine declares decode without kv_import")
    # What the engine implements, then what it offers: both, or it does not load.
    implemented = EngineFeatures(
        kv_events=engine if isinstance(engine, KvEventSource) else None,
        kv_export=engine if isinstance(engine, KvExporter) else None,
        kv_import=engine if isinstance(engine, KvImporter) else None,
        prefix_pinning=engine if isinstance(engine, PrefixPinning) else None,
        host_kv_tier=engine if isinstance(engine, HostKvTier) else None,
        prefill_pacing=engine if isinstance(engine, PrefillPacing) else None,
        lora=engine if isinstance(engine, LoraServing) else None,
        kv_resize=engine if isinstance(engine, KvResizer) else None,
    )
    checks: tuple[tuple[str, bool, object, type], ...] = (
        ("kv_events", caps.kv_events, implemented.kv_events, KvEventSource),
        ("kv_export", caps.kv_export, implemented.kv_export, KvExporter),
        ("kv_import", caps.kv_import, implemented.kv_import, KvImporter),
        ("prefix_pinning", caps.prefix_pinning, implemented.prefix_pinning, PrefixPinning),
        ("host_kv_tier", caps.host_kv_tier, implemented.host_kv_tier, HostKvTier),
        ("prefill_pacing", caps.prefill_pacing, implemented.prefill_pacing, PrefillPacing),
        ("lora", caps.lora, implemented.lora, LoraServing),
        ("kv_resize", caps.kv_resize, implemented.kv_resize, KvResizer),
    )
    for flag, declared, handle, protocol in checks:
        if declared and handle is None:
            raise CapabilityError(
                f"the {engine.name} engine declares {flag} but does not implement "
                f"{protocol.__name__}"
            )
    return dataclasses.replace(
        implemented, **{flag: None for flag, declared, _, _ in checks if not declared}
    )
