"""The torch engine's KV moving in and out of it: a request's KV exported (running, or
finished and retained) and imported into a request that continues where the export left off,
the seam prefill/decode disaggregation uses (``kv_transfer.KvExport``); prefixes pinned in
device memory (context caching); cached blocks copied to and from the host tier.

A part of ``TorchEngine``: every operation waits for a launched-ahead iteration first (the
host must not write KV-cache memory under a running forward)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from services.task_executor.dtypes import dtype_name
from services.task_executor.engines.base import EngineRequest
from services.task_executor.engines.torch_engine.kv_stream import token_slots
from services.task_executor.engines.torch_engine.kv_transfer import KvExport
from services.task_executor.engines.torch_engine.prefix_cache import PrefixMatch
from services.task_executor.engines.torch_engine.scheduler import blocks_for
from services.task_executor.engines.torch_engine.sequence import Seq

if TYPE_CHECKING:
    from services.task_executor.engines.torch_engine.engine import TorchEngine


class KvMovement:
    def __init__(self, engine: TorchEngine) -> None:
        self._engine = engine

    # --- export / import ------------------------------------------------------------------

    def export(self, request_id: str, *, release: bool = False, first_token: int = 0) -> KvExport:
        engine = self._engine
        engine._check_open()
        engine._quiesce()
        req = engine._requests.get(request_id) or engine._retained.get(request_id)
        if req is None:
            raise KeyError(f"no request {request_id!r} holds KV here")
        if req.num_computed == 0:
            raise ValueError(f"request {request_id!r} has no KV yet (waiting or preempted)")
        n, bs, cfg = req.num_computed, engine.block_size, engine.config
        first = min(max(first_token, 0), n)
        # The tokens' KV in blocks of bs from ``first`` (zero past n keeps the bytes
        # deterministic: the last block's slots past n hold stale data in the cache).
        nb = blocks_for(n - first, bs)
        kv = torch.zeros(
            (cfg.num_layers, 2, nb * bs, cfg.num_kv_heads, cfg.head_dim), dtype=engine.dtype
        )
        slots = token_slots(req.blocks, bs, first, n, engine.torch_device)
        for layer in range(cfg.num_layers):
            k, v = engine.cache.read(layer, slots)
            kv[layer, 0, : n - first], kv[layer, 1, : n - first] = k.cpu(), v.cpu()
        export = KvExport(
            token_ids=list(req.token_ids),
            num_prompt_tokens=req.prompt_len,
            num_computed_tokens=n,
            block_size=bs,
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=dtype_name(engine.dtype),
            model_fingerprint=engine.model_fingerprint,
            kv=kv.view(cfg.num_layers, 2, nb, bs, cfg.num_kv_heads, cfg.head_dim),
            first_token=first,
        )
        if release and request_id in engine._retained:
            engine._release(engine._retained.pop(request_id))
        return export

    def import_(self, export: KvExport, request: EngineRequest) -> Seq:
        """The request, ready to queue, that continues ``export`` (checked against it)."""
        engine = self._engine
        engine._check_open()
        cfg = engine.config
        if export.model_fingerprint != engine.model_fingerprint:
            raise ValueError("the KV export comes from a different model")
        shape = (export.num_layers, export.num_kv_heads, export.head_dim)
        if shape != (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim):
            raise ValueError(f"the KV export's (layers, kv heads, head dim) {shape} do not fit")
        prompt = list(request.prompt_token_ids)
        if prompt != export.token_ids[: export.num_prompt_tokens]:
            raise ValueError("the request's prompt is not the one the KV was computed for")
        req = engine._new_request(request, list(export.token_ids), prompt_len=len(prompt))
        if req.num_output >= request.sampling.max_tokens:
            raise ValueError("the exported request has already produced max_tokens tokens")
        if request.sampling.temperature != 0:
            # One draw per sampled token (sampling.py): skip those the exporter made, so a
            # seeded request continues as if it had never moved.
            for _ in range(req.num_output):
                torch.rand(1, generator=req.generator)
        req.imported_kv = export.token_kv().to(engine.dtype)
        req.imported_from = export.first_token
        return req

    def admit_imported(self, req: Seq, match: PrefixMatch) -> None:
        """Write an imported request's KV past what the prefix cache matched (``match``)
        into its blocks, as it joins the batch. An import that starts past the match (the
        blocks it relied on left the cache meanwhile) is dropped: the request computes its
        prompt from the match instead, and its output is the same."""
        engine = self._engine
        pc, bs = engine.prefix_cache, engine.block_size
        assert req.imported_kv is not None
        kv, req.imported_kv = req.imported_kv, None
        first = req.imported_from
        start, n = match.num_tokens, first + kv.shape[2]
        if start < first:
            req.num_computed = min(start, len(req.token_ids) - 1)
            req.num_cached_tokens = req.num_computed
            return
        pc.append(req.blocks, n)
        slots = token_slots(req.blocks, bs, start, n, engine.torch_device)
        for layer in range(engine.config.num_layers):
            k = kv[layer, 0, start - first :].to(engine.torch_device)
            v = kv[layer, 1, start - first :].to(engine.torch_device)
            engine.cache.write(layer, slots, k, v)
        req.num_computed = n
        req.num_committed = pc.commit(req.blocks, req.block_hashes, n, req.num_committed)
        req.num_cached_tokens = 0  # imported, not served by this cache

    # --- pins and the host tier -------------------------------------------------------------

    def pin(self, cache_id: str, token_ids: Sequence[int]) -> int:
        self._ready()
        return self._engine.prefix_cache.pin(cache_id, token_ids)

    def unpin(self, cache_id: str) -> bool:
        self._engine._check_open()
        return self._engine.prefix_cache.unpin(cache_id)

    def pinned(self, cache_id: str) -> tuple[list[int], int] | None:
        self._engine._check_open()
        pc = self._engine.prefix_cache
        match = pc.match_cache_id(cache_id)
        if match is None:
            return None
        pc.free(match.blocks)
        return list(match.token_ids), match.num_tokens

    def offload(self, block_hashes: Sequence[int]) -> int:
        self._ready()
        return self._engine.prefix_cache.offload(block_hashes)

    def populate(self, block_hashes: Sequence[int]) -> int:
        self._ready()
        return self._engine.prefix_cache.populate(block_hashes)

    def _ready(self) -> None:
        self._engine._check_open()
        self._engine._quiesce()
