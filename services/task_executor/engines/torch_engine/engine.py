"""TorchEngine: meshserve's own model runner behind the Engine protocol.

Beyond the protocol it caches prefixes (``prefix_cache``: blocks shared by content, a host tier,
pins, KV events for a router) and moves a request's KV between instances (``export_kv`` /
``import_kv``, the base of PD disaggregation).

With ``async_scheduling`` (the default; on CUDA, and on CPU only with ``overlap_on_cpu``)
steady decoding is pipelined one iteration deep: before a decode step waits for its tokens, it
launches the next one, fed by the tokens still on the device (see ``_look_ahead``), so the
host's bookkeeping and the caller's work between steps run while the device computes. Outputs
are the synchronous path's.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import math
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from services.task_executor.engines.base import (
    EngineCapabilities,
    EngineOutput,
    EngineRequest,
    EngineStats,
    LoadReport,
    PrefillBudget,
    check_prompt,
)
from services.task_executor.engines.capabilities import CapabilityError, TensorSource
from services.task_executor.engines.torch_engine import linear, sampling
from services.task_executor.engines.torch_engine.config import ModelConfig, load_model_config
from services.task_executor.engines.torch_engine.cuda_graphs import DecodeGraphs
from services.task_executor.engines.torch_engine.host_malloc import keep_large_allocations
from services.task_executor.engines.torch_engine.kv_cache import PagedKVCache
from services.task_executor.engines.torch_engine.kv_transfer import KvExport, model_fingerprint
from services.task_executor.engines.torch_engine.model import (
    ForwardBatch,
    SeqChunk,
    Transformer,
    build_batch,
    to_device,
)
from services.task_executor.engines.torch_engine.overlap import (
    Launch,
    OverlapStats,
    make_launcher,
)
from services.task_executor.engines.torch_engine.prefix_cache import PrefixCache
from services.task_executor.engines.torch_engine.scheduler import (
    SchedulerConfig,
    SeqView,
    blocks_for,
    blocks_needed,
    enqueue,
    pacing,
    queue_due,
    schedule,
    tpot_slack,
)
from services.task_executor.engines.torch_engine.threads import IntraOpThreads
from services.task_executor.engines.torch_engine.weights import CheckpointTensors, load_weights
from services.task_executor.weight_cache.store import CacheSession, HostWeightCache, Received
from shared.block_hash import chain_hashes, extend_chain
from shared.messages.api import SamplingParams
from shared.messages.kv import KvEvent
from shared.messages.scaling import InstanceCapacity
from shared.messages.tasks import TaskMode
from shared.native import DEFAULT_TOOLCHAIN, Toolchain

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

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


@dataclasses.dataclass(slots=True, eq=False)
class _Request:
    request_id: str
    prompt_len: int
    token_ids: list[int]  # prompt, then the tokens generated so far
    sampling: SamplingParams
    generator: torch.Generator
    blocks: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # leading tokens whose K/V is in the cache
    num_scheduled: int = 0  # tokens it computes in the iteration under way
    block_hashes: list[int] = dataclasses.field(default_factory=list)  # of full blocks
    num_committed: int = 0  # leading blocks already offered to the prefix cache's index
    num_cached_tokens: int | None = None  # served from the cache at the first admission
    reported_cached: bool = False  # the first output (which carries num_cached_tokens) is out
    retain_kv: bool = False  # keep the KV after finishing, for export_kv
    imported_kv: torch.Tensor | None = None  # [layers, 2, tokens, kv_heads, hd], until admitted
    # Sampling draws taken for the next tokens but not yet spent (a launch ahead takes its draw
    # early; if its token is thrown away, the recomputation reuses it).
    uniforms: list[torch.Tensor] = dataclasses.field(default_factory=list)
    first_token_at: float | None = None  # monotonic seconds its first output token came out
    due: float = math.inf  # monotonic seconds its first token is due (its TTFT target)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def samples(self) -> bool:
        """Whether the iteration under way produces its next token (it does unless it computes
        a chunk of a prompt that goes on)."""
        return self.num_computed + self.num_scheduled == len(self.token_ids)

    def chunk(self) -> SeqChunk:
        """What it computes in the iteration under way."""
        end = self.num_computed + self.num_scheduled
        return SeqChunk(self.token_ids[self.num_computed : end], self.num_computed, self.blocks)


@dataclasses.dataclass(slots=True, eq=False)
class _Ahead:
    """An iteration launched before the previous one's tokens reached the host."""

    launch: Launch
    size: int  # rows
    # request -> (row, position it computes, block that position is written to)
    rows: dict[_Request, tuple[int, int, int]]

    def reusable(self, scheduled: Sequence[_Request], block_size: int) -> dict[_Request, int]:
        """The rows that computed what ``scheduled`` needs now: the same request at the same
        position in the same block."""
        found = {}
        for r in scheduled:
            rec = self.rows.get(r)
            if rec is None:
                continue
            row, pos, block = rec
            if (
                r.num_computed == pos
                and len(r.token_ids) == pos + 1
                and r.blocks[pos // block_size] == block
            ):
                found[r] = row
        return found


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


class TorchEngine:
    name = "torch"

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
        max_prefill_tokens: int | None = None,
        chunked_prefill: bool = True,
        enable_prefix_caching: bool = True,
        num_host_kv_blocks: int = 0,
        async_scheduling: bool = True,
        overlap_on_cpu: bool = False,
        cpu_kernels: bool = True,
        kernel_toolchain: Toolchain | None = None,
        cuda_graphs: bool = True,
        tensors: TensorSource | None = None,
        weight_cache: HostWeightCache | None = None,
        model_name: str | None = None,
        load_report: LoadReport | None = None,
        weights_from: str | None = None,
        received: Received | None = None,
    ) -> None:
        """``tensors``: where the weights come from (default: the checkpoint's safetensors
        files in ``model_dir``). ``model_dir`` still gives the config.

        ``weight_cache``: the host's weight cache; each weight is mapped from it where it is
        there already in this engine's form, else made from ``tensors`` and stored
        (``weight_cache/store.py``), under ``model_name`` (default: the directory's name).
        ``load_report``: filled with what the load took from the cache and its phases
        (seconds: ``weights`` in all, ``fingerprint``, ``map``, ``fetch``, ``build`` with a
        cache, then ``engine_init``; ``store_after_load`` once stored).
        ``weights_from``: ``host:port`` of another host's weight server (a fork): what this
        host's cache lacks is fetched from there before it is built from the checkpoint.
        ``received``: the model's entries as a multicast delivered them (used first).

        ``num_host_kv_blocks``: size of the prefix cache's host-memory tier (0: none). With
        one, blocks evicted from the device are copied there, and ``offload_kv`` works.

        ``async_scheduling``: overlap the host side of steady decoding with the forward (one
        iteration launched ahead) where the device runs asynchronously (CUDA); False runs
        every iteration to completion before the next is scheduled (same outputs; for A/B
        comparison and debugging). On CPU iterations run synchronously unless
        ``overlap_on_cpu``, which runs the forward on a worker thread (no gain measured on a
        2-core host: see ``overlap.make_launcher``).

        ``max_prefill_tokens``: prompt tokens computed per iteration; None: by device
        (``DEFAULT_PREFILL_TOKENS``) until ``pace_prefill`` hands the engine its measured
        costs, and from then on paced (``PACED_PREFILL_TOKENS``). ``chunked_prefill``:
        a prompt longer than what is left of that budget computes in chunks over several
        iterations, beside the running requests' decode steps, instead of whole in one
        iteration that stalls them (see ``scheduler``).

        ``cpu_kernels``: on CPU, decode attention runs in a C kernel compiled for the host on
        first use (``cpu_kernels.py``, with ``kernel_toolchain``: the compiler and where built
        kernels are kept); False, or no C compiler, keeps torch's ops.

        ``cuda_graphs``: on CUDA, decode iterations replay graphs captured per batch and
        context bucket (``cuda_graphs.py``); False launches every kernel from Python."""
        torch_device = resolve_device(device)
        if torch_device.type == "cpu":
            keep_large_allocations()  # host_malloc.py: no page faults on every prefill
        paceable = max_prefill_tokens is None and chunked_prefill
        if max_prefill_tokens is None:
            max_prefill_tokens = DEFAULT_PREFILL_TOKENS.get(torch_device.type, 2048)
        if max_prefill_tokens < 1:
            raise ValueError("max_prefill_tokens must be at least 1")
        self.device = str(torch_device)
        self.config = load_model_config(model_dir)
        self.model_fingerprint = model_fingerprint(model_dir)
        cached = enable_prefix_caching
        self.capabilities = EngineCapabilities(
            modes=frozenset({TaskMode.COLOCATED}),
            prefix_cache=cached,
            kv_events=cached,
            kv_export=True,
            kv_import=True,
            prefix_pinning=cached,
            host_kv_tier=cached and num_host_kv_blocks > 0,
            weight_source=True,
            prefill_pacing=paceable,
        )
        self.dtype = resolve_dtype(dtype, self.config, torch_device)
        if tensors is None:
            tensors = CheckpointTensors(Path(model_dir))
        report = load_report if load_report is not None else LoadReport()
        t_weights = time.monotonic()
        self._weights_stored: CacheSession | None = None  # swapped in once stored
        if weight_cache is not None:
            name = model_name or Path(model_dir).name
            self._weights_stored = weight_cache.session(
                name, Path(model_dir), report, weights_from, received
            )
        self.weights = load_weights(
            tensors,
            self.config,
            dtype=self.dtype,
            device=torch_device,
            derived=self._weights_stored,
        )
        t_init = time.monotonic()
        report.add_phase("weights", t_init - t_weights)

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
        self.prefix_cache = PrefixCache(
            self.cache, enabled=enable_prefix_caching, num_host_blocks=num_host_kv_blocks
        )
        self.runner = Transformer(
            cfg,
            self.weights,
            max_model_len=self.max_model_len,
            dtype=self.dtype,
            device=torch_device,
            cpu_kernels=cpu_kernels,
            toolchain=kernel_toolchain or DEFAULT_TOOLCHAIN,
        )
        if cuda_graphs and torch_device.type == "cuda":
            self.runner.graphs = DecodeGraphs(
                self.runner.forward_eager,
                ForwardBatch,
                max_batch=max_num_seqs,
                max_blocks=blocks_for(self.max_model_len, block_size),
                block_size=block_size,
                device=torch_device,
            )
        self._torch_device = torch_device
        # On a CPU: one intra-op thread for iterations too short to split (threads.py).
        self._threads = (
            IntraOpThreads(torch.get_num_threads()) if torch_device.type == "cpu" else None
        )
        self.block_size = block_size
        self.max_prefill_tokens = max_prefill_tokens
        self.chunked_prefill = chunked_prefill
        self.prefill_budget = PrefillBudget(
            max_prefill_tokens,
            chunked_prefill,
            PACED_PREFILL_TOKENS.get(torch_device.type, 2048) if paceable else 0,
        )
        self._sched = SchedulerConfig(
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_prefill_tokens=max_prefill_tokens,
            chunked_prefill=chunked_prefill,
            # ~1% of the cache kept back at admission, so newly admitted requests do not force
            # a preemption on their first decode steps.
            watermark_blocks=max(1, num_kv_blocks // 100),
        )
        self._running: list[_Request] = []  # admission order: the last one is preempted first
        self._waiting: collections.deque[_Request] = collections.deque()
        self._requests: dict[str, _Request] = {}
        self._retained: dict[str, _Request] = {}  # finished with retain_kv, awaiting export
        self._cache_queries = 0
        self._cache_hits = 0
        self._final_events: list[KvEvent] = []
        self._closed = False
        self._launcher = (
            make_launcher(torch_device, on_cpu=overlap_on_cpu) if async_scheduling else None
        )
        self._ahead: _Ahead | None = None
        self.overlap = OverlapStats()
        # Set once asked for work with none waiting or running (``has_work``), until the next
        # request: the weights this load built are stored into the host cache only then
        # (``CacheSession.finish``), after the capacity probes and between requests.
        self._idle = threading.Event()
        if self._weights_stored is not None:
            # Swapped in between steps where the engine's weights are the host's own: on CPU,
            # with forwards on the calling thread (``step``).
            swap = torch_device.type == "cpu" and self._launcher is None
            self._weights_stored.finish(swap=swap, idle=self._idle)
            if not swap:
                self._weights_stored = None
        report.add_phase("engine_init", time.monotonic() - t_init)

    # --- Engine protocol ---------------------------------------------------------------

    def add_request(self, request: EngineRequest, *, retain_kv: bool = False) -> None:
        """``retain_kv``: when the request finishes, keep its KV for ``export_kv`` until
        ``abort(request_id)`` or an export with ``release=True`` (a prefill-only instance
        runs requests with max_tokens=1 this way)."""
        req = self._new_request(request, list(request.prompt_token_ids))
        req.retain_kv = retain_kv
        self._enqueue(req)

    def abort(self, request_id: str) -> None:
        """Also drops KV retained for export."""
        retained = self._retained.pop(request_id, None)
        if retained is not None:
            self._release(retained)
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        if req in self._running:
            self._running.remove(req)
        else:
            self._waiting.remove(req)
        self._release(req)

    def has_work(self) -> bool:
        """Also lets the engine's background work go when there is none (``_idle``): the
        TE asks once a load is done and after every step."""
        if self._running or self._waiting:
            return True
        self._idle.set()
        return False

    def step(self) -> Sequence[EngineOutput]:
        outputs = self._step_overlapped() if self._launcher is not None else self._step_inline()
        self.has_work()  # idle now, if this step finished the last request
        return outputs

    @torch.inference_mode()
    def _step_inline(self) -> Sequence[EngineOutput]:
        self._swap_in_stored_weights()  # between forwards: none is running
        scheduled = self._schedule()
        if not scheduled:
            return []
        if self._threads is None:
            return self._advance(scheduled, self._forward(scheduled))
        t0 = time.perf_counter()
        outputs = self._advance(scheduled, self._forward(scheduled))
        if (threads := self._threads.took(time.perf_counter() - t0)) is not None:
            torch.set_num_threads(threads)
        return outputs

    def _swap_in_stored_weights(self) -> None:
        """Once the host cache holds what this load built, the cache's pages replace the
        engine's own copies (which are freed): the same values, shared with every TE."""
        stored = self._weights_stored
        if stored is None or (replacements := stored.replacements()) is None:
            return
        self._weights_stored = None
        self.weights.swap(replacements)

    def pace_prefill(
        self,
        capacity: InstanceCapacity,
        tpot_s: float,
        *,
        ttft_s: float = 0.0,
        ttft_per_token_s: float = 0.0,
    ) -> None:
        """Size each iteration's prompt tokens from now on by ``scheduler.prefill_budget``:
        this instance's measured costs, the decodes' TPOT target ``tpot_s``; with ``ttft_s``,
        prompts go by the deadline of their TTFT target (``scheduler.schedule``)."""
        if not self.capabilities.prefill_pacing:
            raise CapabilityError("pacing needs chunked prefill and no fixed max_prefill_tokens")
        ceiling = self.prefill_budget.paced_tokens
        paced = pacing(
            capacity,
            tpot_s=tpot_s,
            ceiling=ceiling,
            ttft_s=ttft_s,
            ttft_per_token_s=ttft_per_token_s,
        )
        self._sched = dataclasses.replace(self._sched, pacing=paced)

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self._running),
            waiting=len(self._waiting),
            free_kv_blocks=self.prefix_cache.num_free if not self._closed else 0,
            total_kv_blocks=self.cache.num_blocks if not self._closed else 0,
            prefix_cache_queries=self._cache_queries,
            prefix_cache_hit_tokens=self._cache_hits,
        )

    def close(self) -> None:
        if self._closed:
            return
        self._quiesce()
        if self._launcher is not None:
            self._launcher.close()
        self._closed = True
        self._running.clear()
        self._waiting.clear()
        self._requests.clear()
        self._retained.clear()
        self._idle.set()  # a store still waiting finishes: the next load maps it
        self.prefix_cache.clear()
        self._final_events = self.prefix_cache.drain_events()
        del self.runner, self.cache, self.weights, self.prefix_cache
        if self._torch_device.type == "cuda":
            torch.cuda.empty_cache()

    # --- prefix cache (engine-specific) ---------------------------------------------------

    def drain_kv_events(self) -> list[KvEvent]:
        """What entered and left the prefix cache since the last call (also after close,
        which clears the cache)."""
        if self._closed:
            events, self._final_events = self._final_events, []
            return events
        return self.prefix_cache.drain_events()

    def block_hashes(self, token_ids: Sequence[int]) -> list[int]:
        """The chained hashes of the full blocks of ``token_ids`` at this engine's block size
        (what a router matches against the KV events)."""
        return chain_hashes(token_ids, self._sched.block_size)

    def pin_prefix(self, cache_id: str, token_ids: Sequence[int]) -> int:
        """Keep the cached prefix of ``token_ids`` in device memory under ``cache_id`` (for
        context caching); returns the tokens it covers. Run the prefix first (max_tokens=1):
        only what is cached now is pinned. Requests whose prompt starts with it then reuse it."""
        self._check_open()
        self._quiesce()
        return self.prefix_cache.pin(cache_id, token_ids)

    def unpin_prefix(self, cache_id: str) -> bool:
        self._check_open()
        return self.prefix_cache.unpin(cache_id)

    def pinned_prefix(self, cache_id: str) -> tuple[list[int], int] | None:
        """(the token ids pinned under ``cache_id``, how many of them are cached), or None."""
        self._check_open()
        match = self.prefix_cache.match_cache_id(cache_id)
        if match is None:
            return None
        self.prefix_cache.free(match.blocks)
        return list(match.token_ids), match.num_tokens

    def offload_kv(self, block_hashes: Sequence[int]) -> int:
        """Copy cached blocks to the host tier; returns how many were copied."""
        self._check_open()
        self._quiesce()
        return self.prefix_cache.offload(block_hashes)

    def populate_kv(self, block_hashes: Sequence[int]) -> int:
        """Copy host-tier blocks back to the device; returns how many were copied."""
        self._check_open()
        self._quiesce()
        return self.prefix_cache.populate(block_hashes)

    # --- KV export / import (engine-specific) ----------------------------------------------

    def export_kv(self, request_id: str, *, release: bool = False) -> KvExport:
        """The KV a request has computed so far: a running request, or a finished one added
        with ``retain_kv``; ``release`` drops a retained one's KV afterwards."""
        self._check_open()
        self._quiesce()
        req = self._requests.get(request_id) or self._retained.get(request_id)
        if req is None:
            raise KeyError(f"no request {request_id!r} holds KV here")
        if req.num_computed == 0:
            raise ValueError(f"request {request_id!r} has no KV yet (waiting or preempted)")
        n, bs, cfg = req.num_computed, self._sched.block_size, self.config
        idx = torch.tensor(req.blocks[: blocks_for(n, bs)], device=self._torch_device)
        kv = torch.stack(
            [torch.stack((k.index_select(0, idx), v.index_select(0, idx))) for k, v in self._kv()]
        ).cpu()
        # The last block's slots past n hold stale data from earlier owners; zero keeps the
        # bytes deterministic.
        kv.view(cfg.num_layers, 2, -1, cfg.num_kv_heads, cfg.head_dim)[:, :, n:] = 0
        export = KvExport(
            token_ids=list(req.token_ids),
            num_prompt_tokens=req.prompt_len,
            num_computed_tokens=n,
            block_size=bs,
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=str(self.dtype).removeprefix("torch."),
            model_fingerprint=self.model_fingerprint,
            kv=kv,
        )
        if release and request_id in self._retained:
            self._release(self._retained.pop(request_id))
        return export

    def import_kv(self, export: KvExport, request: EngineRequest) -> None:
        """Queue ``request`` to continue where ``export`` (from this model, on any instance)
        left off: its KV is copied in when the request is admitted, and decoding goes on from
        the export's last token, counting the tokens generated before it toward max_tokens.
        The KV may come at another block size or dtype. Raises ValueError for another model or
        a request that does not match the export."""
        self._check_open()
        cfg = self.config
        if export.model_fingerprint != self.model_fingerprint:
            raise ValueError("the KV export comes from a different model")
        shape = (export.num_layers, export.num_kv_heads, export.head_dim)
        if shape != (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim):
            raise ValueError(f"the KV export's (layers, kv heads, head dim) {shape} do not fit")
        prompt = list(request.prompt_token_ids)
        if prompt != export.token_ids[: export.num_prompt_tokens]:
            raise ValueError("the request's prompt is not the one the KV was computed for")
        tokens = list(export.token_ids)
        req = self._new_request(request, tokens, prompt_len=len(prompt))
        if req.num_output >= request.sampling.max_tokens:
            raise ValueError("the exported request has already produced max_tokens tokens")
        if request.sampling.temperature != 0:
            # One draw per sampled token (sampling.py): skip those the exporter made, so a
            # seeded request continues as if it had never moved.
            for _ in range(req.num_output):
                torch.rand(1, generator=req.generator)
        req.imported_kv = export.token_kv().to(self.dtype)
        self._enqueue(req)

    # --- one iteration, in three parts ----------------------------------------------------
    # step() = _schedule -> _forward -> _advance. Tests call the parts to read the logits of a
    # real iteration.

    def _schedule(self) -> list[_Request]:
        """Apply the scheduling decision (preempt, admit, grow block tables); return the
        requests that run in this iteration."""
        self._check_open()
        pc = self.prefix_cache
        running = [self._running_view(r) for r in self._running]
        if sum(blocks_needed(v, self._sched.block_size) for v in running) > pc.num_free:
            # Preemption is coming: what a victim gives back excludes blocks others share.
            running = [
                dataclasses.replace(v, num_shared_blocks=self._num_shared(r))
                for v, r in zip(running, self._running, strict=True)
            ]
        # Only the requests that could join are looked up: a long queue costs nothing.
        room = max(0, self._sched.max_num_seqs - len(self._running))
        waiting = [self._waiting_view(r) for r in itertools.islice(self._waiting, room)]
        decision = schedule(running, waiting, pc.num_free, self._sched)
        for rid in decision.preempt:  # newest first, so the oldest ends at the queue's front
            req = self._requests[rid]
            self._running.remove(req)
            self._release(req)
            self._waiting.appendleft(req)
        for rid in decision.prefill:
            req = self._waiting.popleft()
            assert req.request_id == rid, "the scheduler admits from the front of the queue"
            self._admit(req)
            self._running.append(req)
        scheduled = []
        for req in self._running:
            end = decision.cache_len.get(req.request_id, 0)
            # An admission may match fewer cached tokens than the scheduler was shown (an
            # earlier one's blocks evicted them): its chunk then starts earlier.
            req.num_scheduled = max(0, end - req.num_computed)
            if req.num_scheduled:
                pc.append(req.blocks, end)
                pc.make_writable(req.blocks, req.num_computed, end)
                scheduled.append(req)
        return scheduled

    def _forward(self, scheduled: Sequence[_Request]) -> torch.Tensor:
        """Float32 logits ``[n, vocab]`` for the next token of each of the ``n`` scheduled
        requests that produce one (``_Request.samples``), in order."""
        return self.runner.forward(self._batch(scheduled), self.cache)

    def _batch(self, scheduled: Sequence[_Request]) -> ForwardBatch:
        return build_batch(
            [r.chunk() for r in scheduled],
            block_size=self._sched.block_size,
            device=self._torch_device,
            sampled=[r.samples for r in scheduled],
        )

    def _advance(self, scheduled: Sequence[_Request], logits: torch.Tensor) -> list[EngineOutput]:
        sampled = [r for r in scheduled if r.samples]
        params = [r.sampling for r in sampled]
        tokens = sampling.sample_tokens(logits, params, self._uniforms(sampled, 0)).tolist()
        return self._apply(scheduled, tokens)

    def _apply(self, scheduled: Sequence[_Request], tokens: Sequence[int]) -> list[EngineOutput]:
        """Append the new token of each request that produced one (``tokens``, in order);
        advance the others past their prompt chunk; finish, free and report."""
        outputs = []
        bs = self._sched.block_size
        new_tokens = iter(tokens)
        for req in scheduled:
            if not req.samples:  # a prompt chunk: its full blocks can be shared already
                req.num_computed += req.num_scheduled
                if self.prefix_cache.enabled:
                    req.num_committed = self.prefix_cache.commit(
                        req.blocks, req.block_hashes, req.num_computed, req.num_committed
                    )
                continue
            token = next(new_tokens)
            req.num_computed = len(req.token_ids)
            req.token_ids.append(token)
            if req.first_token_at is None:
                req.first_token_at = time.monotonic()
            if req.sampling.temperature != 0:
                req.uniforms.pop(0)
            if self.prefix_cache.enabled:
                extend_chain(req.block_hashes, req.token_ids, bs)
                req.num_committed = self.prefix_cache.commit(
                    req.blocks, req.block_hashes, req.num_computed, req.num_committed
                )
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
                if req.retain_kv:
                    self._retained[req.request_id] = req
                else:
                    self._release(req)
            cached = 0
            if not req.reported_cached:
                req.reported_cached = True
                cached = req.num_cached_tokens or 0
            outputs.append(
                EngineOutput(
                    request_id=req.request_id,
                    new_token_ids=[token],
                    finished=reason is not None,
                    finish_reason=reason,
                    num_prompt_tokens=req.prompt_len,
                    num_cached_tokens=cached,
                )
            )
        if next(new_tokens, None) is not None:
            raise AssertionError("more tokens than requests that produce one")
        return outputs

    # --- overlapped iterations (async_scheduling) -----------------------------------------
    # Steady decoding knows the next iteration before this one's tokens are on the host: the
    # same requests, one position further. So a decode step launches the next iteration right
    # behind its own, fed by the tokens still on the device, and only then waits for its own
    # tokens and does the bookkeeping; the next step() finds its forward already launched (or,
    # with the forward thread on CPU, already computed while the caller handled the outputs).
    #
    # The launched-ahead iteration is used only for what the synchronous path would run: at
    # the next step, _schedule() decides as always (adds, aborts, preemption, admissions),
    # and each scheduled request whose position the ahead iteration computed takes its row;
    # the rest run in a fresh launch. Rows of requests that finished (EOS, found one step
    # late) or were aborted are thrown away. Seeded sampling stays exact because a request's
    # draws are taken in token order and kept until the token is used (_Request.uniforms).
    #
    # Requests producing their first token never launch ahead (it would delay their TTFT on
    # CUDA: the host launches the next forward before it reads this one's tokens), nor do
    # iterations after which requests would be admitted or preempted (the ahead iteration
    # would be thrown away).

    @torch.inference_mode()
    def _step_overlapped(self) -> list[EngineOutput]:
        self._check_open()
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.launch.settle()  # on CPU, the cache is the host's again
        scheduled = self._schedule()
        if not scheduled:
            if ahead is not None:
                self.overlap.rows_wasted += ahead.size
            return []
        sources: list[tuple[Launch, int]] = []  # launches holding this iteration's tokens
        where: dict[_Request, tuple[int, int]] = {}  # request -> (source, row)
        if ahead is not None:
            reused = ahead.reusable(scheduled, self._sched.block_size)
            self.overlap.rows_used += len(reused)
            self.overlap.rows_wasted += ahead.size - len(reused)
            if reused:
                sources.append((ahead.launch, ahead.size))
                where = {r: (0, row) for r, row in reused.items()}
        fresh = [r for r in scheduled if r not in where]
        if fresh:
            sampled = [r for r in fresh if r.samples]
            where.update((r, (len(sources), row)) for row, r in enumerate(sampled))
            sources.append((self._launch(fresh), len(sampled)))
        try:
            self._ahead = self._look_ahead(scheduled, sources, where)
            host = [launch.host_tokens() for launch, _ in sources]
        except BaseException:
            # Nothing launched may still run when the next step writes the cache.
            for launch, _ in sources:
                with contextlib.suppress(Exception):
                    launch.settle()
            self._quiesce()
            raise
        tokens = [host[src][row] for src, row in (where[r] for r in scheduled if r.samples)]
        return self._apply(scheduled, tokens)

    def _launch(self, reqs: Sequence[_Request]) -> Launch:
        """Forward ``reqs`` as scheduled and sample those that produce a token (the
        synchronous path's iteration)."""
        assert self._launcher is not None
        batch = self._batch(reqs)
        sampled = [r for r in reqs if r.samples]
        params, uniforms = [r.sampling for r in sampled], self._uniforms(sampled, 0)
        runner, cache = self.runner, self.cache

        def run() -> torch.Tensor:
            return sampling.sample_tokens(runner.forward(batch, cache), params, uniforms)

        return self._launcher.launch_now(run)

    def _look_ahead(
        self,
        scheduled: Sequence[_Request],
        sources: Sequence[tuple[Launch, int]],
        where: dict[_Request, tuple[int, int]],
    ) -> _Ahead | None:
        """Launch the iteration after ``scheduled`` (whose tokens are still in ``sources``)
        when it is predictable; None when it is not."""
        assert self._launcher is not None
        max_len, bs = self.max_model_len, self._sched.block_size
        going_on = []
        need = 0  # new blocks the next iteration takes
        for r in scheduled:
            n = len(r.token_ids)
            if n - r.num_computed != 1 or n == r.prompt_len:
                return None  # someone's first token (or a prefill) is in this iteration
            if n - r.prompt_len + 1 < r.sampling.max_tokens and n + 1 < max_len:
                going_on.append(r)
                need += n >= len(r.blocks) * bs
        if not going_on:
            return None
        # The synchronous path's next decision, as far as it is known now (a stop token may
        # still end a request, and the caller may add or abort some): nothing may join or be
        # preempted, else the ahead iteration would be thrown away.
        pc = self.prefix_cache
        room = self._sched.max_num_seqs - len(going_on)
        if self._waiting and room > 0:
            running = [self._running_view(r, ahead=1) for r in going_on]
            waiting = [self._waiting_view(r) for r in itertools.islice(self._waiting, room)]
            decision = schedule(running, waiting, pc.num_free, self._sched)
            if decision.preempt or decision.prefill:
                return None
        elif need > pc.num_free:
            return None  # the scheduler would preempt

        rows = {}
        chunks = []
        for row, r in enumerate(going_on):
            pos = len(r.token_ids)  # where this iteration's token goes
            if pos >= len(r.blocks) * bs:
                pc.append(r.blocks, pos + 1)  # what the next _schedule would do, a step early
            rows[r] = (row, pos, r.blocks[pos // bs])
            chunks.append(SeqChunk((0,), pos, r.blocks))
        placeholder = torch.empty(0, dtype=torch.long)
        meta = build_batch(chunks, block_size=bs, device=self._torch_device, input_ids=placeholder)
        offsets = list(itertools.accumulate((n for _, n in sources), initial=0))
        picks = [offsets[src] + row for src, row in map(where.__getitem__, going_on)]
        pick = None
        if picks != list(range(offsets[-1])):
            pick = to_device(picks, torch.long, self._torch_device)
        launches = [launch for launch, _ in sources]
        params, uniforms = [r.sampling for r in going_on], self._uniforms(going_on, 1)
        runner, cache = self.runner, self.cache

        def run() -> torch.Tensor:
            prev = [launch.device_tokens() for launch in launches]
            ids = prev[0] if len(prev) == 1 else torch.cat(prev)
            if pick is not None:
                ids = ids.index_select(0, pick)
            logits = runner.forward(dataclasses.replace(meta, input_ids=ids), cache)
            return sampling.sample_tokens(logits, params, uniforms)

        self.overlap.launched += 1
        return _Ahead(self._launcher.launch_ahead(run), len(going_on), rows)

    def _uniforms(self, reqs: Sequence[_Request], ahead: int) -> list[torch.Tensor]:
        """For each request that samples, the draw for its token ``ahead`` tokens after the one
        it produces next, taken now if it was not taken yet (draws stay in token order)."""
        out = []
        for r in reqs:
            if r.sampling.temperature != 0:
                while len(r.uniforms) <= ahead:
                    r.uniforms.append(sampling.draw(r.generator))
                out.append(r.uniforms[ahead])
        return out

    def _quiesce(self) -> None:
        """Wait for a launched-ahead iteration before the host writes KV-cache memory outside
        step(). One that failed is dropped (its rows are recomputed; a lasting fault shows in
        the next step)."""
        if self._ahead is None:
            return
        try:
            self._ahead.launch.settle()
        except Exception:
            self._ahead = None

    # --- helpers -------------------------------------------------------------------------

    def _new_request(
        self, request: EngineRequest, token_ids: list[int], *, prompt_len: int | None = None
    ) -> _Request:
        self._check_open()
        prompt_len = len(token_ids) if prompt_len is None else prompt_len
        if not prompt_len:
            raise ValueError("the prompt is empty")
        check_prompt(token_ids, max_model_len=self.max_model_len, vocab_size=self.config.vocab_size)
        rid = request.request_id
        if rid in self._requests or rid in self._retained:
            raise ValueError(f"request {rid!r} is already queued")
        sampling.validate(request.sampling)
        return _Request(
            request_id=rid,
            prompt_len=prompt_len,
            token_ids=token_ids,
            sampling=request.sampling,
            generator=sampling.make_generator(request.sampling.seed),
        )

    def _enqueue(self, req: _Request) -> None:
        self._idle.clear()  # before anything else: a slice being stored finishes, no more
        if self.prefix_cache.enabled:
            req.block_hashes = chain_hashes(req.token_ids, self._sched.block_size)
        self._requests[req.request_id] = req
        if (paced := self._sched.pacing) is not None:
            req.due = time.monotonic() + paced.ttft_limit_s(req.prompt_len)
        enqueue(self._waiting, req, lambda r: queue_due(r.due, started=r.num_output > 0))

    def _reusable_hashes(self, req: _Request) -> list[int]:
        """Hashes of the blocks a waiting request may take from the cache: all its full blocks,
        or, imported, those its KV covers (the rest comes from the import)."""
        if req.imported_kv is not None:
            return req.block_hashes[: req.imported_kv.shape[2] // self._sched.block_size]
        return req.block_hashes

    def _running_view(self, req: _Request, ahead: int = 0) -> SeqView:
        """The scheduler's view of a running request (``ahead``: as it will be after that many
        more tokens, for a look-ahead)."""
        pacing, slack = self._sched.pacing, None
        if pacing is not None and req.first_token_at is not None:
            since = time.monotonic() - req.first_token_at
            slack = tpot_slack(pacing.tpot_s, req.num_output + ahead, since)
        n = len(req.token_ids) + ahead
        return SeqView(
            req.request_id,
            n,
            len(req.blocks),
            n - 1 if ahead else req.num_computed,
            tpot_slack_s=slack,
            ttft_left_s=self._ttft_left(req),
        )

    @staticmethod
    def _ttft_left(req: _Request) -> float:
        """Seconds until the request's first token is due: -inf for one that has produced
        tokens (preempted, its prompt recomputed: before any new prompt), inf without a
        deadline."""
        if req.first_token_at is not None:
            return -math.inf
        return req.due - time.monotonic() if req.due != math.inf else math.inf

    def _waiting_view(self, req: _Request) -> SeqView:
        found, in_use = self.prefix_cache.probe(self._reusable_hashes(req))
        n = len(req.token_ids)
        left = self._ttft_left(req)
        if req.imported_kv is not None:
            cached_kv = req.imported_kv.shape[2]
            return SeqView(req.request_id, n, in_use, num_cached_tokens=cached_kv, ttft_left_s=left)
        cached = found * self._sched.block_size
        # A fully cached sequence still computes its last token, into a copy of the last block.
        copy = int(cached >= n)
        return SeqView(
            req.request_id,
            n,
            in_use - copy,
            num_cached_tokens=min(cached, n - 1),
            ttft_left_s=left,
        )

    def _admit(self, req: _Request) -> None:
        """Give a request joining the batch its cached blocks (and its imported KV)."""
        pc = self.prefix_cache
        match = pc.match_hashes(self._reusable_hashes(req))
        req.blocks = list(match.blocks)
        req.num_committed = len(match.blocks)
        if req.imported_kv is not None:
            kv, req.imported_kv = req.imported_kv, None
            start, n = match.num_tokens, kv.shape[2]
            pc.append(req.blocks, n)
            bs = self._sched.block_size
            slots = torch.tensor(
                [req.blocks[p // bs] * bs + p % bs for p in range(start, n)],
                device=self._torch_device,
            )
            for layer in range(self.config.num_layers):
                k = kv[layer, 0, start:].to(self._torch_device)
                v = kv[layer, 1, start:].to(self._torch_device)
                self.cache.write(layer, slots, k, v)
            req.num_computed = n
            req.num_committed = pc.commit(req.blocks, req.block_hashes, n, req.num_committed)
            req.num_cached_tokens = 0  # imported, not served by this cache
            return
        req.num_computed = min(match.num_tokens, len(req.token_ids) - 1)
        if req.num_cached_tokens is None:  # first admission; a preempted one is not a query
            req.num_cached_tokens = req.num_computed
            if pc.enabled:
                self._cache_queries += req.prompt_len
                self._cache_hits += req.num_computed

    def _num_shared(self, req: _Request) -> int:
        return sum(self.prefix_cache.ref_count(b) > 1 for b in req.blocks)

    def _kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(self.cache.k, self.cache.v, strict=True))

    def _release(self, req: _Request) -> None:
        # Preempted requests are recomputed from their tokens (their full blocks usually
        # still sit in the prefix cache), so their own cache state goes.
        self.prefix_cache.free(req.blocks)
        req.blocks = []
        req.num_computed = 0
        req.num_committed = 0

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")
