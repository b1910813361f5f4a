"""Shadow validation before admission (LLM-Mesh): before a request joins an instance, play
the next iterations of the instance's whole device forward with each instance's profiled
iteration times (``shared.perf_model``, plus a margin), turns in headroom order
(``shared.headroom.next_turn``), once with the request and once without, and refuse the
placement when it would

- make the new request late: its first token after its TTFT deadline (``late``). A request
  late even alone on its instance (it waited out a cold start, or was refused elsewhere
  until its deadline passed, or its prompt is too long for the device) is late on any
  device, and refusing it for that would only turn a slow answer into none: its deadline
  becomes one TTFT SLO after the soonest its instance could give it the first token, so
  that it may wait its turn but not behind a queue it cannot see the end of (where its
  engine lets late prompts yield, its turn comes once it is late by more than the bound:
  one TTFT SLO after it could be served then);
- push a request the device already holds past a deadline it would have met (``pushes``);
- make one decode round of the device exceed the TPOT SLO: a turn for every instance that
  holds requests with tokens to come after their first, each decoding its batch of them (the
  new request in its target's), longer than the tightest TPOT limit among them, where it
  was not without it (``tpot``).

The play runs until the new request has its first token and ``horizon_tokens`` more, or
its deadline for them has passed; the run without it covers the same span. A refused
placement tries another instance, another device, or asks the scaler for one; the client
hears of it only when nothing can take it. Pure: the node pool's arbiter and the simulator
call it as is.

An iteration of an instance, as its engine runs one: every running request decodes a token
(up to ``max_num_seqs``), the free batch slots go to prompts in the order held, and those
prompts share the iteration's prefill budget (``max_prefill_tokens``, chunked) in the
engine's order: by deadline, a prompt late by less than the engine's late yield
(``InstanceView.late_yield_s``) behind those in time; a prompt whose last chunk ran gets its
first token then. The device's turns go by each instance's
claim (``shared.headroom.Urgency``), as its arbiter grants them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from shared.headroom import (
    NO_WORK,
    RequestView,
    Urgency,
    claim_changes,
    next_turn,
    request_claim,
    yields,
)
from shared.perf_model import PerfModel

MARGIN = 0.10  # profiled times are stretched by this much
HORIZON_TOKENS = 2  # tokens past the new request's first that the play covers
MAX_ITERATIONS = 20_000  # a bound on the play, whatever the device holds


@dataclasses.dataclass(frozen=True, slots=True)
class InstanceView:
    """One instance on the device: its model's performance model and the requests it holds,
    in the order its engine takes them (running first, then waiting)."""

    instance: str
    perf: PerfModel
    requests: tuple[RequestView, ...]
    max_num_seqs: int
    max_prefill_tokens: int
    # Its real iterations over what its profile predicts for them (the arbiter measures it:
    # other processes' overheads, a busier host), applied before the margin.
    stretch: float = 1.0
    # Its engine's late yield (``MESHSERVE_LATE_YIELD``; 0: prompts go by deadline alone).
    late_yield_s: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    ok: bool
    reason: str = ""  # "late", "pushes" or "tpot" when refused
    request: str = ""  # the request it would push, or whose TPOT it would break
    first_token_s: float = math.inf  # the new request's predicted TTFT (from its arrival)


@dataclasses.dataclass(slots=True)
class _Req:
    view: RequestView
    computed: int
    output: int
    missed: bool = False  # a token after its deadline (or overdue at the end)
    first_token: float | None = None

    def deadline(self) -> float:
        v = self.view
        return v.arrival + v.ttft_slo + v.tpot_slo * self.output

    def done(self) -> bool:
        return self.output >= max(1, self.view.expected_output)


@dataclasses.dataclass(slots=True)
class _Instance:
    view: InstanceView
    reqs: list[_Req]
    # Its claim as last made, and until when it holds (its requests unchanged, the play's
    # clock only moving on): the play asks every instance's claim every iteration, and
    # only one instance iterates (with eight instances of eight requests, the claims were
    # three quarters of a validation's 5.7 ms, on the cores the device's engines run on).
    _claim: Urgency | None = None
    _claim_until: float = -math.inf

    def claim(self, now: float) -> Urgency:
        """Its claim on the device's next turn, as ``shared.headroom.urgency`` makes it."""
        if self._claim is not None and now < self._claim_until:
            return self._claim
        y = self.view.late_yield_s
        deadlines = [(r.deadline(), r.output) for r in self.reqs]
        self._claim = min((request_claim(d, o, now, y) for d, o in deadlines), default=NO_WORK)
        self._claim_until = min(
            (claim_changes(d, o, now, y) for d, o in deadlines), default=math.inf
        )
        return self._claim

    def iterate(self, now: float, margin: float) -> float:
        """One iteration from ``now``: its end time; tokens and deadlines recorded."""
        v = self.view
        decoding, chunks, seconds = _next_iteration(v, self.reqs, now)
        end = now + seconds * v.stretch * (1 + margin)
        for r in decoding:
            _token(r, end)
        for r, n in chunks:
            r.computed += n
            if r.computed >= r.view.prompt_tokens:
                _token(r, end)
        self.reqs = [r for r in self.reqs if not r.done()]
        self._claim = None  # its requests moved on
        return end


def _next_iteration(
    v: InstanceView, reqs: Sequence[_Req], now: float | None = None
) -> tuple[list[_Req], list[tuple[_Req, int]], float]:
    """What the instance's next iteration runs (its decodes; its prompts' chunks) and how
    long its profile says that takes. The batch's free slots go to prompts in the order the
    instance holds them (those it runs already keep theirs: a view does not say which they
    are, and may be an iteration old); from ``now`` on, the prefill budget goes among them as
    its engine orders them (by deadline, those that yield behind: ``shared.headroom.yields``),
    without, as held."""
    decoding = [r for r in reqs if r.computed >= r.view.prompt_tokens][: v.max_num_seqs]
    slots = v.max_num_seqs - len(decoding)
    budget = v.max_prefill_tokens
    chunks: list[tuple[_Req, int]] = []
    prompts = [r for r in reqs if r.computed < r.view.prompt_tokens][: max(0, slots)]
    if now is not None:
        prompts.sort(key=lambda r: _prompt_order(r, now, v.late_yield_s))
    for r in prompts:
        if budget <= 0:
            break
        n = min(r.view.prompt_tokens - r.computed, budget)
        chunks.append((r, n))
        budget -= n
    context = sum(r.view.prompt_tokens + r.output for r in decoding)
    mean = context / len(decoding) if decoding else 0.0
    prefill = sum(n for _, n in chunks)
    return decoding, chunks, v.perf.iteration_s(len(decoding), mean, prefill)


def _prompt_order(r: _Req, now: float, late_yield_s: float) -> tuple[bool, float]:
    """A prompt's place among its instance's, as the engine's ``scheduler.prompt_order``:
    one sent back after producing tokens first, then by deadline, those that yield last."""
    left = -math.inf if r.output else r.deadline() - now
    return (yields(left, late_yield_s), left)


def iteration_s(v: InstanceView) -> float:
    """How long the instance's next iteration takes by its profile (no stretch, no margin):
    what the arbiter compares each real iteration with."""
    reqs = [_Req(r, r.computed_tokens, r.output_tokens) for r in v.requests]
    return _next_iteration(v, reqs)[2]


def _token(r: _Req, at: float) -> None:
    if at > r.deadline():
        r.missed = True
    if r.first_token is None:
        r.first_token = at
    r.output += 1


def _play(
    device: Sequence[InstanceView],
    now: float,
    margin: float,
    *,
    until: float,
    new: tuple[str, RequestView] | None,
    new_tokens: int,
) -> tuple[dict[str, _Req], float]:
    """The device's iterations from ``now`` in headroom order: every request's record by
    id, and when the play stopped (``until``, or earlier when the new request has
    ``new_tokens`` tokens or nothing is left to run)."""

    def record(r: RequestView) -> _Req:
        return _Req(r, r.computed_tokens, r.output_tokens)

    instances = {i.instance: _Instance(i, [record(r) for r in i.requests]) for i in device}
    watched: _Req | None = None
    if new is not None:
        target, view = new
        watched = record(view)
        instances[target].reqs.append(watched)
    records = {r.view.id: r for inst in instances.values() for r in inst.reqs}
    t = now
    for _ in range(MAX_ITERATIONS):
        if t >= until or (watched is not None and watched.output >= new_tokens):
            break
        turn = next_turn({name: inst.claim(t) for name, inst in instances.items()})
        if turn is None:
            break
        t = instances[turn].iterate(t, margin)
    end = min(t, until)
    for inst in instances.values():  # a token still to come whose deadline has passed
        for r in inst.reqs:
            if r.deadline() < end:
                r.missed = True
    return records, t


def decode_round_s(
    device: Sequence[InstanceView], margin: float, new: tuple[str, RequestView] | None
) -> float:
    """One turn for each instance holding requests, each a decode step of its batch (up to
    ``max_num_seqs``, at its mean context), with ``new`` in its target's: how long a request
    waits between two tokens when every instance decodes."""
    total = 0.0
    for inst in device:
        requests = list(inst.requests)
        if new is not None and new[0] == inst.instance:
            requests.append(new[1])
        batch = [r for r in requests if _decodes(r)][: inst.max_num_seqs]
        if batch:
            context = sum(r.prompt_tokens + r.output_tokens for r in batch) / len(batch)
            total += inst.perf.decode_step_s(len(batch), context) * inst.stretch
    return total * (1 + margin)


def _first_alone(
    device: Sequence[InstanceView], target: str, new: RequestView, now: float, margin: float
) -> float:
    """When ``new`` would have its first token on its instance with nothing else on the
    device (inf: not within the play's bound)."""
    alone = [dataclasses.replace(i, requests=()) for i in device if i.instance == target]
    records, _ = _play(alone, now, margin, until=math.inf, new=(target, new), new_tokens=1)
    first = records[new.id].first_token
    return math.inf if first is None else first


def _decodes(r: RequestView) -> bool:
    """It has tokens to come after its first: it will take part in decode rounds."""
    return r.expected_output > max(r.output_tokens, 1)


def validate(
    device: Sequence[InstanceView],
    target: str,
    new: RequestView,
    now: float,
    *,
    margin: float = MARGIN,
    horizon_tokens: int = HORIZON_TOKENS,
) -> Verdict:
    """Whether ``new`` may join instance ``target`` of ``device`` at ``now``. The requests
    of the device and ``new`` need distinct ids."""
    tokens = min(max(1, new.expected_output), 1 + horizon_tokens)
    due = new.arrival + new.ttft_slo
    if (alone := _first_alone(device, target, new, now, margin)) > due:
        # Late whatever the device does: its turn, not a queue. Where its engine lets late
        # prompts yield, its turn comes after the instance's prompts still in time, at the
        # latest once it is late by more than the bound.
        y = next((i.late_yield_s for i in device if i.instance == target), 0.0)
        turn = max(alone, due + y + (alone - now)) if y > 0 else alone
        due = turn + new.ttft_slo
    until = due + new.tpot_slo * (tokens - 1)
    with_new, end = _play(device, now, margin, until=until, new=(target, new), new_tokens=tokens)
    without, _ = _play(device, now, margin, until=end, new=None, new_tokens=0)
    mine = with_new[new.id]
    first = math.inf if mine.first_token is None else mine.first_token - new.arrival
    if mine.first_token is None or mine.first_token > due:
        return Verdict(ok=False, reason="late", request=new.id, first_token_s=first)
    for rid, before in without.items():
        if with_new[rid].missed and not before.missed:
            return Verdict(ok=False, reason="pushes", request=rid, first_token_s=first)
    held = [r for i in device for r in i.requests if _decodes(r)]
    tightest = min([*held, new] if _decodes(new) else held, key=lambda r: r.tpot_slo, default=None)
    held_limit = min((r.tpot_slo for r in held), default=math.inf)
    if tightest is None:
        return Verdict(ok=True, first_token_s=first)
    if decode_round_s(device, margin, (target, new)) > tightest.tpot_slo and (
        decode_round_s(device, margin, None) <= held_limit
    ):
        return Verdict(ok=False, reason="tpot", request=tightest.id, first_token_s=first)
    return Verdict(ok=True, first_token_s=first)
