"""meshserve's own model runner: Llama/Qwen2/Mistral checkpoints from safetensors, a paged KV
cache and continuous batching, on CPU or CUDA."""

from services.task_executor.engines.torch_engine.engine import TorchEngine

__all__ = ["TorchEngine"]
