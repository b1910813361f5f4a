"""Which engine serves a model: a pure function of what the host offers and what the
deployment asks, with the reason it gives (shown in the TE's heartbeat and ``/health``).

``MESHSERVE_ENGINE=auto`` (the default) picks, per model and device, the engine measured
fastest at the precision asked for (docs/benchmarks.md):

- a capability the deployment needs that only the torch engine has (KV export and import for
  prefill/decode disaggregation, KV events for precise prefix routing) decides first;
- on a GPU, vLLM where it is installed (it decodes 1.2-1.5x the torch engine on an H100);
- on a CPU, weights compressed to int8 or int4 (asked for with ``MESHSERVE_WEIGHT_FORMAT``,
  or by the model's own quantization config) go to OpenVINO, whose int8 kernels decode 2.2x
  vLLM's fp32 on a 2-core AVX2 host; uncompressed weights to the torch engine, which matches
  or beats vLLM's CPU build at the same precision (bf16 on AMX: prefill 1.0-1.4x, decode
  1.05x; fp32 on AVX2: 0.98-0.99x) and has every capability;
- an engine that is not installed is never chosen; the torch engine always is.

Weights are never compressed unless asked: the CPU default is the checkpoint's own precision
(bf16 where oneDNN has bf16 matrix units, float32 elsewhere:
``torch_engine.build.resolve_dtype``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Literal

EngineKind = Literal["torch", "openvino", "vllm"]

# What each engine can offer beyond generating, whatever its settings (an engine declares what
# it does offer when it loads: EngineCapabilities; tests/unit/test_engine_choice.py checks
# that no declaration goes beyond this table).
OFFERS: Mapping[str, frozenset[str]] = {
    "torch": frozenset(
        {
            "prefix_cache",
            "kv_events",
            "kv_export",
            "kv_import",
            "prefix_pinning",
            "host_kv_tier",
            "weight_source",
            "prefill_pacing",
            "kv_resize",  # on CPU
        }
    ),
    "openvino": frozenset({"prefix_cache"}),
    "vllm": frozenset({"prefix_cache"}),
}


@dataclasses.dataclass(frozen=True, slots=True)
class HostView:
    device: Literal["cpu", "cuda"]
    installed: frozenset[str]  # engines that can run here ("torch" always)


@dataclasses.dataclass(frozen=True, slots=True)
class Wanted:
    engine: str  # "auto" or an engine name
    pinned_by: str = ""  # where a named engine comes from (a setting), for the reason
    weight_format: Literal["auto", "int8", "int4"] = "auto"  # auto: the checkpoint's
    needs: frozenset[str] = frozenset()  # capabilities the deployment relies on


@dataclasses.dataclass(frozen=True, slots=True)
class EngineChoice:
    engine: str
    reason: str
    device: str = ""  # what it runs on ("cpu", "cuda"), said before any model is loaded


def choose(host: HostView, wanted: Wanted) -> EngineChoice:
    if wanted.engine != "auto":
        missing = wanted.needs - OFFERS.get(wanted.engine, frozenset())
        note = f" (it lacks {', '.join(sorted(missing))}, which the deployment needs)"
        return EngineChoice(
            wanted.engine, f"set by {wanted.pinned_by or 'configuration'}" + (note * bool(missing))
        )
    if wanted.needs:
        able = sorted(e for e, offers in OFFERS.items() if wanted.needs <= offers)
        need = ", ".join(sorted(wanted.needs))
        if "torch" in able:
            return EngineChoice("torch", f"the deployment needs {need}: only torch offers it")
    if host.device == "cuda":
        if "vllm" in host.installed:
            return EngineChoice("vllm", "GPU: vLLM decodes 1.2-1.5x the torch engine")
        return EngineChoice("torch", "GPU without vLLM installed: the torch engine")
    if wanted.weight_format in ("int8", "int4"):
        if "openvino" in host.installed:
            return EngineChoice(
                "openvino", f"CPU with {wanted.weight_format} weights: OpenVINO's kernels"
            )
        return EngineChoice(
            "torch",
            f"CPU with {wanted.weight_format} weights asked, but OpenVINO is not installed: "
            "the torch engine at the checkpoint's precision",
        )
    return EngineChoice(
        "torch", "CPU at the checkpoint's precision: the torch engine matches or beats vLLM"
    )
