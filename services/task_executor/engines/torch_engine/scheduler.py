"""Which requests run in the next iteration: a pure function of the engine's observed state.

Policy (close to vLLM's default):
- Running requests run first, oldest first: one token each (decode), or, with chunked prefill,
  the next chunk of a prompt they are still computing. When the free blocks cannot cover what
  the running requests compute, the newest running request is preempted: it gives all its
  blocks back and returns to the front of the waiting queue, to be recomputed from its tokens
  later (recompute is cheaper than swapping for the short contexts a small-model engine serves).
- Waiting requests join first-come first-served while there are sequence slots, blocks (above a
  small watermark kept for the running requests' growth) and prefill token budget. The queue
  stops at the first request that does not fit, so a long prompt is not starved by short ones
  behind it. Tokens served from the prefix cache cost blocks only when the cached blocks are not
  already in use, and no budget.
- Without chunked prefill a prompt runs whole in the iteration it joins; the first prefill of an
  iteration may exceed the budget, since a prompt longer than the budget could otherwise never
  start. With chunked prefill no iteration computes more prompt tokens than the budget: a prompt
  that does not fit joins with the part that does and goes on over the next iterations, while
  the running requests keep decoding beside it (Sarathi-Serve's stall-free batching). Decode
  tokens are not counted in the budget.
- Nothing joins in an iteration that preempts: the cache is already short.
- Prompts go by deadline (``SeqView.ttft_left_s``, the time until the request's first token
  is due by the SLO: earliest deadline first), running prompts mid-way and waiting ones
  alike: a short prompt that arrives while a long one is being prefilled in chunks takes
  the budget before the long one's next chunk when its first token is due sooner. The
  engine queues waiting requests in deadline order. Without deadlines (no SLO known) the
  order is the old one: running prompts, then the queue.
- Except a prompt late already, by less than ``late_yield_s``: it goes behind every prompt
  still in time (``prompt_order``, ``admission_head``). Plain earliest-deadline-first serves
  the latest request first, which makes the next ones late too (its domino effect under
  overload); a late prompt's SLO is lost wherever it goes, theirs is not. Past the bound it
  takes its deadline's place again, first, so nothing waits for ever.
- With pacing (``Pacing``, from the engine's measured costs), the budget is not fixed: while
  no request is decoding, ``ceiling`` tokens, so a burst of prompts prefills in chunks as large
  as the engine runs at its full rate; while some decode, the most prompt tokens whose
  iteration every decoding request can absorb within its TPOT target (its mean time between
  tokens), at least ``floor`` (``prefill_budget``). A request that has been decoding faster
  than its target has slack (``tpot_slack``), and a prompt may spend it: at light load, where
  decodes run far under the target, prompts prefill at nearly the full rate; at heavy load
  they take what keeps every decode within its SLO. A prompt that would miss its deadline
  at that budget (its iterations to go, each as long as the decodes allow, outlast its time
  left) is *urgent*: its iteration may spend all the decodes' banked slack, not
  PACING_MARGIN of it, and take the prompt whole where that fits.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping, MutableSequence, Sequence
from typing import TypeVar

from shared.headroom import yields
from shared.messages.scaling import InstanceCapacity


def blocks_for(num_tokens: int, block_size: int) -> int:
    """KV blocks that hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


T = TypeVar("T")

# An iteration beside decodes aims at this share of their TPOT target: the rest is the serving
# path's (sampling, streaming, the host's other processes) and the cost model's error.
PACING_MARGIN = 0.8
PACING_FLOOR = 32  # prompt tokens per iteration, whatever decodes


@dataclasses.dataclass(frozen=True, slots=True)
class SeqView:
    request_id: str
    num_tokens: int  # all its tokens: the prompt and what it generated
    # Blocks the request holds now, or, waiting, the cached blocks it will share without taking
    # a free one (minus one for a shared block it must copy before writing, so it may be -1).
    num_blocks: int = 0
    # Of num_tokens, those whose K/V is in the cache already (running: computed; waiting:
    # served by the prefix cache or an import). Not in the budget. A running request without
    # chunked prefill has only its last token left, whatever this says.
    num_cached_tokens: int = 0
    num_shared_blocks: int = 0  # running: held blocks other requests also hold (kept if preempted)
    # Decoding: how much longer than now the next iteration may end before this request's mean
    # time between tokens passes the TPOT target (tpot_slack); None: not known (its target).
    tpot_slack_s: float | None = None
    # A prompt (waiting, or running mid-way): seconds until its first token is due (its TTFT
    # target from its arrival; negative: late); inf: no deadline known; -inf: it has produced
    # tokens already (preempted, recomputed: before any new prompt).
    ttft_left_s: float = math.inf
    # Running: its headroom (``shared.headroom``: seconds until its next token is due, its
    # TTFT target plus the TPOT target for each token it produced, from its arrival); None
    # when it has no deadline. What decides which request a short cache preempts (``victim``).
    headroom_s: float | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Pacing:
    """The prefill budget as a function of what is decoding, from what an iteration costs on
    this engine and device (its measured capacity): an iteration with ``n`` prompt tokens of a
    prompt of ``length`` tokens, beside decodes at contexts ``c_i``, takes about
    ``step_s + sum(c_i) * decode_context_s + n * (prefill_s + prefill_attention_s * length)``.
    """

    tpot_s: float  # the decodes' TPOT target
    step_s: float  # a decode step at a short context: the weights streamed once
    decode_context_s: float  # per decoding request, per token of its context
    prefill_s: float  # per prompt token
    prefill_attention_s: float  # per prompt token, per token of its prompt
    floor: int  # prompt tokens an iteration always may compute: prompts never starve
    ceiling: int  # prompt tokens of an iteration with nothing decoding
    # The TTFT target of a prompt of n tokens: max(ttft_s, n * ttft_per_token_s) from its
    # arrival (shared.slo); ttft_s 0: none (prompts in arrival order).
    ttft_s: float = 0.0
    ttft_per_token_s: float = 0.0

    def ttft_limit_s(self, prompt_tokens: int) -> float:
        """How long after its arrival a prompt's first token is due (inf: no target)."""
        if self.ttft_s <= 0:
            return math.inf
        return max(self.ttft_s, prompt_tokens * self.ttft_per_token_s)


def pacing(
    capacity: InstanceCapacity,
    *,
    tpot_s: float,
    ceiling: int,
    ttft_s: float = 0.0,
    ttft_per_token_s: float = 0.0,
) -> Pacing:
    """The pacing an engine with this measured capacity keeps for a TPOT target (and, with
    ``ttft_s``, the TTFT target that orders its prompts)."""
    return Pacing(
        tpot_s=tpot_s,
        step_s=capacity.step_s(),
        decode_context_s=capacity.decode_context_s,
        prefill_s=capacity.prefill_s,
        prefill_attention_s=capacity.prefill_attention_s,
        floor=min(PACING_FLOOR, ceiling),
        ceiling=ceiling,
        ttft_s=ttft_s,
        ttft_per_token_s=ttft_per_token_s,
    )


def tpot_slack(tpot_s: float, tokens_out: int, since_first_s: float) -> float:
    """How long the next iteration may take before a request that has produced ``tokens_out``
    tokens, the first ``since_first_s`` seconds ago, averages more than ``tpot_s`` between
    them: after it, (since_first_s + t) / tokens_out <= tpot_s."""
    return tpot_s * tokens_out - since_first_s


def prefill_budget(
    pacing: Pacing,
    decode_contexts: Sequence[int],
    prompt_len: int,
    slack_s: float | None = None,
    *,
    urgent: bool = False,
) -> int:
    """Prompt tokens the next iteration may compute (``Pacing`` says how). ``slack_s``: the
    least TPOT slack among the decoding requests (None: the target itself, as for a request
    that has just started). ``urgent``: for a prompt about to miss its deadline, the whole
    slack, not PACING_MARGIN of it."""
    if not decode_contexts:
        return pacing.ceiling
    allowed = (1.0 if urgent else PACING_MARGIN) * (pacing.tpot_s if slack_s is None else slack_s)
    spare = allowed - pacing.step_s - pacing.decode_context_s * sum(decode_contexts)
    per_token = pacing.prefill_s + pacing.prefill_attention_s * prompt_len
    fits = int(spare / per_token) if per_token > 0 else pacing.ceiling
    return max(pacing.floor, min(pacing.ceiling, fits))


def urgent(pacing: Pacing, prompt: SeqView, budget: int, decode_contexts: Sequence[int]) -> bool:
    """Whether ``prompt`` misses its deadline at ``budget`` tokens an iteration: the
    iterations it still needs, each as long as it is (a decode step, the decodes' contexts,
    the chunk), outlast its time left. A prompt already late is not urgent: spending the
    decodes' slack no longer saves its TTFT."""
    left = prompt.ttft_left_s
    if not 0 < left < math.inf or budget <= 0:
        return False
    rest = prompt.num_tokens - prompt.num_cached_tokens
    chunk = min(rest, budget)
    per_token = pacing.prefill_s + pacing.prefill_attention_s * prompt.num_tokens
    iteration = pacing.step_s + pacing.decode_context_s * sum(decode_contexts) + chunk * per_token
    return math.ceil(rest / budget) * iteration > left


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerConfig:
    block_size: int
    max_num_seqs: int
    max_prefill_tokens: int  # prompt tokens computed per iteration (decode tokens aside)
    watermark_blocks: int = 0
    chunked_prefill: bool = False
    pacing: Pacing | None = None  # with chunked prefill: the budget per iteration instead
    # A prompt late by less than this goes behind those still in time (``prompt_order``).
    late_yield_s: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerDecision:
    running: tuple[str, ...] = ()  # running requests that compute now, oldest first
    prefill: tuple[str, ...] = ()  # waiting requests that join, in the order given
    preempt: tuple[str, ...] = ()  # running requests sent back to waiting, newest first
    # For each request of running and prefill: how many of its tokens the cache holds after
    # the iteration (all of them, unless a prompt goes on in the next iteration).
    cache_len: Mapping[str, int] = dataclasses.field(default_factory=dict)

    @property
    def idle(self) -> bool:
        return not self.running and not self.prefill


def queue_due(due: float, *, started: bool) -> float:
    """A waiting request's place in the queue: its deadline; one that has produced tokens
    (preempted, to be recomputed) goes before any new one."""
    return -math.inf if started else due


def prompt_order(ttft_left_s: float, late_yield_s: float) -> tuple[bool, float]:
    """A prompt's place among prompts (the lowest first): its deadline, except that one late
    by less than ``late_yield_s`` goes behind every prompt still in time (0: deadline order
    alone). Requests that produced tokens (-inf) and those late by more come first."""
    return (yields(ttft_left_s, late_yield_s), ttft_left_s)


def admission_head(
    queue: Sequence[T], n: int, ttft_left_s: Callable[[T], float], late_yield_s: float
) -> list[T]:
    """The first ``n`` requests of ``queue`` (in deadline order, ``enqueue``) in the order
    they should join (``prompt_order``): those late by more than ``late_yield_s`` (and those
    that produced tokens), then those in time, then those late by less. The late-by-less
    lie together in the queue, so two bisections find them; a long queue costs nothing."""
    if late_yield_s > 0 and queue:
        late = bisect.bisect_right(queue, -late_yield_s, key=ttft_left_s)
        in_time = bisect.bisect_right(queue, 0.0, key=ttft_left_s)
        if late < in_time:
            order = itertools.chain(
                itertools.islice(queue, late),
                itertools.islice(queue, in_time, None),
                itertools.islice(queue, late, in_time),
            )
            return list(itertools.islice(order, n))
    return list(itertools.islice(queue, n))


def enqueue(queue: MutableSequence[T], item: T, due: Callable[[T], float]) -> None:
    """Put ``item`` into ``queue`` (in ``due`` order) behind every request due no later: in
    arrival order among equals. From the back: new requests are mostly due last."""
    mine = due(item)
    i = len(queue)
    while i > 0 and due(queue[i - 1]) > mine:
        i -= 1
    queue.insert(i, item)


def blocks_needed(seq: SeqView, block_size: int, num_tokens: int | None = None) -> int:
    """Free blocks ``seq`` takes to hold ``num_tokens`` (default: all its tokens)."""
    n = seq.num_tokens if num_tokens is None else num_tokens
    return max(0, blocks_for(n, block_size) - seq.num_blocks)


def victim_index(running: Sequence[SeqView]) -> int:
    """Which running request (oldest first) goes back to waiting when blocks run short: the
    one with the most headroom (LLM-Mesh: the one that can best afford to start over; its
    output is the same when it is recomputed), the newest among equals; the newest when any
    has no deadline (vLLM's rule: it loses the least work)."""
    newest = len(running) - 1
    if any(s.headroom_s is None for s in running):
        return newest
    return max(range(len(running)), key=lambda i: (running[i].headroom_s, i))


def schedule(
    running: Sequence[SeqView],
    waiting: Sequence[SeqView],
    free_blocks: int,
    config: SchedulerConfig,
) -> SchedulerDecision:
    """``running`` oldest first; ``waiting`` in the order they should join (the queue's
    head as ``admission_head`` gives it)."""
    bs, budget, chunked = config.block_size, config.max_prefill_tokens, config.chunked_prefill
    prompts = [s for s in running if chunked and s.num_tokens - s.num_cached_tokens > 1]
    # Prompt work by deadline: the running prompts mid-way and the head of the queue (stable:
    # without deadlines, running prompts first, then the queue, as they always went).
    head = list(waiting[: max(0, config.max_num_seqs - len(running))])
    by_deadline = sorted(
        [*prompts, *head], key=lambda s: prompt_order(s.ttft_left_s, config.late_yield_s)
    )
    if chunked and config.pacing is not None:
        decoding = [s for s in running if s.num_tokens - s.num_cached_tokens == 1]
        contexts = [s.num_tokens for s in decoding]
        first = by_deadline[0] if by_deadline else None
        slacks = [s.tpot_slack_s for s in decoding if s.tpot_slack_s is not None]
        slack = min(slacks, default=None)
        length = first.num_tokens if first else 0
        budget = prefill_budget(config.pacing, contexts, length, slack)
        if first is not None and urgent(config.pacing, first, budget, contexts):
            budget = prefill_budget(config.pacing, contexts, length, slack, urgent=True)
    # What each running prompt computes now: what the budget leaves after the prompts due
    # before it (waiting ones reserve theirs; the queue below spends it). Then, while the
    # blocks do not suffice, a running request (``victim_index``) goes back to waiting, and the budget
    # is shared again among those left: a budget given to a request preempted for want of
    # blocks goes to the others, so a prompt mid-way holding the blocks still progresses
    # (else a recomputed request due first could be admitted and preempted forever while
    # the older prompt never gets a token of budget).
    keep = list(running)  # those not preempted (a prompt left without budget waits its turn)
    preempt: list[str] = []
    free = free_blocks
    waiting_ids = {s.request_id for s in head}
    while True:
        kept = {s.request_id for s in keep}
        chunk_of: dict[str, int] = {}
        left = budget
        for seq in by_deadline:
            if seq.request_id in kept or seq.request_id in waiting_ids:
                take = min(seq.num_tokens - seq.num_cached_tokens, max(left, 0))
                chunk_of[seq.request_id] = take
                left -= take
        cache_len: dict[str, int] = {}
        spent = 0
        for seq in keep:
            end = seq.num_tokens
            if chunked and seq.num_tokens - seq.num_cached_tokens > 1:  # a prompt, mid-way
                take = chunk_of[seq.request_id]
                spent += take
                end = seq.num_cached_tokens + take
            cache_len[seq.request_id] = end
        need = sum(blocks_needed(s, bs, cache_len[s.request_id]) for s in keep)
        if not keep or need <= free:
            break
        victim = keep.pop(victim_index(keep))
        preempt.append(victim.request_id)
        free += victim.num_blocks - victim.num_shared_blocks
    budget -= spent
    free -= need

    prefill: list[str] = []
    if not preempt:
        for seq in waiting:
            if len(keep) + len(prefill) >= config.max_num_seqs:
                break
            # The watermark protects running requests' growth; with none running, a request
            # that needs the whole cache must still be able to start.
            watermark = config.watermark_blocks if keep or prefill else 0
            new_tokens = seq.num_tokens - seq.num_cached_tokens
            take = min(new_tokens, budget) if chunked else new_tokens
            if take <= 0 or (not chunked and prefill and new_tokens > budget):
                break
            end = seq.num_cached_tokens + take
            blocks = blocks_needed(seq, bs, end)
            if free - blocks < watermark:
                break
            prefill.append(seq.request_id)
            cache_len[seq.request_id] = end
            budget -= take
            free -= blocks
    ran = tuple(s.request_id for s in keep if cache_len[s.request_id] > s.num_cached_tokens)
    return SchedulerDecision(
        running=ran,
        prefill=tuple(prefill),
        preempt=tuple(preempt),
        cache_len={rid: cache_len[rid] for rid in (*ran, *prefill)},
    )
