"""TorchEngine: meshserve's own model runner behind the Engine protocol."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch

from services.task_executor.engines.base import (
    EngineCapabilities,
    EngineOutput,
    EngineRequest,
    EngineStats,
)
from services.task_executor.engines.torch_engine import sampling
from services.task_executor.engines.torch_engine.config import ModelConfig, load_model_config
from services.task_executor.engines.torch_engine.kv_cache import PagedKVCache, blocks_for
from services.task_executor.engines.torch_engine.model import SeqChunk, Transformer, build_batch
from services.task_executor.engines.torch_engine.scheduler import (
    SchedulerConfig,
    SeqView,
    schedule,
)
from services.task_executor.engines.torch_engine.weights import load_weights
from shared.messages.api import SamplingParams
from shared.messages.tasks import TaskMode

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Without an explicit size the cache gets enough for max_num_seqs full-length sequences, capped:
# on a CPU at a fixed size (host memory is shared with everything else on the node), on a GPU
# at a share of what is free once the weights are loaded.
DEFAULT_CPU_KV_BYTES = 1 << 30
DEFAULT_GPU_KV_FRACTION = 0.4


@dataclasses.dataclass(slots=True, eq=False)
class _Request:
    request_id: str
    prompt_len: int
    token_ids: list[int]  # prompt, then the tokens generated so far
    sampling: SamplingParams
    generator: torch.Generator
    blocks: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # leading tokens whose K/V is in the cache

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len


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
    # CPUs without bf16 matrix units run float32 faster, and bf16 on CPU must be a choice.
    if device.type == "cpu":
        return torch.float32
    return DTYPES.get(config.torch_dtype or "", torch.bfloat16)


class TorchEngine:
    name = "torch"
    capabilities = EngineCapabilities(modes=frozenset({TaskMode.COLOCATED}))

    def __init__(
        self,
        model_dir: Path | str,
        *,
        device: str = "auto",
        dtype: str = "auto",
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        max_num_seqs: int = 32,
        max_model_len: int | None = None,
        max_prefill_tokens: int = 2048,
    ) -> None:
        torch_device = resolve_device(device)
        self.device = str(torch_device)
        self.config = load_model_config(model_dir)
        self.dtype = resolve_dtype(dtype, self.config, torch_device)
        self.weights = load_weights(model_dir, self.config, dtype=self.dtype, device=torch_device)

        cfg = self.config
        wanted_len = max_model_len or cfg.max_position_embeddings
        if wanted_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len {wanted_len} exceeds the model's {cfg.max_position_embeddings}"
            )
        block_bytes = PagedKVCache.bytes_per_block(
            num_layers=cfg.num_layers,
            block_size=block_size,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=self.dtype,
        )
        if num_kv_blocks is None:
            if kv_cache_bytes is None:
                wanted = max_num_seqs * blocks_for(wanted_len, block_size) * block_bytes
                if torch_device.type == "cuda":
                    free, _ = torch.cuda.mem_get_info(torch_device)
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
        # Never admit a sequence that could outgrow the whole cache: it could not even run alone.
        self.max_model_len = min(wanted_len, capacity)

        self.cache = PagedKVCache(
            num_layers=cfg.num_layers,
            num_blocks=num_kv_blocks,
            block_size=block_size,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=self.dtype,
            device=torch_device,
        )
        self.runner = Transformer(
            cfg,
            self.weights,
            max_model_len=self.max_model_len,
            dtype=self.dtype,
            device=torch_device,
        )
        self._torch_device = torch_device
        self._sched = SchedulerConfig(
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_prefill_tokens=max_prefill_tokens,
            # ~1% of the cache kept back at admission, so newly admitted requests do not force
            # a preemption on their first decode steps.
            watermark_blocks=max(1, num_kv_blocks // 100),
        )
        self._running: list[_Request] = []  # admission order: the last one is preempted first
        self._waiting: collections.deque[_Request] = collections.deque()
        self._requests: dict[str, _Request] = {}
        self._closed = False

    # --- Engine protocol ---------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        self._check_open()
        prompt = list(request.prompt_token_ids)
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens; this model serves at most "
                f"{self.max_model_len - 1} prompt tokens"
            )
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id!r} is already queued")
        vocab = self.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        sampling.validate(request.sampling)
        req = _Request(
            request_id=request.request_id,
            prompt_len=len(prompt),
            token_ids=prompt,
            sampling=request.sampling,
            generator=sampling.make_generator(request.sampling.seed),
        )
        self._requests[req.request_id] = req
        self._waiting.append(req)

    def abort(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        if req in self._running:
            self._running.remove(req)
        else:
            self._waiting.remove(req)
        self._release(req)

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    @torch.inference_mode()
    def step(self) -> Sequence[EngineOutput]:
        scheduled = self._schedule()
        if not scheduled:
            return []
        return self._advance(scheduled, self._forward(scheduled))

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self._running),
            waiting=len(self._waiting),
            free_kv_blocks=self.cache.allocator.num_free if not self._closed else 0,
            total_kv_blocks=self.cache.num_blocks if not self._closed else 0,
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._running.clear()
        self._waiting.clear()
        self._requests.clear()
        del self.runner, self.cache, self.weights
        if self._torch_device.type == "cuda":
            torch.cuda.empty_cache()

    # --- one iteration, in three parts ----------------------------------------------------
    # step() = _schedule -> _forward -> _advance. Tests call the parts to read the logits of a
    # real iteration.

    def _schedule(self) -> list[_Request]:
        """Apply the scheduling decision (preempt, admit, grow block tables); return the
        requests that run in this iteration."""
        self._check_open()
        allocator = self.cache.allocator
        decision = schedule(
            [SeqView(r.request_id, len(r.token_ids), len(r.blocks)) for r in self._running],
            [SeqView(r.request_id, len(r.token_ids)) for r in self._waiting],
            allocator.num_free,
            self._sched,
        )
        for rid in decision.preempt:  # newest first, so the oldest ends at the queue's front
            req = self._requests[rid]
            self._running.remove(req)
            self._release(req)
            self._waiting.appendleft(req)
        for rid in decision.prefill:
            req = self._waiting.popleft()
            assert req.request_id == rid, "the scheduler admits from the front of the queue"
            self._running.append(req)
        for req in self._running:
            missing = blocks_for(len(req.token_ids), self._sched.block_size) - len(req.blocks)
            if missing > 0:
                req.blocks.extend(allocator.allocate(missing))
        return list(self._running)

    def _forward(self, scheduled: Sequence[_Request]) -> torch.Tensor:
        """Float32 logits ``[len(scheduled), vocab]`` for each request's next token."""
        chunks = [
            SeqChunk(r.token_ids[r.num_computed :], r.num_computed, r.blocks) for r in scheduled
        ]
        batch = build_batch(chunks, block_size=self._sched.block_size, device=self._torch_device)
        return self.runner.forward(batch, self.cache)

    def _advance(self, scheduled: Sequence[_Request], logits: torch.Tensor) -> list[EngineOutput]:
        tokens = sampling.sample(
            logits, [r.sampling for r in scheduled], [r.generator for r in scheduled]
        )
        outputs = []
        for req, token in zip(scheduled, tokens, strict=True):
            req.num_computed = len(req.token_ids)
            req.token_ids.append(token)
            reason = sampling.finish_reason(
                token,
                num_output_tokens=req.num_output,
                num_tokens=len(req.token_ids),
                params=req.sampling,
                eos_token_ids=self.config.eos_token_ids,
                max_model_len=self.max_model_len,
            )
            if reason is not None:
                self._running.remove(req)
                del self._requests[req.request_id]
                self._release(req)
            outputs.append(
                EngineOutput(
                    request_id=req.request_id,
                    new_token_ids=[token],
                    finished=reason is not None,
                    finish_reason=reason,
                    num_prompt_tokens=req.prompt_len,
                )
            )
        return outputs

    def _release(self, req: _Request) -> None:
        # Preempted requests are recomputed from their tokens, so their cache state goes too.
        self.cache.allocator.free(req.blocks)
        req.blocks = []
        req.num_computed = 0

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")
