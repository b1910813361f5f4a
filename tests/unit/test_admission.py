"""Admission control (services/job_executor/admission.py): shed only when every ready
instance is saturated and no capacity is coming."""

from __future__ import annotations

import msgspec

from services.job_executor.admission import shed
from services.views import TEView
from shared.messages.cluster import JobShare, TEState
from shared.messages.scaling import InstanceCapacity

CAP = InstanceCapacity(
    prefill_s=1e-4,
    prefill_attention_s=0.0,
    decode_s=1e-3,
    decode_context_s=0.0,
    max_num_seqs=4,
    decode_step_s=0.02,
)


def te(te_id, state=TEState.READY, model="m", running=4, waiting=0, capacity=CAP) -> TEView:
    return TEView(
        te_id=te_id,
        pool_id="p",
        state=state,
        model=model if state != TEState.IDLE else None,
        running=running,
        waiting=waiting,
        capacity=capacity,
    )


def verdict(tes, placed=None, per_slot=2):
    return shed("m", tes, placed or {}, max_queued_per_slot=per_slot, mean_output_tokens=100)


def test_every_instance_saturated_and_nothing_coming_sheds():
    # 2 x 4 slots queued on each, all slots busy: a new request waits two full batches.
    got = verdict([te("a", waiting=8), te("b", waiting=9), te("c", model="other")])
    assert got is not None and got.instances == 2 and got.queued == 8
    assert abs(got.retry_after_s - 2 * 100 * 0.02) < 1e-9  # two batches of 100 steps


def test_one_instance_with_room_admits():
    assert verdict([te("a", waiting=8), te("b", waiting=7)]) is None
    assert verdict([te("a", waiting=8, running=2)]) is None  # free slots take two of them


def test_the_ledger_corrects_the_report_both_ways():
    # Placed since the report: they count. Ended since the report: they no longer do.
    assert verdict([te("a", waiting=6)]) is None
    assert verdict([te("a", waiting=6)], placed={"a": JobShare(sequences=2)}) is not None
    assert verdict([te("a", waiting=8)]) is not None
    assert verdict([te("a", waiting=8)], placed={"a": JobShare(sequences=-1)}) is None
    # A report of a TE that has since run dry: never below nothing.
    assert verdict([te("a", waiting=8)], placed={"a": JobShare(sequences=-100)}) is None


def test_capacity_coming_admits():
    full = te("a", waiting=20)
    assert verdict([full, te("i", state=TEState.IDLE)]) is None
    assert verdict([full, te("p", state=TEState.PRELOADING)]) is None
    # A scale-in just before a burst: draining TEs turn idle as their last streams end.
    assert verdict([full, te("d", state=TEState.DRAINING)]) is None
    assert verdict([full, te("d", state=TEState.DRAINING, model="other")]) is None
    assert verdict([full, te("l", state=TEState.LOADING)]) is None
    assert verdict([full, te("l", state=TEState.LOADING, model="other")]) is not None


def test_no_ready_instance_unknown_capacity_or_off_never_sheds():
    assert verdict([te("l", state=TEState.LOADING)]) is None  # from zero: held, not shed
    assert verdict([te("a", waiting=20, capacity=None)]) is None
    assert verdict([te("a", waiting=20)], per_slot=0) is None


def test_retry_after_is_at_least_a_second():
    tiny = msgspec.structs.replace(CAP, decode_step_s=1e-6)
    assert verdict([te("a", waiting=20, capacity=tiny)]).retry_after_s == 1.0


def test_a_job_every_instance_refused_as_too_busy_is_refused_when_nothing_comes():
    from services.job_executor.admission import device_busy

    tes = [te("a"), te("b"), te("c", model="other")]
    assert device_busy("m", tes, {"a", "b"})
    assert not device_busy("m", tes, {"a"})  # b may still take it
    assert not device_busy("m", tes, set())
    assert not device_busy("m", [*tes, te("d", state=TEState.IDLE)], {"a", "b"})  # a load comes
    assert not device_busy("m", [*tes, te("e", state=TEState.LOADING)], {"a", "b"})
    assert not device_busy("x", tes, {"a", "b"})  # no ready instance: holding's business
