"""Which requests run in the next iteration: a pure function of the engine's observed state.

Policy (close to vLLM's default):
- Running requests decode first, oldest first. When the free blocks cannot cover the next token
  of every running request, the newest running request is preempted: it gives all its blocks
  back and returns to the front of the waiting queue, to be recomputed from its tokens later
  (recompute is cheaper than swapping for the short contexts a small-model engine serves).
- Waiting requests join first-come first-served while there are sequence slots, blocks (above a
  small watermark kept for the running requests' growth) and prefill token budget. The queue
  stops at the first request that does not fit, so a long prompt is not starved by short ones
  behind it; the first prefill of an iteration may exceed the budget, since without chunked
  prefill a prompt longer than the budget could otherwise never start. Tokens served from the
  prefix cache cost blocks only when the cached blocks are not already in use, and no budget.
- Nothing joins in an iteration that preempts: the cache is already short.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from services.task_executor.engines.torch_engine.kv_cache import blocks_for


@dataclasses.dataclass(frozen=True, slots=True)
class SeqView:
    request_id: str
    num_tokens: int  # tokens whose K/V the cache must hold after this iteration
    # Blocks the request holds now, or, waiting, the cached blocks it will share without taking
    # a free one (minus one for a shared block it must copy before writing, so it may be -1).
    num_blocks: int = 0
    num_cached_tokens: int = 0  # of num_tokens, those already computed: not in the budget
    num_shared_blocks: int = 0  # running: held blocks other requests also hold (kept if preempted)


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerConfig:
    block_size: int
    max_num_seqs: int
    max_prefill_tokens: int
    watermark_blocks: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerDecision:
    decode: tuple[str, ...] = ()  # running requests that go on, oldest first
    prefill: tuple[str, ...] = ()  # waiting requests that join, in queue order
    preempt: tuple[str, ...] = ()  # running requests sent back to waiting, newest first

    @property
    def idle(self) -> bool:
        return not self.decode and not self.prefill


def blocks_needed(seq: SeqView, block_size: int) -> int:
    return max(0, blocks_for(seq.num_tokens, block_size) - seq.num_blocks)


def schedule(
    running: Sequence[SeqView],
    waiting: Sequence[SeqView],
    free_blocks: int,
    config: SchedulerConfig,
) -> SchedulerDecision:
    """``running`` oldest first; ``waiting`` in the order they should join."""
    decode = list(running)
    preempt: list[str] = []
    need = sum(blocks_needed(s, config.block_size) for s in decode)
    free = free_blocks
    while decode and need > free:
        victim = decode.pop()
        preempt.append(victim.request_id)
        free += victim.num_blocks - victim.num_shared_blocks
        need -= blocks_needed(victim, config.block_size)
    free -= need

    prefill: list[str] = []
    if not preempt:
        budget = config.max_prefill_tokens
        for seq in waiting:
            if len(decode) + len(prefill) >= config.max_num_seqs:
                break
            # The watermark protects running requests' growth; with none running, a request
            # that needs the whole cache must still be able to start.
            watermark = config.watermark_blocks if decode or prefill else 0
            blocks = blocks_needed(seq, config.block_size)
            if free - blocks < watermark:
                break
            new_tokens = seq.num_tokens - seq.num_cached_tokens
            if prefill and new_tokens > budget:
                break
            prefill.append(seq.request_id)
            budget -= new_tokens
            free -= blocks
    return SchedulerDecision(
        decode=tuple(s.request_id for s in decode), prefill=tuple(prefill), preempt=tuple(preempt)
    )
