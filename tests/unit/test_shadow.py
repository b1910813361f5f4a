"""Headroom order (``shared/headroom.py``) and shadow validation before admission
(``services/job_executor/shadow.py``): each of its rejection rules, on a device whose
instances' iteration times are known exactly."""

from __future__ import annotations

import dataclasses
import math

import pytest

from services.job_executor.shadow import InstanceView, validate
from shared.headroom import NO_WORK, RequestView, Urgency, earliest_deadline, next_turn, urgency
from tests.unit.exact_perf import EXACT_PERF


def _req(rid: str, *, prompt: int = 10, ttft: float = 2.0, tpot: float = 0.25, **kw) -> RequestView:  # type: ignore[no-untyped-def]
    values = {"arrival": 0.0, "expected_output": 50} | kw
    return RequestView(id=rid, prompt_tokens=prompt, ttft_slo=ttft, tpot_slo=tpot, **values)  # type: ignore[arg-type]


def _inst(name: str, *requests: RequestView) -> InstanceView:
    return InstanceView(
        instance=name, perf=EXACT_PERF, requests=requests, max_num_seqs=32, max_prefill_tokens=2048
    )


def test_headroom_is_the_next_tokens_deadline_less_now():
    r = _req("a", ttft=2.0, tpot=0.1, arrival=10.0)
    assert r.deadline() == 12.0 and r.headroom(11.5) == pytest.approx(0.5)
    decoding = _req("b", ttft=2.0, tpot=0.1, arrival=10.0, output_tokens=5, computed_tokens=10)
    assert decoding.deadline() == pytest.approx(12.5)
    assert decoding.headroom(13.0) < 0  # late: an SLO miss
    assert earliest_deadline([r, decoding]) == 12.0 and earliest_deadline([]) == math.inf


def test_the_turn_goes_to_the_least_headroom_and_ties_agree():
    def at(**deadlines: float) -> dict[str, Urgency]:
        return {name: Urgency(False, d) for name, d in deadlines.items()}

    assert next_turn(at(a=5.0, b=3.0, c=4.0)) == "b"
    assert next_turn(at(b=3.0, a=3.0)) == "a"
    assert next_turn(at(a=math.inf)) is None and next_turn({}) is None


def test_an_instance_whose_most_urgent_is_a_prompt_late_by_less_than_the_yield_goes_last():
    """As its engine serves such a prompt behind its own prompts in time, the device serves
    its instance behind every instance holding a request in time; late by more, or one that
    has produced tokens (its next token due), keeps its deadline's place."""
    now = 10.0
    late = _req("late", arrival=7.0, ttft=2.0)  # due at 9: late by 1 s
    in_time = _req("fresh", arrival=9.0, ttft=2.0)  # due at 11
    very_late = _req("old", arrival=2.0, ttft=2.0)  # due at 4: late by 6 s
    decoding = _req("dec", arrival=7.0, ttft=2.0, tpot=0.1, output_tokens=2, computed_tokens=10)
    assert urgency([late, in_time], now, 3.0) == Urgency(False, 11.0)
    assert urgency([late], now, 3.0) == Urgency(True, 9.0)
    assert urgency([late], now, 0.0) == Urgency(False, 9.0)  # no yield: its deadline
    assert urgency([very_late], now, 3.0) == Urgency(False, 4.0)
    assert urgency([decoding], now, 3.0) == Urgency(False, pytest.approx(9.2))
    assert urgency([], now, 3.0) == NO_WORK
    claims = {"a": urgency([late], now, 3.0), "b": urgency([in_time], now, 3.0)}
    assert next_turn(claims) == "b"
    claims["c"] = urgency([very_late], now, 3.0)
    assert next_turn(claims) == "c"
    assert next_turn({"a": urgency([late], now, 0.0), "b": urgency([in_time], now, 0.0)}) == "a"
    assert next_turn({"a": urgency([late], now, 3.0)}) == "a"  # alone: work-conserving


def test_a_request_an_idle_device_can_serve_is_admitted():
    v = validate([_inst("a"), _inst("b")], "a", _req("new", prompt=100), 0.0)
    assert v.ok and v.reason == ""
    assert v.first_token_s == pytest.approx(0.1 * 1.1)  # its prefill, with the margin


def test_the_play_runs_an_instances_prompts_as_its_engine_orders_them():
    """By deadline (a short prompt due first takes its chunk before a long one's); with the
    engine's late yield, a prompt late by less than it goes behind those in time. 500
    prompt tokens an iteration (0.55 s with the margin); a 1,500-token prompt waits."""
    short = _req("new", prompt=100, ttft=1.0)  # due at 1
    long = _req("long", prompt=1500, ttft=3.0)  # due at 3
    inst = dataclasses.replace(_inst("a", long), max_prefill_tokens=500)
    v = validate([inst], "a", short, 0.0)  # first come would finish it at 1.76 s
    assert v.ok and v.first_token_s == pytest.approx(0.55)
    # At 10 s the long prompt is late by 0.5 s: by deadline it still goes first.
    late = _req("long", prompt=1500, ttft=2.0, arrival=7.5)
    short = _req("new", prompt=100, ttft=1.0, arrival=10.0)
    inst = dataclasses.replace(_inst("a", late), max_prefill_tokens=500)
    v = validate([inst], "a", short, 10.0)
    assert not v.ok and v.reason == "late"  # its first token at 11.76 s, past 11
    v = validate([dataclasses.replace(inst, late_yield_s=3.0)], "a", short, 10.0)
    assert v.ok and v.first_token_s == pytest.approx(0.55)
    # The batch's slots go in the order held: with one, the long prompt (maybe running
    # already: a view may be an iteration old) keeps it, and the short one waits behind it.
    inst = dataclasses.replace(
        _inst("a", long, _req("dec", output_tokens=1, expected_output=2, computed_tokens=10)),
        max_num_seqs=2,
    )
    assert validate([inst], "a", _req("new", prompt=100, ttft=1.0), 0.0).reason == "late"


def test_a_request_that_would_be_late_is_refused():
    # Another instance's prompt (1.5 s, due first) runs before the newcomer's (1 s): its
    # first token would come at 2.75 s, past its 2 s limit.
    other = _req("other", prompt=1500, ttft=1.9)
    v = validate([_inst("a"), _inst("b", other)], "a", _req("new", prompt=1000, ttft=2.0), 0.0)
    assert (v.ok, v.reason, v.request) == (False, "late", "new")
    assert v.first_token_s == pytest.approx(2.5 * 1.1)


def test_a_request_late_on_the_instance_alone_is_not_refused_as_late():
    # Late with nothing else on the device: refusing it would only turn a slow answer into
    # none. A prompt too long for the device's speed:
    v = validate([_inst("a")], "a", _req("new", prompt=4000, ttft=2.0), 0.0)
    assert v.ok and v.first_token_s == pytest.approx(4.0 * 1.1)
    # A request that waited out a cold start (arrived at 0, its model ready at 2.6 s):
    v = validate([_inst("a"), _inst("b")], "a", _req("new", prompt=100, ttft=2.0), 2.6)
    assert v.ok and v.first_token_s == pytest.approx(2.6 + 0.11)


def test_a_request_late_alone_may_wait_its_turn_but_not_a_queue():
    # Its deadline becomes a TTFT SLO after the soonest it could start alone (0.11 s later:
    # 4.71 s). The instance's one slot is taken by a generation (10 ms a token): 50 more
    # tokens, and it waits 0.5 s for it...
    late = _req("new", prompt=100, ttft=2.0)
    held = _req("held", prompt=10, ttft=100.0, tpot=1.0, computed_tokens=10, output_tokens=1)

    def one_slot(tokens_left: int) -> InstanceView:
        running = dataclasses.replace(held, expected_output=1 + tokens_left)
        return dataclasses.replace(_inst("a", running), max_num_seqs=1)

    v = validate([one_slot(50)], "a", late, 2.6)
    assert v.ok and v.first_token_s == pytest.approx(2.6 + 0.55 + 0.11)
    # ...400 more (4.4 s), and it is refused: the job executor tries elsewhere.
    v = validate([one_slot(400)], "a", late, 2.6)
    assert (v.ok, v.reason, v.request) == (False, "late", "new")
    assert v.first_token_s == math.inf  # the play stops at its deadline


def test_a_late_request_that_yields_may_wait_out_the_yield():
    """Where the engine lets late prompts yield, a request already late waits behind the
    instance's prompts still in time, at the latest until it is late by more than the
    bound: its turn, which refusing it everywhere would only take from it."""
    # Late by 0.5 s at 10 s; alone its first token would come at 10.11 s. The prompt in
    # time (1,500 tokens, due at 13 s) takes three iterations of 500 first (0.55 s each).
    late = _req("new", prompt=100, ttft=1.0, arrival=8.5)
    inst = dataclasses.replace(
        _inst("a", _req("intime", prompt=1500, ttft=3.0, arrival=10.0)), max_prefill_tokens=500
    )
    assert validate([inst], "a", late, 10.0).ok  # by deadline: it goes first
    v = validate([dataclasses.replace(inst, late_yield_s=3.0)], "a", late, 10.0)
    assert v.ok and v.first_token_s == pytest.approx(3 * 0.55 + 0.11 + 1.5)
    # Behind the bound it still may not wait for a batch slot it cannot see the end of: the
    # one slot held by a generation with 400 tokens to go (4.4 s).
    held = _req("held", prompt=10, ttft=100.0, tpot=1.0, computed_tokens=10, output_tokens=1)
    one_slot = InstanceView(
        instance="a",
        perf=EXACT_PERF,
        requests=(dataclasses.replace(held, expected_output=401),),
        max_num_seqs=1,
        max_prefill_tokens=2048,
        late_yield_s=3.0,
    )
    v = validate([one_slot], "a", late, 10.0)
    assert (v.ok, v.reason) == (False, "late")


def test_the_plays_kept_claims_are_the_claims_urgency_makes():
    """The play keeps each instance's claim until its requests move or one of its prompts
    starts or stops yielding: at every moment it is what ``urgency`` says."""
    from services.job_executor.shadow import _Instance, _Req

    reqs = (
        _req("p", prompt=100, ttft=1.0, arrival=0.0),  # due at 1, yields until 4
        _req("q", prompt=100, ttft=2.5, arrival=0.0),  # due at 2.5, yields until 5.5
        _req("d", computed_tokens=10, output_tokens=2, tpot=0.5, ttft=2.0),  # due at 3
    )
    view = dataclasses.replace(_inst("a", *reqs), late_yield_s=3.0)
    inst = _Instance(view, [_Req(r, r.computed_tokens, r.output_tokens) for r in reqs])
    for now in (0.0, 0.5, 1.0, 2.0, 2.5, 3.9, 4.0, 5.0, 5.5, 6.0):  # (the play moves on)
        assert inst.claim(now) == urgency(reqs, now, 3.0), now
    end = inst.iterate(0.0, 0.1)  # tokens came: the claim is made anew
    views = [
        dataclasses.replace(r.view, computed_tokens=r.computed, output_tokens=r.output)
        for r in inst.reqs
    ]
    assert inst.claim(end) == urgency(views, end, 3.0)


def test_a_request_that_pushes_an_admitted_one_past_its_deadline_is_refused():
    # a's waiting prompt (0.55 s) is due at 0.6 s: it makes it alone. The newcomer is due
    # first (0.3 s), so it runs first, and a's first token comes at 0.66 s.
    a = _req("held", prompt=500, ttft=0.6)
    v = validate([_inst("a", a), _inst("b")], "b", _req("new", prompt=100, ttft=0.3), 0.0)
    assert (v.ok, v.reason, v.request) == (False, "pushes", "held")
    # The same newcomer with a later deadline waits its turn: both make it.
    v = validate([_inst("a", a), _inst("b")], "b", _req("new", prompt=100, ttft=1.0), 0.0)
    assert v.ok, v


def test_a_request_that_stretches_a_decode_round_past_the_tpot_is_refused():
    # A decoding request with a 15 ms TPOT: its instance's step (11 ms with the margin) fits;
    # a turn of a second instance in every round (22 ms) does not.
    tight = _req("decoding", ttft=10.0, tpot=0.015, computed_tokens=10, output_tokens=5)
    v = validate([_inst("a", tight), _inst("b")], "b", _req("new", prompt=20), 0.0)
    assert (v.ok, v.reason, v.request) == (False, "tpot", "decoding")
    # Joining its own instance adds no turn to the round.
    v = validate([_inst("a", tight), _inst("b")], "a", _req("new", prompt=20), 0.0)
    assert v.ok, v
    # With a 50 ms TPOT both turns fit.
    loose = _req("decoding", ttft=10.0, tpot=0.05, computed_tokens=10, output_tokens=5)
    v = validate([_inst("a", loose), _inst("b")], "b", _req("new", prompt=20), 0.0)
    assert v.ok, v
    # A request with one token to produce never decodes: it adds no turn to the rounds.
    one = _req("new", prompt=20, expected_output=1)
    assert validate([_inst("a", tight), _inst("b")], "b", one, 0.0).ok
    # The newcomer's own TPOT counts too.
    v = validate([_inst("a", loose), _inst("b")], "b", _req("new", prompt=20, tpot=0.015), 0.0)
    assert (v.ok, v.reason, v.request) == (False, "tpot", "new")


def test_what_was_already_late_does_not_block_a_newcomer():
    late = _req("late", prompt=10, ttft=0.001, computed_tokens=10, output_tokens=1)
    v = validate([_inst("a", late)], "a", _req("new", prompt=50), 0.0)
    assert v.ok, v


def test_the_newcomer_on_a_busy_instance_shares_its_iterations():
    # 31 decoding requests on the target: the newcomer's prefill joins their iterations.
    busy = [
        _req(f"r{i}", ttft=5.0, tpot=0.5, computed_tokens=10, output_tokens=3) for i in range(31)
    ]
    v = validate([_inst("a", *busy)], "a", _req("new", prompt=200), 0.0)
    assert v.ok and v.first_token_s == pytest.approx(0.2 * 1.1)
    # A full batch: the newcomer waits for a slot; none frees within its TTFT.
    full = [*busy, _req("r31", ttft=5.0, tpot=0.5, computed_tokens=10, output_tokens=3)]
    v = validate([_inst("a", *full)], "a", _req("new", prompt=200, ttft=0.5), 0.0)
    assert (v.ok, v.reason) == (False, "late")


def test_an_instance_slower_than_its_profile_is_played_as_it_runs():
    from services.job_executor.shadow import iteration_s

    # Another instance's prompt, due first, runs before the newcomer's.
    device = [_inst("a"), _inst("b", _req("other", prompt=300, ttft=0.5, expected_output=1))]
    new = _req("new", prompt=1000, ttft=2.5)
    v = validate(device, "a", new, 0.0)  # 0.33 + 1.1 s by its profile
    assert v.ok and v.first_token_s == pytest.approx(1.43)
    slow = [dataclasses.replace(device[0], stretch=2.0), device[1]]  # a runs twice as long
    v = validate(slow, "a", new, 0.0)
    assert (v.ok, v.reason) == (False, "late") and v.first_token_s == pytest.approx(2.53)
    # What the arbiter times each turn against: the profile's next iteration.
    decoding = _req("d", computed_tokens=10, output_tokens=3)
    assert iteration_s(_inst("a", decoding)) == pytest.approx(0.01)
    assert iteration_s(_inst("a", _req("p", prompt=500))) == pytest.approx(0.5)
