"""How long an engine iteration takes: the simulator's stand-in for a real engine.

A profile is measured on a real engine (``loadgen/profiling.py``, ``meshserve-loadgen profile``)
and stored as JSON. An iteration of continuous batching decodes one token for each running
request and prefills the prompts that join; its time is modelled as

    step_s = decode_s(batch) + decode_ctx_s * (context tokens the decodes attend over)
             + sum over prefills of (prefill_s * n + prefill_s2 * n**2)
             + emit_s * (tokens the iteration produces)

``decode_s`` is interpolated linearly between measured batch sizes (and extrapolated from
the last two): a decode step streams the weights once however many requests share it, so it
grows slowly with the batch until compute takes over. The quadratic prefill term is
attention. ``emit_s`` is the serving path's cost per streamed token outside the engine (the
TE publishes each token before its next iteration; the frontend shares the host's cores): it
cannot be measured in-process, so ``profile`` leaves it 0 and ``calibrate_emit_s`` fits it
from a replay of the same workload (see the README). Everything else (load time, KV
capacity, context length, batch limit) is what the engine reported when it was profiled.

A load takes ``load_s`` from the checkpoint on disk; ``load_cached_s`` where its node pool's
host weight cache holds the weights (mapped: nothing read or packed). ``weight_bytes`` is
what the weights take in that cache. Profiles written before these fields load with
estimates: ``load_cached_s`` as ``CACHED_LOAD_FRACTION`` of ``load_s``, ``weight_bytes`` as
what ``load_s`` reads at ``DEFAULT_LOAD_BANDWIDTH``.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shared.messages.scaling import InstanceCapacity
from shared.perf_model import CAPACITY_MAX_BATCH, PerfModel, powers_of_two

# A load that maps its weights from the host cache, over one that reads the checkpoint: 0.17 s
# against 0.55 s from a warm disk for the Qwen2-0.5B-shaped model (README, Performance:
# ``scripts/bench-coldstart``).
CACHED_LOAD_FRACTION = 0.17 / 0.55
# Bytes/s a load reads and packs a checkpoint at: the scaler's and the eviction cost's
# default (MESHSERVE_HOST_CACHE_LOAD_BANDWIDTH).
DEFAULT_LOAD_BANDWIDTH = 1.0e9


@dataclasses.dataclass(frozen=True, slots=True)
class EngineProfile:
    model: str
    load_s: float  # LoadModel to ready
    decode_batches: tuple[int, ...]  # measured batch sizes, ascending
    decode_s: tuple[float, ...]  # step time at each, short context
    decode_ctx_s: float  # extra step time per context token attended by decodes
    prefill_s: float  # per prompt token
    prefill_s2: float  # per prompt token squared (attention)
    max_num_seqs: int
    max_prefill_tokens: int
    kv_blocks: int
    block_size: int
    max_model_len: int
    emit_s: float = 0.0  # per token streamed, outside the engine
    chunked_prefill: bool = False  # prompts over the budget run in chunks (scheduler.py)
    # The engine paces its prefill (scheduler.Pacing) from these costs and the SLO's TPOT:
    # max_prefill_tokens is then the budget while nothing decodes.
    paced: bool = False
    # The weights in the engine's form, as the host weight cache holds them (0: estimated,
    # ``weight_size``); LoadModel to ready when that cache holds them (None: estimated,
    # ``cached_load_s``).
    weight_bytes: int = 0
    load_cached_s: float | None = None
    # One token's KV in bytes, as PD moves it (``KvLayout.token_bytes``); 0: the engine moves
    # no KV (no prefill or decode role for it).
    kv_bytes_per_token: int = 0
    source: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # how it was measured

    def __post_init__(self) -> None:
        if not self.decode_batches or len(self.decode_batches) != len(self.decode_s):
            raise ValueError("a profile needs decode step times for at least one batch size")
        if list(self.decode_batches) != sorted(set(self.decode_batches)):
            raise ValueError("decode batch sizes must be distinct and ascending")

    def weight_size(self) -> int:
        """Bytes the weights take in a host weight cache: ``weight_bytes``, else what a load
        from disk reads in ``load_s`` at the default load bandwidth."""
        return self.weight_bytes or max(1, round(self.load_s * DEFAULT_LOAD_BANDWIDTH))

    def cached_load_s(self) -> float:
        """A load whose weights its host cache holds: ``load_cached_s``, else
        ``CACHED_LOAD_FRACTION`` of a load from disk."""
        if self.load_cached_s is not None:
            return self.load_cached_s
        return self.load_s * CACHED_LOAD_FRACTION

    def decode_step_s(self, batch: int) -> float:
        """Step time of ``batch`` decodes at short context (0 for none)."""
        if batch <= 0:
            return 0.0
        xs, ys = self.decode_batches, self.decode_s
        if len(xs) == 1:
            return ys[0] * batch / xs[0] if batch > xs[0] else ys[0]
        i = bisect.bisect_left(xs, batch)
        if i < len(xs) and xs[i] == batch:
            return ys[i]
        if i == 0:
            return ys[0]  # below the smallest measured batch: a step costs at least that
        i = min(i, len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(0.0, y0 + (y1 - y0) * (batch - x0) / (x1 - x0))

    def prefill_time_s(self, tokens: int, cached: int = 0) -> float:
        """``tokens`` prompt tokens after ``cached`` already in the cache (a later chunk):
        causal attention pairs grow as tokens² / 2 + tokens × cached."""
        return self.prefill_s * tokens + self.prefill_s2 * tokens * (tokens + 2 * cached)

    def iteration_s(
        self,
        decode_batch: int,
        decode_context: int,
        prefills: list[int],
        prefill_cached: list[int] | None = None,
    ) -> float:
        """One iteration: ``decode_batch`` decodes attending over ``decode_context`` tokens in
        all, and prefills of the given new-token counts (after ``prefill_cached`` tokens each
        already in the cache, for the chunks of a chunked prefill)."""
        t = self.decode_step_s(decode_batch) + self.decode_ctx_s * decode_context
        t += self.emit_s * (decode_batch + len(prefills))
        if prefills:
            cached = prefill_cached or [0] * len(prefills)
            t += sum(self.prefill_time_s(n, c) for n, c in zip(prefills, cached, strict=True))
            if not decode_batch:
                # A prefill-only iteration still reads every weight once (the LM head too).
                t = max(t, self.decode_step_s(1))
        return t

    def capacity(self) -> InstanceCapacity:
        """The scaler's per-token costs of this engine (what the TE's own probe,
        ``services/task_executor/capacity.py``, measures), from this fuller model."""
        batch = max(1, min(self.max_num_seqs, CAPACITY_MAX_BATCH))
        step = self.decode_step_s(batch) + self.emit_s * batch
        return InstanceCapacity(
            prefill_s=self.prefill_s,
            prefill_attention_s=self.prefill_s2,
            decode_s=step / batch,
            decode_step_s=step,
            decode_context_s=self.decode_ctx_s,
            max_num_seqs=self.max_num_seqs,
            engine=str(self.source.get("engine", "")),
            device=str(self.source.get("device", "")),
        )

    def perf_model(self) -> PerfModel:
        """This cost model on the power-of-two grids of a performance model
        (``shared.perf_model``), as ``meshserve profile`` would have measured it: what the
        simulator's shadow validation plays a device's iterations forward with."""
        lengths = powers_of_two(16, max(16, self.max_model_len))
        batches = powers_of_two(1, max(1, self.max_num_seqs))
        contexts = powers_of_two(16, max(16, self.max_model_len))
        return PerfModel(
            prefill_lengths=lengths,
            prefill_s=[
                max(self.prefill_time_s(n), self.decode_step_s(1)) + self.emit_s for n in lengths
            ],
            decode_batches=batches,
            decode_contexts=contexts,
            decode_s=[[self.iteration_s(b, b * c, []) for c in contexts] for b in batches],
            max_num_seqs=self.max_num_seqs,
            grid="full",
            engine=str(self.source.get("engine", "")),
            device=str(self.source.get("device", "")),
        )

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["decode_batches"] = list(self.decode_batches)
        d["decode_s"] = list(self.decode_s)
        d["source"] = dict(self.source)
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> EngineProfile:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - fields
        if unknown:
            raise ValueError(f"unknown profile fields: {sorted(unknown)}")
        kw = dict(d)
        kw["decode_batches"] = tuple(int(b) for b in d["decode_batches"])
        kw["decode_s"] = tuple(float(s) for s in d["decode_s"])
        return cls(**kw)


def load_profiles(path: Path | str) -> dict[str, EngineProfile]:
    """A profile file: one profile object, or ``{"profiles": [...]}``; keyed by model."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read a profile: {e}") from e
    items = data["profiles"] if isinstance(data, dict) and "profiles" in data else [data]
    try:
        profiles = [EngineProfile.from_json(p) for p in items]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: not a valid profile: {e}") from e
    return {p.model: p for p in profiles}


def save_profiles(path: Path | str, profiles: list[EngineProfile]) -> None:
    body = (
        profiles[0].to_json()
        if len(profiles) == 1
        else {"profiles": [p.to_json() for p in profiles]}
    )
    Path(path).write_text(json.dumps(body, indent=2) + "\n")


DEFAULT_PROFILE = Path(__file__).with_name("profiles") / "bench-qwen2-0.5b-torch-cpu.json"
# The same model on an H100 (``simulate --gpu-devices``' default for GPU devices).
GPU_PROFILE = Path(__file__).with_name("profiles") / "bench-qwen2-0.5b-torch-h100.json"
