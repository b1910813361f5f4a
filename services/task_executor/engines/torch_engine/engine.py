"""TorchEngine: meshserve's own model runner behind the Engine protocol.

Beyond the protocol it caches prefixes (``prefix_cache``: blocks shared by content, a host tier,
pins, KV events for a router), moves a request's KV between instances (``export_kv`` /
``import_kv``, the base of PD disaggregation) and, built with ``lora``, serves requests under
LoRA adapters, many in one batch (``load_adapter``; ``lora.py``).

Its parts: ``build`` (device, dtype, weights, the KV cache's size), ``sequence`` (a request as
the engine holds it and as the scheduler sees it), ``scheduler`` (the pure decision of each
iteration), ``stepper`` (with ``async_scheduling``, on CUDA and on CPU only with
``overlap_on_cpu``: steady decoding pipelined one iteration deep, outputs the synchronous
path's) and ``kv_movement`` (export, import, pins, the host tier). Here: the requests, and
one iteration's three parts (``_schedule`` -> ``_forward`` -> ``_advance``).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec
import torch

from services.task_executor.engines.base import (
    EngineOutput,
    EngineRequest,
    EngineStats,
    LoadReport,
    PrefillBudget,
    check_prompt,
)
from services.task_executor.engines.capabilities import CapabilityError, TensorSource
from services.task_executor.engines.torch_engine import sampling
from services.task_executor.engines.torch_engine.build import (
    PACED_PREFILL_TOKENS,
    capabilities,
    kv_cache_size,
    make_runner,
    prefill_tokens,
    resolve_device,
    resolve_dtype,
)
from services.task_executor.engines.torch_engine.config import load_model_config
from services.task_executor.engines.torch_engine.host_malloc import keep_large_allocations
from services.task_executor.engines.torch_engine.kv_cache import PagedKVCache
from services.task_executor.engines.torch_engine.kv_movement import KvMovement
from services.task_executor.engines.torch_engine.kv_stream import KvSink, catch_up, layer_hook
from services.task_executor.engines.torch_engine.kv_transfer import (
    KvExport,
    KvLayout,
    model_fingerprint,
)
from services.task_executor.engines.torch_engine.lora import LoraAdapters, LoraLimits, LoraStats
from services.task_executor.engines.torch_engine.model import (
    ForwardBatch,
    build_batch,
)
from services.task_executor.engines.torch_engine.overlap import OverlapStats, make_launcher
from services.task_executor.engines.torch_engine.prefix_cache import PrefixCache
from services.task_executor.engines.torch_engine.scheduler import (
    SchedulerConfig,
    admission_head,
    blocks_needed,
    enqueue,
    pacing,
    queue_due,
    schedule,
)
from services.task_executor.engines.torch_engine.sequence import Seq, running_view, waiting_view
from services.task_executor.engines.torch_engine.stepper import OverlappedStepper, uniforms_for
from services.task_executor.engines.torch_engine.threads import IntraOpThreads
from services.task_executor.engines.torch_engine.weights import CheckpointTensors, load_weights
from services.task_executor.weight_cache.store import CacheSession, HostWeightCache, Received
from shared.block_hash import adapter_root, chain_hashes, extend_chain
from shared.messages.kv import KvEvent
from shared.messages.scaling import InstanceCapacity
from shared.native import Toolchain

BLOCK_SIZE = 16  # tokens a KV block holds, unless the engine is given another


class TorchEngine:
    name = "torch"

    def __init__(
        self,
        model_dir: Path | str,
        *,
        device: str = "auto",
        dtype: str = "auto",
        block_size: int = BLOCK_SIZE,
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
        lora: LoraLimits | None = None,
        late_yield_s: float = 0.0,
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
        context bucket (``cuda_graphs.py``); False launches every kernel from Python.

        ``lora``: serve requests under LoRA adapters (``load_adapter``) with these many
        device slots, host copies and the largest rank; None: none (the ``lora`` capability
        is not declared). Batches without an adapter compute exactly as without."""
        torch_device = resolve_device(device)
        if torch_device.type == "cpu":
            keep_large_allocations()  # host_malloc.py: no page faults on every prefill
        paceable = max_prefill_tokens is None and chunked_prefill
        max_prefill_tokens = prefill_tokens(max_prefill_tokens, torch_device)
        self.device = str(torch_device)
        self.torch_device = torch_device
        self.config = cfg = load_model_config(model_dir)
        self.model_fingerprint = model_fingerprint(model_dir)
        self.capabilities = capabilities(
            prefix_caching=enable_prefix_caching,
            host_kv_tier=num_host_kv_blocks > 0,
            prefill_pacing=paceable,
            lora=lora is not None,
        )
        self.dtype = resolve_dtype(dtype, cfg, torch_device)
        report = load_report if load_report is not None else LoadReport()
        t_weights = time.monotonic()
        self._weights_stored: CacheSession | None = None  # swapped in once stored
        if weight_cache is not None:
            name = model_name or Path(model_dir).name
            self._weights_stored = weight_cache.session(
                name, Path(model_dir), report, weights_from, received
            )
        self.weights = load_weights(
            tensors or CheckpointTensors(Path(model_dir)),
            cfg,
            dtype=self.dtype,
            device=torch_device,
            derived=self._weights_stored,
        )
        t_init = time.monotonic()
        report.add_phase("weights", t_init - t_weights)

        num_kv_blocks, self.max_model_len = kv_cache_size(
            cfg,
            device=torch_device,
            dtype=self.dtype,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            num_kv_blocks=num_kv_blocks,
            kv_cache_bytes=kv_cache_bytes,
        )
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
        self.capabilities = msgspec.structs.replace(
            self.capabilities, kv_resize=self.cache.resizable
        )
        self.runner = make_runner(
            cfg,
            self.weights,
            max_model_len=self.max_model_len,
            dtype=self.dtype,
            device=torch_device,
            cpu_kernels=cpu_kernels,
            toolchain=kernel_toolchain,
            cuda_graphs=cuda_graphs,
            max_num_seqs=max_num_seqs,
            block_size=block_size,
        )
        self._lora: LoraAdapters | None = None
        if lora is not None:
            self._lora = LoraAdapters(cfg, lora, dtype=self.dtype, device=torch_device)
            self.runner.lora = self._lora.slots
        # Requests dropped while waiting (their adapter could not be read again): reported
        # finished ("abort") by the next step.
        self._dropped: list[EngineOutput] = []
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
            late_yield_s=late_yield_s,
        )
        self._running: list[Seq] = []  # admission order (scheduler.victim_index reads it)
        self._waiting: collections.deque[Seq] = collections.deque()
        self._requests: dict[str, Seq] = {}
        self._retained: dict[str, Seq] = {}  # finished with retain_kv, awaiting export
        self._cache_queries = 0
        self._cache_hits = 0
        self._final_events: list[KvEvent] = []
        self._closed = False
        launcher = make_launcher(torch_device, on_cpu=overlap_on_cpu) if async_scheduling else None
        self._stepper = OverlappedStepper(self, launcher) if launcher is not None else None
        self._kv_moves = KvMovement(self)
        # Set once asked for work with none waiting or running (``has_work``), until the next
        # request: the weights this load built are stored into the host cache only then
        # (``CacheSession.finish``), after the capacity probes and between requests.
        self._idle = threading.Event()
        if self._weights_stored is not None:
            # Swapped in between steps where the engine's weights are the host's own: on CPU,
            # with forwards on the calling thread (``step``).
            swap = torch_device.type == "cpu" and self._stepper is None
            self._weights_stored.finish(swap=swap, idle=self._idle)
            if not swap:
                self._weights_stored = None
        report.add_phase("engine_init", time.monotonic() - t_init)

    # --- Engine protocol ---------------------------------------------------------------

    def add_request(
        self, request: EngineRequest, *, retain_kv: bool = False, kv_sink: KvSink | None = None
    ) -> None:
        """``retain_kv``: when the request finishes, keep its KV for ``export_kv`` until
        ``abort(request_id)`` or an export with ``release=True`` (a prefill-only instance
        runs requests with max_tokens=1 this way). ``kv_sink``: the prompt's KV goes there
        layer by layer as it is computed (``kv_stream``), all of it by the time the first
        token comes out. A request under a LoRA adapter hands no KV on (ValueError)."""
        if request.adapter and (retain_kv or kv_sink is not None):
            raise ValueError("KV export (PD) is not served for requests under a LoRA adapter")
        req = self._new_request(request, list(request.prompt_token_ids))
        req.retain_kv = retain_kv
        req.kv_sink = kv_sink
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
        if self._running or self._waiting or self._dropped:
            return True
        self._idle.set()
        return False

    def step(self) -> Sequence[EngineOutput]:
        outputs = self._stepper.step() if self._stepper is not None else self._step_inline()
        if self._dropped:
            outputs, self._dropped = [*self._dropped, *outputs], []
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

    @property
    def late_yield_s(self) -> float:
        """``MESHSERVE_LATE_YIELD`` once prompts have deadlines (paced), else 0."""
        return self._sched.late_yield_s if self._sched.pacing is not None else 0.0

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self._running),
            waiting=len(self._waiting),
            free_kv_blocks=self.prefix_cache.num_free if not self._closed else 0,
            total_kv_blocks=self.cache.limit if not self._closed else 0,
            kv_block_size=self.block_size,
            prefix_cache_queries=self._cache_queries,
            prefix_cache_hit_tokens=self._cache_hits,
        )

    def close(self) -> None:
        if self._closed:
            return
        if self._stepper is not None:
            self._stepper.close()
        self._closed = True
        self._running.clear()
        self._waiting.clear()
        self._requests.clear()
        self._retained.clear()
        self._idle.set()  # a store still waiting finishes: the next load maps it
        self._lora = None
        self.runner.lora = None
        self.prefix_cache.clear()
        self._final_events = self.prefix_cache.drain_events()
        del self.runner, self.cache, self.weights, self.prefix_cache
        if self.torch_device.type == "cuda":
            torch.cuda.empty_cache()

    # --- prefix cache (engine-specific) ---------------------------------------------------

    def drain_kv_events(self) -> list[KvEvent]:
        """What entered and left the prefix cache since the last call (also after close,
        which clears the cache)."""
        if self._closed:
            events, self._final_events = self._final_events, []
            return events
        return self.prefix_cache.drain_events()

    def block_hashes(self, token_ids: Sequence[int], adapter: str = "") -> list[int]:
        """The chained hashes of the full blocks of ``token_ids`` at this engine's block size
        (what a router matches against the KV events), computed under ``adapter`` (its own
        chain: ``block_hash.adapter_root``) or the base model."""
        return chain_hashes(token_ids, self._sched.block_size, adapter_root(adapter))

    def pin_prefix(self, cache_id: str, token_ids: Sequence[int]) -> int:
        """Keep the cached prefix of ``token_ids`` in device memory under ``cache_id`` (for
        context caching); returns the tokens it covers. Run the prefix first (max_tokens=1):
        only what is cached now is pinned. Requests whose prompt starts with it then reuse it."""
        return self._kv_moves.pin(cache_id, token_ids)

    def unpin_prefix(self, cache_id: str) -> bool:
        return self._kv_moves.unpin(cache_id)

    def pinned_prefix(self, cache_id: str) -> tuple[list[int], int] | None:
        """(the token ids pinned under ``cache_id``, how many of them are cached), or None."""
        return self._kv_moves.pinned(cache_id)

    def offload_kv(self, block_hashes: Sequence[int]) -> int:
        """Copy cached blocks to the host tier; returns how many were copied."""
        return self._kv_moves.offload(block_hashes)

    def populate_kv(self, block_hashes: Sequence[int]) -> int:
        """Copy host-tier blocks back to the device; returns how many were copied."""
        return self._kv_moves.populate(block_hashes)

    # --- KV export / import (engine-specific: kv_movement.py) -----------------------------

    def export_kv(
        self, request_id: str, *, release: bool = False, first_token: int = 0
    ) -> KvExport:
        """The KV a request has computed so far, from ``first_token`` on (the importer holds
        the rest): a running request, or a finished one added with ``retain_kv``;
        ``release`` drops a retained one's KV afterwards. Not for a request under a LoRA
        adapter (ValueError)."""
        req = self._requests.get(request_id)
        if req is not None and req.adapter:
            raise ValueError("KV export (PD) is not served for requests under a LoRA adapter")
        return self._kv_moves.export(request_id, release=release, first_token=first_token)

    def resize_kv(self, blocks: int) -> int:
        """Between iterations (the TE's engine thread): ``PrefixCache.resize``."""
        self._check_open()
        return self.prefix_cache.resize(blocks)

    @property
    def kv_blocks(self) -> tuple[int, int]:
        return self.cache.limit, self.cache.num_blocks

    @property
    def kv_block_bytes(self) -> int:
        return self.cache.block_bytes

    @property
    def kv_layout(self) -> KvLayout:
        cfg = self.config
        return KvLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype)

    def held_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """Leading tokens of ``token_ids`` whose KV this instance's prefix cache holds now
        (device or host tier): what an import need not bring (``KvExport.first_token``)."""
        if not self.prefix_cache.enabled:
            return 0
        found, _ = self.prefix_cache.probe(chain_hashes(list(token_ids), self.block_size))
        return min(found * self.block_size, len(token_ids) - 1)

    def import_kv(self, export: KvExport, request: EngineRequest) -> None:
        """Queue ``request`` to continue where ``export`` (from this model, on any instance)
        left off: its KV is copied in when the request is admitted, and decoding goes on from
        the export's last token, counting the tokens generated before it toward max_tokens.
        The KV may come at another block size or dtype. Raises ValueError for another model, a
        request that does not match the export, or one under a LoRA adapter."""
        if request.adapter:
            raise ValueError("KV import (PD) is not served for requests under a LoRA adapter")
        self._enqueue(self._kv_moves.import_(export, request))

    # --- LoRA adapters (engine-specific: lora.py) ------------------------------------------

    def load_adapter(self, name: str, path: str) -> None:
        """Serve the peft LoRA adapter in directory ``path`` as ``name``: read now into host
        memory (a bad adapter fails here: ValueError, or OSError), put into a device slot when
        a request under it is scheduled. Idempotent. A name this engine served with other
        weights is refused: KV cached under the name would be reused."""
        self._lora_on().register(name, path)

    def unload_adapter(self, name: str) -> bool:
        """Stop serving ``name`` (False: it was not loaded); ValueError while a request that
        runs or waits uses it. Its KV blocks age out of the prefix cache."""
        lora = self._lora_on()
        if any(r.adapter == name for r in self._requests.values()):
            raise ValueError(f"adapter {name!r} is in use by queued or running requests")
        return lora.unregister(name)

    def pin_adapter(self, name: str, pinned: bool) -> None:
        """A pinned adapter keeps its device slot once it has one (at most ``max_adapters``
        - 1 pinned)."""
        self._lora_on().pin(name, pinned)

    def adapters(self) -> list[str]:
        """The adapters in device slots now."""
        return self._lora_on().resident()

    @property
    def lora_stats(self) -> LoraStats | None:
        """What reading and installing adapters cost so far (None: no LoRA)."""
        return self._lora.stats if self._lora is not None else None

    def _lora_on(self) -> LoraAdapters:
        self._check_open()
        if self._lora is None:
            raise CapabilityError("this engine was built without LoRA (lora=None)")
        return self._lora

    # --- one iteration, in three parts ----------------------------------------------------
    # step() = _schedule -> _forward -> _advance. Tests call the parts to read the logits of a
    # real iteration.

    def _schedule(self) -> list[Seq]:
        """Apply the scheduling decision (preempt, admit, grow block tables); return the
        requests that run in this iteration."""
        self._check_open()
        pc = self.prefix_cache
        running = [running_view(r, self._sched.pacing) for r in self._running]
        if sum(blocks_needed(v, self._sched.block_size) for v in running) > pc.num_free:
            # Preemption is coming: what a victim gives back excludes blocks others share.
            running = [
                dataclasses.replace(v, num_shared_blocks=self._num_shared(r))
                for v, r in zip(running, self._running, strict=True)
            ]
        # Only the requests that could join are looked up: a long queue costs nothing.
        room = max(0, self._sched.max_num_seqs - len(self._running))
        bs = self._sched.block_size
        now = time.monotonic()
        candidates = self._waiting_head(room, now)
        if self._lora is not None and len(self._lora):
            candidates = self._with_adapter_slots(candidates)
        waiting = [waiting_view(r, pc, bs, now) for r in candidates]
        decision = schedule(running, waiting, pc.num_free, self._sched)
        for rid in decision.preempt:  # the least headroom (or the oldest) ends at the front
            req = self._requests[rid]
            self._running.remove(req)
            self._release(req)
            self._waiting.appendleft(req)
        for i, rid in enumerate(decision.prefill):
            req = candidates[i]
            assert req.request_id == rid, "the scheduler admits from the head it was given"
            self._waiting.remove(req)  # near the front: the head's first ones
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

    def _forward(self, scheduled: Sequence[Seq]) -> torch.Tensor:
        """Float32 logits ``[n, vocab]`` for the next token of each of the ``n`` scheduled
        requests that produce one (``Seq.samples``), in order."""
        return self.runner.forward(self._batch(scheduled), self.cache)

    def _batch(self, scheduled: Sequence[Seq]) -> ForwardBatch:
        batch = build_batch(
            [r.chunk() for r in scheduled],
            block_size=self._sched.block_size,
            device=self.torch_device,
            sampled=[r.samples for r in scheduled],
            adapter_slots=self._adapter_slots(scheduled),
        )
        hook = layer_hook(scheduled, self.cache, self.block_size, self.torch_device)
        return batch if hook is None else dataclasses.replace(batch, on_layer=hook)

    def _advance(self, scheduled: Sequence[Seq], logits: torch.Tensor) -> list[EngineOutput]:
        sampled = [r for r in scheduled if r.samples]
        params = [r.sampling for r in sampled]
        tokens = sampling.sample_tokens(logits, params, uniforms_for(sampled, 0)).tolist()
        return self._apply(scheduled, tokens)

    def _apply(self, scheduled: Sequence[Seq], tokens: Sequence[int]) -> list[EngineOutput]:
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
            if req.kv_sink is not None and req.num_output == 0:
                catch_up(req, self.cache, bs, self.torch_device)  # all of it before its token
            req.token_ids.append(token)
            if req.first_token_at is None:
                req.first_token_at = time.monotonic()
            if req.sampling.temperature != 0:
                req.uniforms.pop(0)
            if self.prefix_cache.enabled:
                extend_chain(req.block_hashes, req.token_ids, bs, req.hash_root)
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

    @property
    def overlap(self) -> OverlapStats:
        """How the launches ahead went (``async_scheduling``; none without)."""
        return self._stepper.stats if self._stepper is not None else OverlapStats()

    def _quiesce(self) -> None:
        """Wait for a launched-ahead iteration before the host writes KV-cache memory outside
        step()."""
        if self._stepper is not None:
            self._stepper.quiesce()

    # --- helpers -------------------------------------------------------------------------

    def _new_request(
        self, request: EngineRequest, token_ids: list[int], *, prompt_len: int | None = None
    ) -> Seq:
        self._check_open()
        prompt_len = len(token_ids) if prompt_len is None else prompt_len
        if not prompt_len:
            raise ValueError("the prompt is empty")
        check_prompt(token_ids, max_model_len=self.max_model_len, vocab_size=self.config.vocab_size)
        rid = request.request_id
        if rid in self._requests or rid in self._retained:
            raise ValueError(f"request {rid!r} is already queued")
        sampling.validate(request.sampling)
        if request.adapter:
            if self._lora is None:
                raise ValueError("this engine serves no LoRA adapters")
            if request.adapter not in self._lora:
                raise ValueError(f"adapter {request.adapter!r} is not loaded")
        return Seq(
            request_id=rid,
            prompt_len=prompt_len,
            token_ids=token_ids,
            sampling=request.sampling,
            generator=sampling.make_generator(request.sampling.seed),
            adapter=request.adapter,
            hash_root=adapter_root(request.adapter),
            arrival=request.arrival,
        )

    def _enqueue(self, req: Seq) -> None:
        self._idle.clear()  # before anything else: a slice being stored finishes, no more
        if self.prefix_cache.enabled:
            req.block_hashes = chain_hashes(req.token_ids, self._sched.block_size, req.hash_root)
        self._requests[req.request_id] = req
        if (paced := self._sched.pacing) is not None:
            since = time.monotonic() if req.arrival is None else req.arrival
            req.due = since + paced.ttft_limit_s(req.prompt_len)
        enqueue(self._waiting, req, lambda r: queue_due(r.due, started=r.num_output > 0))

    def _admit(self, req: Seq) -> None:
        """Give a request joining the batch its cached blocks (and its imported KV)."""
        pc = self.prefix_cache
        match = pc.match_hashes(req.reusable_hashes(self._sched.block_size))
        req.blocks = list(match.blocks)
        req.num_committed = len(match.blocks)
        if req.imported_kv is not None:
            self._kv_moves.admit_imported(req, match)
            return
        req.num_computed = min(match.num_tokens, len(req.token_ids) - 1)
        if req.num_cached_tokens is None:  # first admission; a preempted one is not a query
            req.num_cached_tokens = req.num_computed
            if pc.enabled:
                self._cache_queries += req.prompt_len
                self._cache_hits += req.num_computed

    def _waiting_head(self, room: int, now: float) -> list[Seq]:
        """The first ``room`` waiting requests in the order they should join at ``now``
        (``scheduler.admission_head``): what the scheduler is shown, and the stepper's
        look-ahead too."""
        return admission_head(
            self._waiting, room, lambda r: r.ttft_left(now), self._sched.late_yield_s
        )

    def _with_adapter_slots(self, candidates: list[Seq]) -> list[Seq]:
        """The head of the queue that may join now as far as LoRA goes: each request's adapter
        put into a device slot (evicting the least recently used one that no running or
        earlier request uses), up to the first for which no slot is left, which waits (and
        the queue behind it, as for blocks). A request whose adapter can no longer be read is
        dropped, reported finished by the next step."""
        assert self._lora is not None
        busy = {r.adapter_slot for r in self._running if r.adapter}
        for i, req in enumerate(candidates):
            if not req.adapter:
                continue
            try:
                slot = self._lora.acquire(req.adapter, busy)
            except (OSError, ValueError):
                self._drop_waiting(req)
                return candidates[:i]
            if slot is None:
                return candidates[:i]
            req.adapter_slot = slot
            busy.add(slot)
        return candidates

    def _drop_waiting(self, req: Seq) -> None:
        self._waiting.remove(req)
        del self._requests[req.request_id]
        self._release(req)
        self._dropped.append(
            EngineOutput(
                request_id=req.request_id,
                new_token_ids=[],
                finished=True,
                finish_reason="abort",
                num_prompt_tokens=req.prompt_len,
            )
        )

    def _adapter_slots(self, reqs: Sequence[Seq]) -> list[int] | None:
        """Each request's adapter slot (-1: none), or None when none has an adapter."""
        if self._lora is None or not len(self._lora):
            return None
        slots = [r.adapter_slot if r.adapter else -1 for r in reqs]
        return slots if any(s >= 0 for s in slots) else None

    def _num_shared(self, req: Seq) -> int:
        return sum(self.prefix_cache.ref_count(b) > 1 for b in req.blocks)

    def _release(self, req: Seq) -> None:
        # Preempted requests are recomputed from their tokens (their full blocks usually
        # still sit in the prefix cache), so their own cache state goes.
        self.prefix_cache.free(req.blocks)
        req.blocks = []
        req.num_computed = 0
        req.num_committed = 0

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")
