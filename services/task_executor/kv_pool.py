"""A TE's KV pool sized by demand (LLM-Mesh): after each iteration, the decision of
``kv_sizing.next_size`` over the requests the TE holds, applied to an engine that declares
``kv_resize`` (``MESHSERVE_KV_SIZING``). The decision is pure and lives in ``kv_sizing``; this
is its state (the shrink timer, the recent mean output) and the call into the engine.

Demand is counted in tokens: each request's prompt plus the longer of what it may generate
and the recent mean output, at least one request of the model's whole context (``L_min``:
any request the instance admits fits), a safety factor of 1 (``C``). What the resize could
not take (blocks in use above a smaller size) is taken by a later one: the pool shrinks as
its requests end."""

from __future__ import annotations

from collections.abc import Iterable

from services.task_executor.engines.capabilities import KvResizer
from services.task_executor.kv_sizing import KvSizing, demand_tokens, next_size

MEAN_WEIGHT = 0.1  # of each finished request's output in the running mean
DEFAULT_OUTPUT = 256  # tokens, before any request finished (the scaler's default too)
IDLE_TICK_S = 5.0  # how often an idle TE looks at its pool, at most


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
        block = engine.block_size
        self.sizing = KvSizing(
            min_tokens=max_model_len, granularity=block, shrink_after_s=shrink_after_s
        )
        # An idle TE looks at its pool this often (the shrink is lazy, but not forgotten).
        self.idle_tick_s = min(IDLE_TICK_S, shrink_after_s / 2)
        self._over_since: float | None = None
        self.mean_output = float(default_output)

    def finished(self, output_tokens: int) -> None:
        """A request ended with ``output_tokens`` generated."""
        self.mean_output += MEAN_WEIGHT * (output_tokens - self.mean_output)

    def target_blocks(self, requests: Iterable[tuple[int, int]], now: float) -> int | None:
        """The pool's size in blocks after this iteration, when it should change; None when
        it stays. ``requests``: (prompt tokens, tokens it may generate) of each it holds."""
        block = self.engine.block_size
        current, most = self.engine.kv_blocks
        demand = demand_tokens(requests, self.mean_output, self.sizing)
        resize = next_size(
            current * block, demand, now=now, over_since=self._over_since, sizing=self.sizing
        )
        self._over_since = resize.over_since
        blocks = min(-(-resize.tokens // block), most)
        return blocks if blocks != current else None

    def resize(self, blocks: int) -> int:
        """On the engine's thread, between iterations."""
        return self.engine.resize_kv(blocks)
