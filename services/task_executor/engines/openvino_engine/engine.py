"""OpenVINOEngine: OpenVINO GenAI's ContinuousBatchingPipeline behind the Engine protocol.

The pipeline owns scheduling, the paged KV cache and prefix caching; this class maps
meshserve's requests onto it and its per-request GenerationHandles back onto EngineOutputs.
It serves the IR that ``convert.ensure_ir`` makes next to the checkpoint (converting on first
use). The frontend tokenizes, so requests enter as token ids and leave as token ids; the
OpenVINO tokenizer in the IR directory is loaded by the pipeline but never used.

Two places where GenAI's rules differ from the Engine protocol's, and what is done about it:
- GenAI's ``ignore_eos`` also silences ``stop_token_ids``; meshserve stops on a stop token
  even with ignore_eos. For such requests the stop tokens are checked here, after each step.
- GenAI reports neither per-request prefix-cache hits nor what its cache holds, so
  ``num_cached_tokens`` and the stats' prefix-cache counters stay 0, and the engine
  declares no ``kv_events``: it has nothing to tell a router.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
import openvino_genai as ov_genai

from services.task_executor.engines.base import (
    EngineCapabilities,
    EngineOutput,
    EngineRequest,
    EngineStats,
    PrefillBudget,
    check_prompt,
)
from services.task_executor.engines.openvino_engine.convert import ensure_ir, is_complete
from shared.messages.api import SamplingParams
from shared.messages.tasks import TaskMode

# GenAI's paged-attention block on CPU (16 on GPU). It is not exposed by the API; the unit
# tests check the KV arithmetic below against the bytes the pipeline really allocates.
CPU_BLOCK_SIZE = 32
# The most tokens one step computes. GenAI's ContinuousBatchingPipeline.step() holds the GIL
# for the whole step (its Python binding does not release it; generate() does), so a TE runs
# this engine in a child process (engines/process.py) and its event loop never waits on a
# step. Short steps still bound how long running decodes wait behind a prompt chunk, at no
# cost in prefill rate: on a 2-core AVX2 host, int8 Qwen2-0.5B, a 1,024-token prompt, the
# longest step took 6.3 s with 2,048-token steps and 1.6 s with 256 (184 vs 188 tok/s).
DEFAULT_STEP_TOKENS = 256
PRECISIONS = ("f32", "bf16", "f16", "u8")
# Same rule as the torch engine: host memory is shared with everything else on the node.
DEFAULT_CPU_KV_BYTES = 1 << 30

_FINISH = {
    ov_genai.GenerationFinishReason.STOP: "stop",
    ov_genai.GenerationFinishReason.LENGTH: "length",
}


@dataclasses.dataclass(frozen=True, slots=True)
class IRConfig:
    """What the engine needs to know of the model, read from the IR's config files."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: frozenset[int]


def load_ir_config(path: Path) -> IRConfig:
    cfg = json.loads((path / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    eos: set[int] = set()
    gen_path = path / "generation_config.json"
    for source in (cfg, json.loads(gen_path.read_text()) if gen_path.is_file() else {}):
        ids = source.get("eos_token_id")
        eos.update([ids] if isinstance(ids, int) else ids or [])
    return IRConfig(
        num_layers=cfg["num_hidden_layers"],
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab_size=cfg["vocab_size"],
        max_position_embeddings=cfg["max_position_embeddings"],
        eos_token_ids=frozenset(eos),
    )


def kv_bytes_per_block(cfg: IRConfig, precision: str, block_size: int = CPU_BLOCK_SIZE) -> int:
    """Bytes of K and V for one block of tokens in every layer, as the CPU plugin lays them out."""
    if precision == "u8":
        # One byte per element, plus a float32 scale and zero point per channel of a key
        # block (keys are quantized by channel) and per token of a value block.
        k_and_v = 2 * block_size * cfg.head_dim + 8 * (cfg.head_dim + block_size)
    else:
        k_and_v = 2 * block_size * cfg.head_dim * (4 if precision == "f32" else 2)
    return cfg.num_layers * cfg.num_kv_heads * k_and_v


def default_inference_precision() -> str:
    """What the CPU plugin computes in when not told: bf16 on CPUs with bf16 units, else f32."""
    return ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name()


@dataclasses.dataclass(slots=True, eq=False)
class _Request:
    request_id: str
    handle: Any  # ov_genai.GenerationHandle
    prompt_len: int
    max_new_tokens: int
    # Checked here rather than by GenAI: see the module docstring.
    own_stop_ids: frozenset[int]
    num_output: int = 0


class OpenVINOEngine:
    name = "openvino"
    device = "cpu"

    def __init__(
        self,
        model_dir: Path | str,
        *,
        weight_format: str = "int8",
        ir_dir: Path | str | None = None,
        max_num_seqs: int = 32,
        kv_cache_bytes: int | None = None,
        num_kv_blocks: int | None = None,
        max_model_len: int | None = None,
        max_num_batched_tokens: int = DEFAULT_STEP_TOKENS,
        enable_prefix_caching: bool = True,
        inference_precision: str | None = None,
        kv_cache_precision: str | None = None,
        num_threads: int | None = None,
        properties: Mapping[str, Any] | None = None,
        export_python: str | None = None,
        export_venv: str | None = None,
        model_cache: Path | str | None = None,
    ) -> None:
        """``model_dir`` is the Hugging Face checkpoint; its IR in ``weight_format`` is made on
        first use unless ``ir_dir`` names one. ``inference_precision`` ("f32", "bf16") defaults
        to the plugin's choice (bf16 where the CPU has bf16 units); ``kv_cache_precision``
        ("f32", "bf16", "f16", "u8") defaults to the inference precision. f32/f32 gives the
        same greedy tokens as transformers in float32. ``export_python`` / ``export_venv``:
        the interpreter that converts the checkpoint (``convert.ensure_ir``).
        ``model_cache``: OpenVINO's compiled-model cache directory (``CACHE_DIR``): the first
        load compiles and stores the compiled model there, later ones import it."""
        path = (
            Path(ir_dir)
            if ir_dir is not None
            else ensure_ir(model_dir, weight_format, python=export_python, export_venv=export_venv)
        )
        if not is_complete(path):
            raise FileNotFoundError(f"{path} holds no OpenVINO IR (openvino_model.xml/.bin)")
        self.ir_dir = path
        self.weight_format = weight_format
        self.config = cfg = load_ir_config(path)

        self.inference_precision = inference_precision or default_inference_precision()
        self.kv_cache_precision = kv_cache_precision or self.inference_precision
        for what, value in (
            ("inference_precision", self.inference_precision),
            ("kv_cache_precision", self.kv_cache_precision),
        ):
            if value not in PRECISIONS:
                raise ValueError(f"{what} must be one of {PRECISIONS}, not {value!r}")

        wanted_len = max_model_len or cfg.max_position_embeddings
        if wanted_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len {wanted_len} exceeds the model's {cfg.max_position_embeddings}"
            )
        self.block_size = CPU_BLOCK_SIZE
        self.block_bytes = kv_bytes_per_block(cfg, self.kv_cache_precision, self.block_size)
        if num_kv_blocks is None:
            if kv_cache_bytes is None:
                blocks_per_seq = -(-wanted_len // self.block_size)
                kv_cache_bytes = min(
                    max_num_seqs * blocks_per_seq * self.block_bytes, DEFAULT_CPU_KV_BYTES
                )
            num_kv_blocks = kv_cache_bytes // self.block_bytes
        if num_kv_blocks < 1:
            raise ValueError("the KV cache budget does not hold a single block")
        capacity = num_kv_blocks * self.block_size
        if max_model_len is not None and max_model_len > capacity:
            raise ValueError(
                f"max_model_len {max_model_len} does not fit a KV cache of {capacity} tokens"
            )
        # A sequence that could outgrow the whole cache could not run even alone.
        self.max_model_len = min(wanted_len, capacity)
        self.num_kv_blocks = num_kv_blocks

        sched = ov_genai.SchedulerConfig()
        sched.num_kv_blocks = num_kv_blocks
        sched.max_num_seqs = max_num_seqs
        # The most tokens one step runs: long prompts are prefilled in chunks of this size
        # alongside the running decodes (dynamic split-fuse). See DEFAULT_STEP_TOKENS.
        sched.max_num_batched_tokens = max_num_batched_tokens
        sched.dynamic_split_fuse = True
        self.prefill_budget = PrefillBudget(max_num_batched_tokens, chunked=True)
        sched.enable_prefix_caching = enable_prefix_caching
        self.capabilities = EngineCapabilities(
            modes=frozenset({TaskMode.COLOCATED}), prefix_cache=enable_prefix_caching
        )
        props: dict[str, Any] = {
            "INFERENCE_PRECISION_HINT": self.inference_precision,
            "KV_CACHE_PRECISION": self.kv_cache_precision,
        }
        if num_threads:
            props["INFERENCE_NUM_THREADS"] = num_threads
        if model_cache:
            Path(model_cache).mkdir(parents=True, exist_ok=True)
            props["CACHE_DIR"] = str(model_cache)
        props.update(properties or {})
        self._pipe = ov_genai.ContinuousBatchingPipeline(str(path), sched, "CPU", props)
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._closed = False

    # --- Engine protocol ---------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        self._check_open()
        prompt = request.prompt_token_ids
        check_prompt(prompt, max_model_len=self.max_model_len, vocab_size=self.config.vocab_size)
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id!r} is already queued")
        ids = np.asarray([prompt], dtype=np.int64)
        config, own_stop_ids = self._generation_config(request.sampling, len(prompt))
        handle = self._pipe.add_request(next(self._ids), ov.Tensor(ids), config)
        self._requests[request.request_id] = _Request(
            request_id=request.request_id,
            handle=handle,
            prompt_len=len(prompt),
            max_new_tokens=config.max_new_tokens,
            own_stop_ids=own_stop_ids,
        )

    def abort(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None:
            # The pipeline frees its blocks at its next step; has_work stays true until then.
            req.handle.cancel()

    def has_work(self) -> bool:
        return bool(self._requests) or (not self._closed and self._pipe.has_non_finished_requests())

    def step(self) -> Sequence[EngineOutput]:
        self._check_open()
        if not self.has_work():
            return []
        self._pipe.step()
        outputs = []
        for req in list(self._requests.values()):
            out = self._collect(req)
            if out is not None:
                outputs.append(out)
        return outputs

    def stats(self) -> EngineStats:
        if self._closed:
            return EngineStats(running=0, waiting=0, free_kv_blocks=0, total_kv_blocks=0)
        live = len(self._requests)
        if not self.has_work():
            # Idle: every block is free or an evictable prefix-cache block. The metrics would
            # still describe the last step, with the requests that finished in it.
            return EngineStats(
                running=0,
                waiting=0,
                free_kv_blocks=self.num_kv_blocks,
                total_kv_blocks=self.num_kv_blocks,
            )
        m = self._pipe.get_metrics()  # as of the pipeline's last step
        running = min(m.scheduled_requests, live)
        used = round(m.cache_usage / 100 * self.num_kv_blocks)
        return EngineStats(
            running=running,
            waiting=live - running,
            free_kv_blocks=max(self.num_kv_blocks - used, 0),
            total_kv_blocks=self.num_kv_blocks,
        )

    def close(self) -> None:
        if self._closed:
            return
        for req in self._requests.values():
            req.handle.cancel()
        self._requests.clear()
        # One more step lets the pipeline retire the cancelled requests and return their
        # blocks before it is destroyed (it reports them as leaked otherwise).
        if self._pipe.has_non_finished_requests():
            self._pipe.step()
        self._closed = True
        del self._pipe

    # --- helpers ---------------------------------------------------------------------------

    def kv_cache_bytes_allocated(self) -> int:
        """What the pipeline has allocated for the KV cache (0 before the first step)."""
        return self._pipe.get_metrics().kv_cache_size_in_bytes

    def _generation_config(
        self, params: SamplingParams, prompt_len: int
    ) -> tuple[ov_genai.GenerationConfig, frozenset[int]]:
        if params.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if params.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < params.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        config = ov_genai.GenerationConfig()
        config.max_new_tokens = min(params.max_tokens, self.max_model_len - prompt_len)
        if params.temperature == 0:
            config.do_sample = False
        else:
            config.do_sample = True
            config.temperature = params.temperature
            config.top_p = params.top_p
            # Each request draws from its own generator: a seed gives the same tokens whatever
            # else shares the batch, and no seed must not mean GenAI's fixed default.
            config.rng_seed = params.seed if params.seed is not None else secrets.randbits(63)
        stop = frozenset(params.stop_token_ids)
        if params.ignore_eos:
            config.ignore_eos = True
            return config, stop
        # The IR's EOS ids would be added by the pipeline anyway; both config files count.
        config.stop_token_ids = set(stop | self.config.eos_token_ids)
        return config, frozenset()

    def _collect(self, req: _Request) -> EngineOutput | None:
        handle = req.handle
        status = handle.get_status()
        new: list[int] = []
        reason = ov_genai.GenerationFinishReason.NONE
        if handle.can_read():
            for seq in handle.read().values():  # one sequence per request
                new.extend(seq.generated_ids)
                reason = seq.finish_reason
        finish: str | None = None
        if req.own_stop_ids:
            hit = next((i for i, t in enumerate(new) if t in req.own_stop_ids), None)
            if hit is not None:
                del new[hit + 1 :]
                finish = "stop"
                handle.cancel()
        req.num_output += len(new)
        if finish is None and status != ov_genai.GenerationStatus.RUNNING:
            if status == ov_genai.GenerationStatus.FINISHED:
                finish = _FINISH.get(reason) or (
                    "length" if req.num_output >= req.max_new_tokens else "stop"
                )
            else:  # IGNORED: the pipeline dropped it (it never fit the cache)
                finish = "abort"
        if finish is None and not new:
            return None
        if finish is not None:
            del self._requests[req.request_id]
        return EngineOutput(
            request_id=req.request_id,
            new_token_ids=new,
            finished=finish is not None,
            finish_reason=finish,
            num_prompt_tokens=req.prompt_len,
        )

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")
