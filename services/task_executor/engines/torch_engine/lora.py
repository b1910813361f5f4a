"""Batched multi-LoRA serving: many peft LoRA adapters of one model in one batch, each request
under its own adapter or none (after S-LoRA and Punica, in one masked product).

An adapter is a peft checkpoint (``adapter_config.json`` + ``adapter_model.safetensors``) whose
LoRA targets any of the projections in ``PROJECTIONS``; its delta on a projection is
``x @ A.T @ B.T * scale`` (``scale = lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA).

Three tiers, so that serving one more adapter costs a copy, not a file read:
- the adapters the engine serves (``LoraAdapters.register``: a name and its directory);
- a host-memory LRU of read adapters (``max_host_adapters``), stacked over layers in the
  model's dtype with the scale folded into B (``HostAdapter``);
- ``max_adapters`` device slots (``AdapterSlots``), least recently used first out, never one
  a running request uses, never a pinned one.

The layout makes a whole batch two products per fused matrix of the engine (``weights.py``:
``qkv``, ``o``, ``gate_up``, ``down``). On a fused matrix an adapter is one LoRA whose rank is
the sum of its projections' ranks: ``A`` stacks their A's, ``B`` puts each one's scaled
``B.T`` in that projection's output columns (zero in the others'). Per fused matrix and layer
the slots are stacked into ``A`` ``[cap * S, in]`` and ``B`` ``[cap * S, out]`` (S slots,
``cap`` the largest such rank loaded so far), rank-major: row ``j * S + s`` is row ``j`` of
slot ``s``, zero past its adapter's rank. A forward whose adapters reach rank ``r`` there
computes, for all its tokens at once, ``out += ((x @ A[:r*S].T) * mask[:, :r*S]) @ B[:r*S]``,
where ``mask`` (built once per forward) keeps each token's own slot's columns (none for a
token without an adapter). Rows past ``r * S`` are never read, so a larger ``max_rank`` costs
nothing until an adapter that large is loaded. On CPU a decode step's small products cost
their launch more than their bytes: two per fused matrix, not two per projection (measured on
the bench model, bf16, 2 cores: q/k/v's deltas 114 against 195 us a layer). A batch in which no
request has an adapter computes nothing here (``ForwardBatch.lora`` is None).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import xxhash
from safetensors.torch import load as load_safetensors

from services.task_executor.engines.torch_engine.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# peft's LoRA options the engine cannot serve: a set one refuses the adapter (ValueError).
_REFUSED_OPTIONS = (
    "use_dora",
    "lora_bias",
    "fan_in_fan_out",
    "modules_to_save",
    "trainable_token_indices",
    "layer_replication",
    "rank_pattern",
    "alpha_pattern",
    "target_parameters",
    "alora_invocation_tokens",
    "use_qalora",
    "use_bdlora",
)
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)


@dataclasses.dataclass(frozen=True, slots=True)
class LoraLimits:
    """How many adapters an engine keeps where (``shared.settings.LoraSettings``)."""

    max_adapters: int = 8  # device slots: adapters a single batch may mix
    max_host_adapters: int = 32  # read adapters kept in host memory
    max_rank: int = 64  # the largest rank served

    def __post_init__(self) -> None:
        if self.max_adapters < 1 or self.max_host_adapters < 1 or self.max_rank < 1:
            raise ValueError("LoRA limits must be at least 1")


@dataclasses.dataclass(frozen=True, slots=True)
class Projection:
    """One LoRA-able projection as the engine's fused weights lay it out (``weights.py``)."""

    name: str  # peft's module name: "q_proj"
    module: str  # where it sits in a layer: "self_attn" or "mlp"
    group: str  # the fused matrix it is part of: "qkv", "o", "gate_up", "down"
    offset: int  # its first output column in that matrix
    in_dim: int
    out_dim: int


@dataclasses.dataclass(frozen=True, slots=True)
class Group:
    """A fused matrix of the engine, as LoRA sees it: its input and output widths and the
    projections it holds, in order."""

    name: str
    in_dim: int
    out_dim: int
    members: tuple[Projection, ...]


def groups(cfg: ModelConfig) -> dict[str, Group]:
    """The fused matrices adapters may reach, by ``LayerWeights`` field name."""
    by_group: dict[str, list[Projection]] = {}
    for p in projections(cfg).values():
        by_group.setdefault(p.group, []).append(p)
    return {
        name: Group(name, ps[0].in_dim, ps[-1].offset + ps[-1].out_dim, tuple(ps))
        for name, ps in by_group.items()
    }


def projections(cfg: ModelConfig) -> dict[str, Projection]:
    """The projections an adapter may target, by peft module name, in ``LayerWeights``' layout:
    ``qkv`` = [q; k; v], ``gate_up`` = [gate; up]."""
    h, q, kv, inter = (
        cfg.hidden_size,
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.intermediate_size,
    )
    specs = (
        ("q_proj", "self_attn", "qkv", 0, h, q),
        ("k_proj", "self_attn", "qkv", q, h, kv),
        ("v_proj", "self_attn", "qkv", q + kv, h, kv),
        ("o_proj", "self_attn", "o", 0, q, h),
        ("gate_proj", "mlp", "gate_up", 0, h, inter),
        ("up_proj", "mlp", "gate_up", inter, h, inter),
        ("down_proj", "mlp", "down", 0, inter, h),
    )
    return {s[0]: Projection(*s) for s in specs}


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# --- one adapter, read ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class HostAdapter:
    """An adapter as read into host memory: per fused matrix it reaches (``Group``), ``A``
    ``[layers, rank, in]`` and ``B`` ``[layers, rank, out]``, ``rank`` the sum of its
    projections' there (each ``lora_B`` transposed into its projection's columns, the scale
    folded in; zero in layers it leaves alone), in the model's dtype."""

    name: str
    digest: str  # of its files: one name always means the same weights here
    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]

    def rank(self, group: str) -> int:
        pair = self.weights.get(group)
        return 0 if pair is None else pair[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.weights.values() for t in pair)


def read_adapter(
    name: str,
    path: Path | str,
    cfg: ModelConfig,
    *,
    dtype: torch.dtype,
    max_rank: int,
) -> HostAdapter:
    """Read and check a peft LoRA adapter of the model ``cfg`` describes. ValueError for one
    the engine cannot serve (other modules, DoRA, biases, a rank over ``max_rank``, shapes
    of another model); OSError for unreadable files."""
    path = Path(path)
    raw_config = (path / CONFIG_FILE).read_bytes()
    raw_weights = (path / WEIGHTS_FILE).read_bytes()
    config: dict[str, Any] = json.loads(raw_config)
    _check_config(name, config)
    scale_of = _scales(config)
    projs = projections(cfg)
    found: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    for key, tensor in load_safetensors(raw_weights).items():
        m = _KEY.match(key)
        if m is None:
            raise ValueError(
                f"adapter {name!r}: tensor {key!r} is not a LoRA weight of {PROJECTIONS}"
            )
        layer, module, proj, ab = int(m[1]), m[2], m[3], m[4]
        if proj not in projs or projs[proj].module != module:
            raise ValueError(
                f"adapter {name!r} targets {module}.{proj}: the torch engine serves LoRA on "
                f"{', '.join(PROJECTIONS)} only"
            )
        if layer >= cfg.num_layers:
            raise ValueError(f"adapter {name!r} has layer {layer}; the model has {cfg.num_layers}")
        found.setdefault((proj, layer), {})[ab] = tensor
    if not found:
        raise ValueError(f"adapter {name!r} has no LoRA weights")
    ranks: dict[str, int] = {}
    for (proj, layer), pair in found.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"adapter {name!r}: layer {layer} {proj} lacks lora_A or lora_B")
        p, a, b = projs[proj], pair["A"], pair["B"]
        r = a.shape[0]
        if a.shape != (r, p.in_dim) or b.shape != (p.out_dim, r):
            raise ValueError(
                f"adapter {name!r}: layer {layer} {proj} has A {tuple(a.shape)}, B "
                f"{tuple(b.shape)}; this model needs [r, {p.in_dim}] and [{p.out_dim}, r]"
            )
        if ranks.setdefault(proj, r) != r:
            raise ValueError(f"adapter {name!r}: {proj} has different ranks in different layers")
        if r > max_rank:
            raise ValueError(f"adapter {name!r} has rank {r}; this engine serves up to {max_rank}")
    weights = {}
    for g in groups(cfg).values():
        targeted = [p for p in g.members if p.name in ranks]
        if not targeted:
            continue
        total = sum(ranks[p.name] for p in targeted)
        a_all = torch.zeros(cfg.num_layers, total, g.in_dim, dtype=dtype)
        b_all = torch.zeros(cfg.num_layers, total, g.out_dim, dtype=dtype)
        row = 0
        for p in targeted:
            r = ranks[p.name]
            for layer in range(cfg.num_layers):
                ab = found.get((p.name, layer))
                if ab is None:
                    continue
                a_all[layer, row : row + r] = ab["A"].to(dtype)
                # Scaled in float32, then cast: the merged reference's rounding, near enough.
                b = ab["B"].float().T * scale_of(r)
                b_all[layer, row : row + r, p.offset : p.offset + p.out_dim] = b.to(dtype)
            row += r
        weights[g.name] = (a_all, b_all)
    digest = xxhash.xxh3_64_hexdigest(raw_config + raw_weights)
    return HostAdapter(name=name, digest=digest, weights=weights)


def _check_config(name: str, config: Mapping[str, Any]) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {name!r} is a {config.get('peft_type')} adapter, not LoRA")
    refused = [k for k in _REFUSED_OPTIONS if config.get(k)]
    if config.get("bias", "none") != "none":
        refused.append("bias")
    if refused:
        raise ValueError(
            f"adapter {name!r} uses {', '.join(refused)}, which the engine cannot serve"
        )
    targets = config.get("target_modules")
    if isinstance(targets, list):  # a string is a regex: the tensors' names are checked instead
        bad = sorted(set(targets) - set(PROJECTIONS))
        if bad:
            raise ValueError(
                f"adapter {name!r} targets {', '.join(bad)}: the torch engine serves LoRA on "
                f"{', '.join(PROJECTIONS)} only"
            )


def _scales(config: Mapping[str, Any]) -> Callable[[int], float]:
    alpha = float(config.get("lora_alpha", config.get("r", 8)))
    rslora = bool(config.get("use_rslora"))

    def scale(r: int) -> float:
        return alpha / math.sqrt(r) if rslora else alpha / r

    return scale


# --- the device slots -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class LoraSelection:
    """Which adapter each token of a forward runs under (``model.build_batch``)."""

    token_slots: torch.Tensor  # [T] on the device: each token's slot, -1 for none
    slots: tuple[int, ...]  # the slots the batch uses, ascending


class LoraPlan:
    """One forward's share of the slots: the token mask, built once, and how many stacked rows
    of each fused matrix it reads (``r * S``, ``r`` the largest rank of the batch's adapters
    there; a matrix none of them reaches is not in ``rows``)."""

    def __init__(self, slots: AdapterSlots, mask: torch.Tensor, rows: dict[str, int]) -> None:
        self._slots = slots
        self._mask = mask
        self._rows = rows

    def add(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out += delta`` in place: ``out`` is fused matrix ``group``'s output for ``x``."""
        n = self._rows.get(group)
        if n is None:
            return
        y = F.linear(x, self._slots.a[group][layer, :n])
        y.mul_(self._mask[:, :n])
        out.addmm_(y, self._slots.b[group][layer, :n])


class AdapterSlots:
    """``max_adapters`` adapters on the device, stacked per fused matrix and layer (the
    module's docstring). A matrix's tensors exist once an adapter reaches it, as deep as the
    largest rank loaded there so far."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_slots: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.groups = groups(cfg)
        self.num_layers = cfg.num_layers
        self.num_slots = num_slots
        self.dtype = dtype
        self.device = device
        self.a: dict[str, torch.Tensor] = {}  # group -> [layers, cap * S, in]
        self.b: dict[str, torch.Tensor] = {}  # group -> [layers, cap * S, out]
        self.ranks: dict[str, list[int]] = {}  # group -> each slot's rank there (0: none)
        self._arange = torch.arange(num_slots, device=device)

    def capacity(self, group: str) -> int:
        t = self.a.get(group)
        return 0 if t is None else t.shape[1] // self.num_slots

    def write(self, slot: int, adapter: HostAdapter | None) -> None:
        """Put ``adapter`` into ``slot`` (None: empty it): its rows, zero past its rank, and
        zero rows for the fused matrices it leaves alone."""
        s, n = slot, self.num_slots
        for name in dict.fromkeys([*self.a, *(adapter.weights if adapter else ())]):
            pair = adapter.weights.get(name) if adapter else None
            r = 0 if pair is None else pair[0].shape[1]
            if r > self.capacity(name):
                self._grow(name, r)
            cap = self.capacity(name)
            a = self.a[name].view(self.num_layers, cap, n, -1)
            b = self.b[name].view(self.num_layers, cap, n, -1)
            old = self.ranks[name][s]
            if pair is not None:
                a[:, :r, s].copy_(pair[0])
                b[:, :r, s].copy_(pair[1])
            if old > r:  # what the previous occupant left past this one's rank
                a[:, r:old, s].zero_()
                b[:, r:old, s].zero_()
            self.ranks[name][s] = r

    def plan(self, selection: LoraSelection) -> LoraPlan:
        """What a forward under ``selection`` computes: the mask ``[T, r * S]`` (a one-hot of
        each token's slot, repeated for each rank), and each fused matrix's rows."""
        rows: dict[str, int] = {}
        for name, ranks in self.ranks.items():
            r = max(ranks[s] for s in selection.slots)
            if r:
                rows[name] = r * self.num_slots
        one_hot = (selection.token_slots[:, None] == self._arange[None, :]).to(self.dtype)
        widest = max(rows.values(), default=0) // self.num_slots
        return LoraPlan(self, one_hot.repeat(1, widest), rows)

    def _grow(self, name: str, rank: int) -> None:
        """Room for rank ``rank`` on fused matrix ``name``: rank-major rows keep their place."""
        p, n, layers = self.groups[name], self.num_slots, self.num_layers
        kept = self.capacity(name) * n
        a = torch.zeros(layers, rank * n, p.in_dim, dtype=self.dtype, device=self.device)
        b = torch.zeros(layers, rank * n, p.out_dim, dtype=self.dtype, device=self.device)
        if kept:
            a[:, :kept].copy_(self.a[name])
            b[:, :kept].copy_(self.b[name])
        self.a[name], self.b[name] = a, b
        self.ranks.setdefault(name, [0] * n)


# --- which adapters are where ---------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class LoraStats:
    """What serving adapters cost so far (cumulative)."""

    reads: int = 0  # adapters read from their files
    read_s: float = 0.0
    installs: int = 0  # adapters copied into a device slot
    install_s: float = 0.0
    evictions: int = 0  # device slots given to another adapter


@dataclasses.dataclass(frozen=True, slots=True)
class _Source:
    path: Path
    digest: str


class LoraAdapters:
    """The adapters an engine serves (name -> directory), the host LRU of read ones, and the
    device slots with their LRU order and pins. Touched by the engine's thread only; slots are
    written only while no forward runs (``acquire``, from the engine's ``_schedule``)."""

    def __init__(
        self,
        cfg: ModelConfig,
        limits: LoraLimits,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.limits = limits
        self._cfg = cfg
        self._dtype = dtype
        self.slots = AdapterSlots(cfg, limits.max_adapters, dtype=dtype, device=device)
        self._sources: dict[str, _Source] = {}
        self._digests: dict[str, str] = {}  # every name served since the engine started
        self._host: collections.OrderedDict[str, HostAdapter] = collections.OrderedDict()
        self._slot_names: list[str | None] = [None] * limits.max_adapters
        self._slot_of: dict[str, int] = {}
        self._lru: collections.OrderedDict[str, None] = collections.OrderedDict()  # in slots
        self._pinned: set[str] = set()
        self.stats = LoraStats()

    def __contains__(self, name: object) -> bool:
        return name in self._sources

    def __len__(self) -> int:
        return len(self._sources)

    def register(self, name: str, path: Path | str) -> None:
        """Serve ``name`` from ``path`` (read now into the host LRU: a bad adapter fails
        here). Idempotent; a name this engine served with other weights is refused, since
        KV cached under it would be reused for the new ones."""
        if not name:
            raise ValueError("an adapter needs a name")
        path = Path(path)
        known = self._sources.get(name)
        if known is not None and known.path == path:
            return
        adapter = self._read(name, path)
        if self._digests.setdefault(name, adapter.digest) != adapter.digest:
            raise ValueError(
                f"adapter {name!r} was served here with other weights; KV cached under the "
                "name would be reused: load it under a new name"
            )
        self._sources[name] = _Source(path, adapter.digest)
        self._keep_on_host(adapter)

    def unregister(self, name: str) -> bool:
        """Stop serving ``name`` (the caller checked no request uses it); its slot is free."""
        if self._sources.pop(name, None) is None:
            return False
        self._host.pop(name, None)
        self._pinned.discard(name)
        self._lru.pop(name, None)
        slot = self._slot_of.pop(name, None)
        if slot is not None:
            self._slot_names[slot] = None  # rewritten by its next occupant
        return True

    def pin(self, name: str, pinned: bool) -> None:
        """A pinned adapter, once in a slot, is never evicted. At most ``max_adapters - 1``
        pins: one slot always serves the others."""
        if name not in self._sources:
            raise ValueError(f"adapter {name!r} is not loaded")
        if not pinned:
            self._pinned.discard(name)
            return
        if name not in self._pinned and len(self._pinned) + 1 >= self.limits.max_adapters:
            raise ValueError(
                f"at most {self.limits.max_adapters - 1} adapters may be pinned "
                f"(max_adapters {self.limits.max_adapters})"
            )
        self._pinned.add(name)

    def resident(self) -> list[str]:
        """The adapters in device slots, by slot."""
        return [n for n in self._slot_names if n is not None]

    def slot_of(self, name: str) -> int | None:
        return self._slot_of.get(name)

    def acquire(self, name: str, busy: Iterable[int]) -> int | None:
        """A device slot holding ``name``: its own, else a free one, else the least recently
        used one that is neither pinned nor in ``busy`` (used by running requests); None
        when there is none. May read the adapter's files again (gone from the host LRU):
        ValueError or OSError if that fails."""
        slot = self._slot_of.get(name)
        if slot is not None:
            self._lru.move_to_end(name)
            return slot
        busy = set(busy)
        victim: str | None = None
        if None in self._slot_names:
            slot = self._slot_names.index(None)
        else:
            victim = next(
                (n for n in self._lru if n not in self._pinned and self._slot_of[n] not in busy),
                None,
            )
            if victim is None:
                return None
            slot = self._slot_of[victim]
        adapter = self._host_copy(name)
        if victim is not None:
            del self._slot_of[victim], self._lru[victim]
            self.stats.evictions += 1
        t0 = time.perf_counter()
        self.slots.write(slot, adapter)
        self.stats.installs += 1
        self.stats.install_s += time.perf_counter() - t0
        self._slot_names[slot] = name
        self._slot_of[name] = slot
        self._lru[name] = None
        return slot

    def _host_copy(self, name: str) -> HostAdapter:
        adapter = self._host.get(name)
        if adapter is not None:
            self._host.move_to_end(name)
            return adapter
        source = self._sources[name]
        adapter = self._read(name, source.path)
        if adapter.digest != source.digest:
            raise ValueError(f"adapter {name!r} changed on disk since it was loaded")
        self._keep_on_host(adapter)
        return adapter

    def _read(self, name: str, path: Path) -> HostAdapter:
        t0 = time.perf_counter()
        adapter = read_adapter(
            name, path, self._cfg, dtype=self._dtype, max_rank=self.limits.max_rank
        )
        self.stats.reads += 1
        self.stats.read_s += time.perf_counter() - t0
        return adapter

    def _keep_on_host(self, adapter: HostAdapter) -> None:
        self._host[adapter.name] = adapter
        self._host.move_to_end(adapter.name)
        while len(self._host) > self.limits.max_host_adapters:
            self._host.popitem(last=False)


def batch_slots(slots: Sequence[int]) -> tuple[int, ...]:
    """The distinct slots (>= 0) of a batch's requests, ascending."""
    return tuple(sorted({s for s in slots if s >= 0}))
