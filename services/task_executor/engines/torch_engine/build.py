"""How a torch engine is made: the device and dtype it runs in, its weights (from the
checkpoint, or mapped from the host's weight cache), the size of its KV cache and the longest
sequence it admits, and pre-loading a model's weights into the host cache with no engine."""

from __future__ import annotations

from pathlib import Path

import torch

from services.task_executor.dtypes import DTYPES
from services.task_executor.engines.base import EngineCapabilities, LoadReport
from services.task_executor.engines.torch_engine import linear
from services.task_executor.engines.torch_engine.config import ModelConfig, load_model_config
from services.task_executor.engines.torch_engine.cuda_graphs import DecodeGraphs
from services.task_executor.engines.torch_engine.kv_cache import PagedKVCache
from services.task_executor.engines.torch_engine.model import ForwardBatch, Transformer
from services.task_executor.engines.torch_engine.scheduler import blocks_for
from services.task_executor.engines.torch_engine.weights import (
    CheckpointTensors,
    ModelWeights,
    load_weights,
)
from services.task_executor.weight_cache.store import HostWeightCache
from shared.messages.tasks import TaskMode
from shared.native import DEFAULT_TOOLCHAIN, Toolchain

# Without an explicit size the cache gets enough for max_num_seqs full-length sequences, capped:
# on a CPU at a fixed size (host memory is shared with everything else on the node), on a GPU
# at a share of what is free once the weights are loaded.
DEFAULT_CPU_KV_BYTES = 1 << 30
DEFAULT_GPU_KV_FRACTION = 0.4

# Prompt tokens per iteration when none is given (with chunked prefill, also the longest stall
# a prompt puts on running decodes). On CPU an iteration of 256 prompt tokens takes about 1.4 s
# for a 0.5B model in fp32; against 2048 (scripts/bench-scheduling, 8 concurrent requests of
# 512 + 128 tokens) it gave 4x lower median TTFT, 8x lower worst inter-token gap and 11% more
# aggregate throughput, for 12% less decode speed per request. A GPU prefills far faster.
DEFAULT_PREFILL_TOKENS = {"cpu": 256, "cuda": 2048}
# Once paced (pace_prefill, with the instance's measured costs: scheduler.Pacing), the budget
# follows what decodes: this many prompt tokens an iteration while nothing does, and as many as
# the decodes' TPOT slack allows while some do. On CPU 2,048 (vLLM's CPU server default too):
# a 0.5B model prefills 1,900 tokens/s at 2k on a 2-core Sapphire Rapids host, about as fast as
# at 4k in one iteration, and a short prompt that arrives behind a long one waits for an
# iteration of 1 s rather than 2 (a replay of the Azure trace at light load: the TTFT p90).
PACED_PREFILL_TOKENS = {"cpu": 2048, "cuda": 8192}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def resolve_dtype(dtype: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, not {dtype!r}")
        return DTYPES[dtype]
    if device.type == "cpu":
        # A bf16 checkpoint stays bf16 where oneDNN multiplies bf16 (AMX, AVX-512 BF16): half
        # the bytes a decode step streams. CPUs without (AVX2) run bf16 6-10x slower than
        # float32, and an fp16 checkpoint is not widened to bf16's range silently.
        if config.torch_dtype == "bfloat16" and linear.can_pack(torch.bfloat16, device):
            return torch.bfloat16
        return torch.float32
    return DTYPES.get(config.torch_dtype or "", torch.bfloat16)


def prefill_tokens(max_prefill_tokens: int | None, device: torch.device) -> int:
    """Prompt tokens an iteration computes: as given, else the device's default."""
    if max_prefill_tokens is None:
        max_prefill_tokens = DEFAULT_PREFILL_TOKENS.get(device.type, 2048)
    if max_prefill_tokens < 1:
        raise ValueError("max_prefill_tokens must be at least 1")
    return max_prefill_tokens


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """One KV cache block of the model: K and V of ``block_size`` tokens in every layer."""
    return PagedKVCache.bytes_per_block(
        num_layers=config.num_layers,
        block_size=block_size,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        dtype=dtype,
    )


def kv_cache_size(
    config: ModelConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    max_num_seqs: int,
    max_model_len: int | None,
    num_kv_blocks: int | None,
    kv_cache_bytes: int | None,
) -> tuple[int, int]:
    """(blocks in the KV cache, the longest sequence admitted): ``num_kv_blocks`` as given,
    else ``kv_cache_bytes`` of blocks, else room for ``max_num_seqs`` sequences of
    ``max_model_len`` (default: the model's context) within the device's default budget. A
    sequence that could outgrow the whole cache is never admitted: it could not run alone."""
    wanted_len = max_model_len or config.max_position_embeddings
    if wanted_len > config.max_position_embeddings:
        raise ValueError(
            f"max_model_len {wanted_len} exceeds the model's {config.max_position_embeddings}"
        )
    block_bytes = kv_block_bytes(config, block_size, dtype)
    if num_kv_blocks is None:
        if kv_cache_bytes is None:
            wanted = max_num_seqs * blocks_for(wanted_len, block_size) * block_bytes
            if device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(device)
                kv_cache_bytes = min(wanted, int(free * DEFAULT_GPU_KV_FRACTION))
            else:
                kv_cache_bytes = min(wanted, DEFAULT_CPU_KV_BYTES)
        num_kv_blocks = kv_cache_bytes // block_bytes
    if num_kv_blocks < 1:
        raise ValueError("the KV cache budget does not hold a single block")
    capacity = num_kv_blocks * block_size
    if max_model_len is not None and max_model_len > capacity:
        raise ValueError(
            f"max_model_len {max_model_len} does not fit a KV cache of {capacity} tokens"
        )
    return num_kv_blocks, min(wanted_len, capacity)


def capabilities(
    *, prefix_caching: bool, host_kv_tier: bool, prefill_pacing: bool, lora: bool = False
) -> EngineCapabilities:
    """What a torch engine built with these options can do (checked at load against what
    it implements: ``capabilities.bind_features``)."""
    return EngineCapabilities(
        modes=frozenset({TaskMode.COLOCATED, TaskMode.PREFILL, TaskMode.DECODE}),
        prefix_cache=prefix_caching,
        kv_events=prefix_caching,
        kv_export=True,
        kv_import=True,
        prefix_pinning=prefix_caching,
        host_kv_tier=prefix_caching and host_kv_tier,
        weight_source=True,
        prefill_pacing=prefill_pacing,
        lora=lora,
    )


def make_runner(
    config: ModelConfig,
    weights: ModelWeights,
    *,
    max_model_len: int,
    dtype: torch.dtype,
    device: torch.device,
    cpu_kernels: bool,
    toolchain: Toolchain | None,
    cuda_graphs: bool,
    max_num_seqs: int,
    block_size: int,
) -> Transformer:
    """The model's forward; on CUDA with ``cuda_graphs``, decode iterations replay graphs
    captured per batch and context bucket."""
    runner = Transformer(
        config,
        weights,
        max_model_len=max_model_len,
        dtype=dtype,
        device=device,
        cpu_kernels=cpu_kernels,
        toolchain=toolchain or DEFAULT_TOOLCHAIN,
    )
    if cuda_graphs and device.type == "cuda":
        runner.graphs = DecodeGraphs(
            runner.forward_eager,
            ForwardBatch,
            max_batch=max_num_seqs,
            max_blocks=blocks_for(max_model_len, block_size),
            block_size=block_size,
            device=device,
        )
    return runner


def preload_weights(
    model_dir: Path | str,
    weight_cache: HostWeightCache,
    *,
    model_name: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    weights_from: str | None = None,
    report: LoadReport | None = None,
) -> LoadReport:
    """The model's weights made as a TorchEngine with these arguments makes them, into
    ``weight_cache`` (from ``weights_from``'s cache where given, else the checkpoint), and
    nothing else: no engine, no KV cache. A later load on the host maps them. Returns once
    they are stored. (On CUDA they are made on the device as a load makes them, then
    dropped: only the host copies stay.)"""
    torch_device = resolve_device(device)
    config = load_model_config(model_dir)
    report = report if report is not None else LoadReport()
    name = model_name or Path(model_dir).name
    session = weight_cache.session(name, Path(model_dir), report, weights_from)
    load_weights(
        CheckpointTensors(Path(model_dir)),
        config,
        dtype=resolve_dtype(dtype, config, torch_device),
        device=torch_device,
        derived=session,
    )
    session.finish()
    session.wait()
    return report
