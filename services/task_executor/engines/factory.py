"""Which engine a TE builds for a model. Each engine module is imported only when chosen,
so a TE pays for the imports of the one it runs."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

from services.task_executor.engines.base import Engine
from services.task_executor.engines.capabilities import CapabilityError, TensorSource
from shared.settings import Settings


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def choose_engine(settings: Settings, model: str | None = None) -> str:
    """The model's own engine if one is set, else MESHSERVE_ENGINE; auto means vLLM where
    a CUDA device and vLLM (in this venv, or in MESHSERVE_VLLM_PYTHON's) are present, and
    meshserve's torch engine elsewhere."""
    if model is not None and model in settings.task_executor.model_engines:
        return settings.task_executor.model_engines[model]
    if settings.task_executor.engine != "auto":
        return settings.task_executor.engine
    has_vllm = bool(settings.vllm.python) or importlib.util.find_spec("vllm") is not None
    if has_vllm and cuda_available():
        return "vllm"
    return "torch"


def create_engine(
    model: str, model_path: Path, settings: Settings, *, tensors: TensorSource | None = None
) -> Engine:
    """``tensors``: the weights, handed over (a host cache) instead of read from the
    checkpoint; only an engine that declares ``weight_source`` takes them."""
    kind = choose_engine(settings, model)
    if tensors is not None and kind != "torch":
        raise CapabilityError(
            f"the {kind} engine runs in a child process and cannot take weights as tensors"
        )
    if kind == "torch":
        from services.task_executor.engines.torch_engine import TorchEngine
        from services.task_executor.engines.torch_engine.cpu_kernels import Toolchain

        return TorchEngine(
            model_path,
            device=settings.task_executor.device,
            dtype=settings.task_executor.dtype,
            kv_cache_bytes=settings.task_executor.kv_cache_bytes,
            max_num_seqs=settings.task_executor.max_num_seqs,
            max_prefill_tokens=settings.torch.max_prefill_tokens,
            chunked_prefill=settings.torch.chunked_prefill,
            enable_prefix_caching=settings.task_executor.prefix_caching,
            num_host_kv_blocks=settings.torch.host_kv_blocks,
            cpu_kernels=settings.torch.cpu_kernels,
            kernel_toolchain=Toolchain(cc=settings.torch.cc, cache_dir=settings.torch.kernel_cache),
            cuda_graphs=settings.torch.cuda_graphs,
            tensors=tensors,
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


def openvino_engine_args(settings: Settings) -> dict[str, Any]:
    """The OpenVINOEngine arguments a TE's settings give."""
    return {
        "weight_format": settings.openvino.weight_format,
        "kv_cache_bytes": settings.task_executor.kv_cache_bytes,
        "max_num_seqs": settings.task_executor.max_num_seqs,
        "enable_prefix_caching": settings.task_executor.prefix_caching,
        "num_threads": settings.task_executor.torch_threads or None,
        "export_python": settings.openvino.export_python or None,
        "export_venv": settings.openvino.export_venv or None,
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
    }
