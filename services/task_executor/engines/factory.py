"""Which engine a TE builds for a model. Each engine module is imported only when chosen,
so a TE pays for the imports of the one it runs."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from services.task_executor.engines.base import Engine, LoadReport
from services.task_executor.engines.capabilities import CapabilityError, TensorSource
from services.task_executor.engines.choice import EngineChoice, HostView, Wanted, choose
from shared import block_hash

if TYPE_CHECKING:
    from services.task_executor.weight_cache.store import Received
from shared.native import Toolchain
from shared.settings import Settings


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def engine_choice(
    settings: Settings, model: str | None = None, model_path: Path | None = None
) -> EngineChoice:
    """The engine for ``model`` (or for any model, without one) and why (``choice.py``):
    the model's own engine if one is set, else MESHSERVE_ENGINE, where auto weighs the
    device, the engines installed, the weight format asked for (by the settings or by the
    model's config at ``model_path``) and the capabilities the deployment needs."""
    te = settings.task_executor
    if model is not None and model in te.model_engines:
        wanted = Wanted(te.model_engines[model], pinned_by="MESHSERVE_MODEL_ENGINES")
    elif te.engine != "auto":
        wanted = Wanted(te.engine, pinned_by="MESHSERVE_ENGINE")
    else:
        wanted = Wanted(
            "auto",
            weight_format=_weight_format(te.weight_format, model_path),
            needs=frozenset(te.engine_needs),
        )
    installed = {"torch"}
    if settings.vllm.python or importlib.util.find_spec("vllm") is not None:
        installed.add("vllm")
    if importlib.util.find_spec("openvino_genai") is not None:
        installed.add("openvino")
    device = te.device
    cuda = device.startswith("cuda") or (device == "auto" and cuda_available())
    host = HostView(device="cuda" if cuda else "cpu", installed=frozenset(installed))
    return dataclasses.replace(choose(host, wanted), device=host.device)


def choose_engine(
    settings: Settings, model: str | None = None, model_path: Path | None = None
) -> str:
    return engine_choice(settings, model, model_path).engine


def _weight_format(asked: str, model_path: Path | None) -> Literal["auto", "int8", "int4"]:
    """What the settings ask, else what the model's config says it is (its
    quantization_config's bits), else the checkpoint's own precision."""
    if asked in ("int8", "int4"):
        return "int8" if asked == "int8" else "int4"
    try:
        config = json.loads((model_path / "config.json").read_text()) if model_path else {}
    except (OSError, ValueError):
        return "auto"
    bits = (config.get("quantization_config") or {}).get("bits")
    return "int8" if bits == 8 else "int4" if bits == 4 else "auto"


def prewarm(settings: Settings) -> None:
    """What every load of this TE's engine would pay first, paid before any load: a TE is
    pre-warmed and model-agnostic (DeepServe §6). For the torch engine, importing torch (about
    1 s, most of a first load of a small model) and its CPU kernel (compiled once per host,
    then loaded from the kernel cache). The child-process engines import in their child."""
    kind = choose_engine(settings)
    if kind != "torch":  # the wrapper only: its child process imports the engine's package
        importlib.import_module(f"services.task_executor.engines.{kind}_engine")
        return
    import torch

    if settings.task_executor.torch_threads:
        torch.set_num_threads(settings.task_executor.torch_threads)
    block_hash.use_native(Toolchain.of(settings))  # the prefix cache hashes every prompt
    from services.task_executor.engines.torch_engine import (
        TorchEngine,  # noqa: F401
        cpu_kernels,
    )

    if settings.torch.cpu_kernels and settings.task_executor.device in ("auto", "cpu"):
        cpu_kernels.prewarm(Toolchain.of(settings))


def create_engine(
    model: str,
    model_path: Path,
    settings: Settings,
    *,
    tensors: TensorSource | None = None,
    report: LoadReport | None = None,
    weights_from: str | None = None,
    received: Received | None = None,
) -> Engine:
    """``tensors``: the weights, handed over instead of read from the checkpoint; only an
    engine that declares ``weight_source`` takes them. Otherwise the torch engine loads
    through the host weight cache where the settings turn it on (``host_cache``).
    ``report``: filled with the load's phases and what it took from the cache.
    ``weights_from``: another host's weight server to fork the weights from (the torch
    engine with the host cache on; others read the checkpoint); ``received``: the weights
    as a multicast delivered them."""
    kind = choose_engine(settings, model, model_path)
    if tensors is not None and kind != "torch":
        raise CapabilityError(
            f"the {kind} engine runs in a child process and cannot take weights as tensors"
        )
    if kind == "torch":
        from services.task_executor.engines.torch_engine import TorchEngine
        from services.task_executor.engines.torch_engine.lora import LoraLimits
        from services.task_executor.weight_cache.store import HostWeightCache

        lora = settings.lora
        return TorchEngine(
            model_path,
            device=settings.task_executor.device,
            dtype=settings.task_executor.dtype,
            kv_cache_bytes=settings.task_executor.kv_cache_bytes,
            max_num_seqs=settings.task_executor.max_num_seqs,
            max_prefill_tokens=settings.torch.max_prefill_tokens,
            chunked_prefill=settings.torch.chunked_prefill,
            late_yield_s=settings.torch.late_yield.total_seconds(),
            enable_prefix_caching=settings.task_executor.prefix_caching,
            num_host_kv_blocks=settings.torch.host_kv_blocks,
            cpu_kernels=settings.torch.cpu_kernels,
            kernel_toolchain=Toolchain.of(settings),
            cuda_graphs=settings.torch.cuda_graphs,
            tensors=tensors,
            weight_cache=HostWeightCache.from_settings(settings) if tensors is None else None,
            model_name=model,
            load_report=report,
            weights_from=weights_from,
            received=received,
            lora=(
                LoraLimits(lora.max_adapters, lora.max_host_adapters, lora.max_rank)
                if lora.max_adapters
                else None
            ),
        )
    if kind == "openvino":
        from services.task_executor.engines.process import ProcessEngine

        # In a child process: GenAI's step() holds the GIL and would freeze the TE's event
        # loop (process.py). The child converts the checkpoint to IR on first use (tens of
        # seconds; scripts/up does it ahead of time for the demo model).
        return ProcessEngine(
            functools.partial(openvino_engine, model_path, **openvino_engine_args(settings)),
            label=f"openvino-{model}",
        )
    if kind == "vllm":
        from services.task_executor.engines.process import ProcessEngine
        from services.task_executor.engines.vllm_engine import VLLMEngine  # imports no vLLM

        # In a child process, from vLLM's own venv where one is named: closing the engine ends
        # the process, which hands back every byte vLLM held (GPU memory included). The
        # factory is the class itself: the child imports its module, which that venv can
        # (this one needs pydantic, which it may lack).
        return ProcessEngine(
            functools.partial(VLLMEngine, model_path, **vllm_engine_args(settings)),
            label=f"vllm-{model}",
            python=settings.vllm.python or None,
        )
    raise ValueError(f"unknown engine {kind!r}")


def kv_floor_bytes(model: str, model_path: Path, settings: Settings) -> int | None:
    """The KV a load of ``model`` here holds before its first request where its pool is
    sized by demand (``kv_pool.floor_blocks``: 1.25 of its context, at most its cache),
    worked out before the load from its config, as the engine will size it; None where the
    engine chosen cannot resize its KV (``kv_resize``: the torch engine on a CPU)."""
    if choose_engine(settings, model, model_path) != "torch":
        return None
    from services.task_executor.engines.torch_engine.build import (
        kv_block_bytes,
        kv_cache_size,
        resolve_device,
        resolve_dtype,
    )
    from services.task_executor.engines.torch_engine.config import load_model_config
    from services.task_executor.engines.torch_engine.engine import BLOCK_SIZE
    from services.task_executor.kv_pool import floor_blocks

    te = settings.task_executor
    device = resolve_device(te.device)
    if device.type != "cpu":
        return None
    cfg = load_model_config(model_path)
    dtype = resolve_dtype(te.dtype, cfg, device)
    blocks, max_len = kv_cache_size(
        cfg,
        device=device,
        dtype=dtype,
        block_size=BLOCK_SIZE,
        max_num_seqs=te.max_num_seqs,
        max_model_len=None,
        num_kv_blocks=None,
        kv_cache_bytes=te.kv_cache_bytes,
    )
    return floor_blocks(max_len, BLOCK_SIZE, blocks) * kv_block_bytes(cfg, BLOCK_SIZE, dtype)


def preload(
    model: str, model_path: Path, settings: Settings, *, weights_from: str | None = None
) -> LoadReport:
    """The model's weights into this host's weight cache, as this TE's engine would load
    them (``PreloadModel``); only the torch engine loads through the cache."""
    kind = choose_engine(settings, model, model_path)
    if kind != "torch":
        raise CapabilityError(f"the {kind} engine does not load through the host weight cache")
    from services.task_executor.engines.torch_engine.build import preload_weights
    from services.task_executor.weight_cache.store import HostWeightCache

    cache = HostWeightCache.from_settings(settings)
    if cache is None:
        raise CapabilityError("the host weight cache is off (MESHSERVE_HOST_CACHE_BYTES=0)")
    return preload_weights(
        model_path,
        cache,
        model_name=model,
        device=settings.task_executor.device,
        dtype=settings.task_executor.dtype,
        weights_from=weights_from,
    )


def openvino_engine_args(settings: Settings) -> dict[str, Any]:
    """The OpenVINOEngine arguments a TE's settings give: the IR's weights are those
    MESHSERVE_WEIGHT_FORMAT asks for, else the OpenVINO engine's own format."""
    asked = settings.task_executor.weight_format
    return {
        "weight_format": asked if asked != "auto" else settings.openvino.weight_format,
        "kv_cache_bytes": settings.task_executor.kv_cache_bytes,
        "max_num_seqs": settings.task_executor.max_num_seqs,
        "enable_prefix_caching": settings.task_executor.prefix_caching,
        "num_threads": settings.task_executor.torch_threads or None,
        "export_python": settings.openvino.export_python or None,
        "export_venv": settings.openvino.export_venv or None,
        "model_cache": settings.openvino.model_cache,
    }


def openvino_engine(model_path: Path, **kwargs: Any) -> Any:
    """An OpenVINOEngine, in this process (a TE runs it in a child: see create_engine)."""
    from services.task_executor.engines.openvino_engine import OpenVINOEngine

    return OpenVINOEngine(model_path, **kwargs)


def vllm_engine_args(settings: Settings) -> dict[str, Any]:
    """The VLLMEngine arguments a TE's settings give."""
    return {
        "dtype": settings.task_executor.dtype,
        "max_num_seqs": settings.task_executor.max_num_seqs,
        "gpu_memory_fraction": settings.task_executor.gpu_memory_fraction,
        "kv_cache_bytes": settings.task_executor.kv_cache_bytes,
        "enable_prefix_caching": settings.task_executor.prefix_caching,
        "enforce_eager": settings.vllm.enforce_eager,
        # LoRA with vLLM's own multi-LoRA support (0 adapters: off), when asked for.
        "max_adapters": settings.lora.max_adapters if settings.vllm.lora else 0,
        "max_host_adapters": settings.lora.max_host_adapters,
        "max_adapter_rank": settings.lora.max_rank,
    }
