"""Which engine a TE builds for a model. Each engine module is imported only when chosen,
so a TE pays for the imports of the one it runs."""

from __future__ import annotations

from pathlib import Path

from services.task_executor.engines.base import Engine
from shared.settings import Settings


def choose_engine(settings: Settings) -> str:
    """auto: vLLM where a CUDA device is present once that engine exists; torch today."""
    return "torch" if settings.engine == "auto" else settings.engine


def create_engine(model_path: Path, settings: Settings) -> Engine:
    kind = choose_engine(settings)
    if kind == "torch":
        from services.task_executor.engines.torch_engine import TorchEngine

        return TorchEngine(
            model_path,
            device=settings.device,
            dtype=settings.dtype,
            kv_cache_bytes=settings.kv_cache_bytes,
            max_num_seqs=settings.max_num_seqs,
        )
    raise ValueError(f"engine {kind!r} is not available in this build")
