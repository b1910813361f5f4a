"""The OpenVINO GenAI engine: CPU serving with paged attention, prefix caching and int8
weights, from an IR converted next to the checkpoint."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.task_executor.engines.openvino_engine.engine import OpenVINOEngine

__all__ = ["OpenVINOEngine"]


def __getattr__(name: str) -> Any:
    # Lazy, so that the converter (``python -m ...openvino_engine.convert``) runs where the
    # OpenVINO runtime is not installed.
    if name == "OpenVINOEngine":
        from services.task_executor.engines.openvino_engine.engine import OpenVINOEngine

        return OpenVINOEngine
    raise AttributeError(name)
