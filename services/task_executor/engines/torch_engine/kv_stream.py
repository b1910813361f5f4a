"""A prompt's KV streamed out while it is computed (PD's prefill side): after each layer of a
forward writes the cache, the tokens of that layer that requests with a sink computed in the
iteration go to their sink, so the transfer to the decode instance overlaps the rest of the
prefill (DistFlow, DeepServe §5; vLLM's KV connectors save layer by layer the same way).

What a forward does not stream (the prompt's prefix served from this instance's cache, or an
iteration that ran without the per-layer hook: a CUDA graph) is caught up from the cache after
the iteration (``catch_up``), so a sink always receives every token's KV once the prompt is
computed. A range may arrive twice (a preempted prompt is recomputed): the values are equal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from services.task_executor.engines.torch_engine.kv_cache import PagedKVCache
    from services.task_executor.engines.torch_engine.sequence import Seq


class KvSink(Protocol):
    """Where a request's prompt KV goes as it is computed. Called on the engine's threads."""

    def layer(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """K and V ``[ntok, kv_heads, head_dim]`` of tokens ``[start, start + ntok)`` of
        ``layer``, on the cache's device: new tensors, which the sink copies what it keeps
        out of (a GPU cache's rows go to host memory in that one copy)."""
        ...


def token_slots(
    blocks: Sequence[int], block_size: int, start: int, end: int, device: torch.device
) -> torch.Tensor:
    """The flat cache slots of a request's tokens ``[start, end)``."""
    return torch.tensor(
        [blocks[p // block_size] * block_size + p % block_size for p in range(start, end)],
        dtype=torch.long,
        device=device,
    )


def _send(cache: PagedKVCache, layer: int, sink: KvSink, start: int, slots: torch.Tensor) -> None:
    k, v = cache.read(layer, slots)
    sink.layer(layer, start, k, v)


def catch_up(req: Seq, cache: PagedKVCache, block_size: int, device: torch.device) -> None:
    """Send the request's computed KV its sink has not had yet (every layer)."""
    sink, start, end = req.kv_sink, req.kv_sent, req.num_computed
    if sink is None or start >= end:
        return
    slots = token_slots(req.blocks, block_size, start, end, device)
    for layer in range(len(cache.k)):
        _send(cache, layer, sink, start, slots)
    req.kv_sent = end


def layer_hook(
    scheduled: Sequence[Seq], cache: PagedKVCache, block_size: int, device: torch.device
) -> Callable[[int], None] | None:
    """What the forward of ``scheduled`` calls after each layer's cache write: each
    streaming request's chunk of that layer to its sink (None when none streams). Call it
    before the forward, while the requests' progress is the iteration's start."""
    streams = []
    for req in scheduled:
        if req.kv_sink is None or not req.num_scheduled:
            continue
        catch_up(req, cache, block_size, device)  # a prefix served from the cache
        start = req.num_computed
        end = min(start + req.num_scheduled, req.prompt_len)  # the prompt's KV only
        if end > start:
            slots = token_slots(req.blocks, block_size, start, end, device)
            streams.append((req, req.kv_sink, start, end, slots))
    if not streams:
        return None
    last = len(cache.k) - 1

    def on_layer(layer: int) -> None:
        for req, sink, start, end, slots in streams:
            _send(cache, layer, sink, start, slots)
            if layer == last and req.kv_sent == start:
                req.kv_sent = end

    return on_layer
