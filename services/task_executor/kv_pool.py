"""A TE's KV pool sized by demand (LLM-Mesh): after each iteration, the decision of
``kv_sizing.next_size`` over the requests the TE holds, applied to an engine that declares
``kv_resize`` (``MESHSERVE_KV_SIZING``). The decision is pure and lives in ``kv_sizing``; this
is its state (the shrink timer, the recent mean output) and the call into the engine.

Demand is counted in tokens: each request's prompt plus the longer of what it may generate
and the recent mean output, at least one request of the model's whole context (``L_min``:
any request the instance admits fits), a safety factor of 1 (``C``). What the resize could
not take (blocks in use above a smaller size) is taken by a later one: the pool shrinks as
its requests end.

Where the pool's TEs share a device under a KV budget (``MESHSERVE_DEVICE_KV_BYTES``), a
grow goes only as far as the device arbiter's room, and asks for the rest
(``KvPlan.need_bytes``); a pool told to make room shrinks to its demand at once."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from services.task_executor.engines.capabilities import KvResizer
from services.task_executor.kv_sizing import KvSizing, demand_tokens, floor_tokens, next_size

MEAN_WEIGHT = 0.1  # of each finished request's output in the running mean
DEFAULT_OUTPUT = 256  # tokens, before any request finished (the scaler's default too)
IDLE_TICK_S = 5.0  # how often an idle TE looks at its pool, at most


@dataclasses.dataclass(frozen=True, slots=True)
class KvPlan:
    blocks: int | None  # resize to this many blocks now (None: it stays)
    need_bytes: int | None  # the size, in bytes, it waits for room to grow to (None: no wait)


class KvPool:
    def __init__(
        self,
        engine: KvResizer,
        *,
        max_model_len: int,
        shrink_after_s: float = 30.0,
        default_output: int = DEFAULT_OUTPUT,
    ) -> None:
        self.engine = engine
        self.sizing = pool_sizing(max_model_len, engine.block_size, shrink_after_s)
        # An idle TE looks at its pool this often (the shrink is lazy, but not forgotten).
        self.idle_tick_s = min(IDLE_TICK_S, shrink_after_s / 2)
        self._over_since: float | None = None
        self.mean_output = float(default_output)

    def finished(self, output_tokens: int) -> None:
        """A request ended with ``output_tokens`` generated."""
        self.mean_output += MEAN_WEIGHT * (output_tokens - self.mean_output)

    def plan(
        self,
        requests: Iterable[tuple[int, int]],
        now: float,
        *,
        room_bytes: float = math.inf,
        squeeze: bool = False,
    ) -> KvPlan:
        """What to do with the pool after this iteration. ``requests``: (prompt tokens,
        tokens it may generate) of each it holds; ``room_bytes``: the most the device lets it
        hold now (the device arbiter's grant: a grow beyond it waits for room, and asks);
        ``squeeze``: another pool of the device waits for room, so this one shrinks to its
        demand at once (no band, no delay)."""
        block, block_bytes = self.engine.block_size, self.engine.kv_block_bytes
        current, most = self.engine.kv_blocks
        demand = demand_tokens(requests, self.mean_output, self.sizing)
        sizing = self.sizing
        if squeeze:
            sizing = dataclasses.replace(sizing, shrink_slack=0.0, shrink_after_s=0.0)
        resize = next_size(
            current * block, demand, now=now, over_since=self._over_since, sizing=sizing
        )
        self._over_since = resize.over_since
        want = min(-(-resize.tokens // block), most)
        if want <= current:
            return KvPlan(want if want < current else None, None)
        room = room_bytes // block_bytes if math.isfinite(room_bytes) else most
        to = min(want, max(current, int(room)))
        return KvPlan(to if to > current else None, want * block_bytes if to < want else None)

    def resize(self, blocks: int) -> int:
        """On the engine's thread, between iterations."""
        return self.engine.resize_kv(blocks)


def pool_sizing(max_model_len: int, block_size: int, shrink_after_s: float = 30.0) -> KvSizing:
    """How a pool of a model admitting ``max_model_len`` tokens is sized (``KvPool``)."""
    return KvSizing(min_tokens=max_model_len, granularity=block_size, shrink_after_s=shrink_after_s)


def floor_blocks(max_model_len: int, block_size: int, most_blocks: int) -> int:
    """The blocks a pool holding no request keeps (what a load enters the device's books
    at): ``kv_sizing.floor_tokens``, at most the cache its engine allocated."""
    tokens = floor_tokens(pool_sizing(max_model_len, block_size))
    return min(-(-tokens // block_size), most_blocks)
