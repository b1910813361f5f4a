"""meshserve's own model runner: Llama/Qwen2/Mistral checkpoints from safetensors, a paged KV
cache and continuous batching, on CPU or CUDA.

``TorchEngine`` is imported on first use: the package's pure modules (``scheduler``) are
shared with the simulator, which must not import torch to use them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.task_executor.engines.torch_engine.engine import TorchEngine

__all__ = ["TorchEngine"]


def __getattr__(name: str) -> Any:
    if name == "TorchEngine":
        from services.task_executor.engines.torch_engine.engine import TorchEngine

        return TorchEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
