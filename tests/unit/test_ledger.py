"""The job executor's placement ledger (services/job_executor/ledger.py): each TE's work is
its last report corrected by the placements the JE made and heard of since, exactly."""

from __future__ import annotations

import dataclasses
import random

from services.job_executor import ledger
from services.job_executor.admission import shed
from services.job_executor.ledger import PlacementLedger
from services.views import TEView
from shared.messages.cluster import JobShare, TEState
from shared.messages.scaling import InstanceCapacity

CAP = InstanceCapacity(
    prefill_s=1e-4, prefill_attention_s=0.0, decode_s=1e-3, decode_context_s=0.0, max_num_seqs=2
)


def report(te_id="a", *, waiting=0, running=0, shares=None, placements=0) -> TEView:
    return TEView(
        te_id=te_id,
        pool_id="p",
        state=TEState.READY,
        model="m",
        running=running,
        waiting=waiting,
        capacity=CAP,
        shares=shares or {},
        placements=placements,
    )


def test_a_sequential_client_is_one_request_in_flight_however_fast():
    # The bug this replaces: placements counted until the TE's next report, so a client
    # sending 160 requests between two heartbeats looked like 160 queued requests.
    book = PlacementLedger("je")
    stale = report()  # the last report: an idle TE
    for i in range(10_000):
        book.placed("a", f"r{i}", 12)
        assert ledger.sequences(stale, book.unreported) == 1
        assert (
            shed("m", [stale], book.unreported, max_queued_per_slot=1, mean_output_tokens=1) is None
        )
        book.accepted(f"r{i}", i + 1)
        book.prefilled(f"r{i}", "a")
        book.ended(f"r{i}", "a")
    assert book.unreported == {} and book.outstanding("a") == 0


def test_a_burst_beyond_the_bound_is_shed_at_once():
    book = PlacementLedger("je")
    stale = report()
    verdicts = []
    for i in range(16):
        v = shed("m", [stale], book.unreported, max_queued_per_slot=1, mean_output_tokens=48)
        verdicts.append(v)
        if v is None:
            book.placed("a", f"r{i}", 12)
    # Two batch slots and one batch of queue: four in, the other twelve refused.
    assert sum(v is None for v in verdicts) == 4
    assert all(v is not None and v.retry_after_s >= 1 for v in verdicts[4:])


def test_a_report_replaces_what_it_covers_and_nothing_more():
    book = PlacementLedger("je")
    for i in range(3):
        book.placed("a", f"r{i}", 100)
        book.accepted(f"r{i}", i + 1)
    assert book.unreported["a"] == JobShare(sequences=3, prefill_tokens=300)
    # The TE counted all three, one decoding, with another JE's two.
    mine = JobShare(sequences=3, decoding=1, prefill_tokens=200)
    other = JobShare(sequences=2, prefill_tokens=50)
    book.prefilled("r0", "a")
    rep = report(running=1, waiting=4, shares={"je": mine, "je2": other}, placements=5)
    book.report(rep)
    assert "a" not in book.unreported  # the report shows all this JE knows
    assert ledger.sequences(rep, book.unreported) == 5
    # Since: one more placed, one ended.
    book.placed("a", "r3", 10)
    book.ended("r1", "a")
    assert book.unreported["a"] == JobShare(sequences=0, decoding=0, prefill_tokens=-90)
    assert ledger.sequences(rep, book.unreported) == 5
    assert ledger.prefill_tokens(rep, {"a": book.unreported["a"]}) == 0


def test_a_lost_notice_is_healed_by_the_next_report():
    book = PlacementLedger("je")
    for i in range(4):
        book.placed("a", f"r{i}", 10)
        book.accepted(f"r{i}", i + 1)
    book.placed("a", "r4", 10)  # not answered yet: the report cannot know it
    # The TE had taken four and holds its third and fourth: the first two ended, and their
    # notices never came.
    share = JobShare(sequences=2, prefill_tokens=20, oldest=3)
    book.report(report(waiting=2, shares={"je": share}, placements=4))
    assert book.outstanding("a") == 3  # r2, r3, r4
    # It holds none of this JE's: everything it had taken has ended.
    book.report(report(placements=4))
    assert book.outstanding("a") == 1  # r4, not yet answered
    book.accepted("r4", 5)
    book.report(report(placements=5))
    assert book.outstanding("a") == 0 and book.unreported == {}


def test_a_notice_from_a_te_the_task_has_left_changes_nothing():
    book = PlacementLedger("je")
    book.placed("a", "r0", 10)
    book.ended("r0", "a")  # a is unreachable: placed again on b
    book.placed("b", "r0", 10)
    book.ended("r0", "a")  # a's late notice of its copy
    book.prefilled("r0", "a")
    assert book.outstanding("b") == 1 and book.unreported["b"].prefill_tokens == 10


def test_tes_gone_from_the_view_are_forgotten():
    book = PlacementLedger("je")
    book.placed("a", "r0", 10)
    book.report(report("b", shares={"je": JobShare(sequences=1)}))
    book.keep_only({"c"})
    assert book.unreported == {} and book.outstanding("a") == 0


def test_random_interleavings_never_undercount_and_heal():
    """A TE, a JE and the bus between them in a random order, notices late or lost: the
    report corrected by the ledger never counts fewer tasks than the TE holds, and once the
    TE holds none, it counts none."""
    rng = random.Random(7)
    for _ in range(200):
        book = PlacementLedger("je")
        held: dict[str, bool] = {}  # the TE's tasks -> decoding
        placements = 0
        notices: list[tuple[str, str]] = []  # in flight, in order
        seq_of: dict[str, int] = {}
        lost = 0
        last = report()
        for step in range(60):
            op = rng.random()
            if op < 0.35:
                key = f"r{step}"
                book.placed("a", key, 5)
                placements += 1
                held[key] = False
                seq_of[key] = placements
                book.accepted(key, placements)
            elif op < 0.5 and held:
                key = rng.choice([k for k, d in held.items() if not d] or list(held))
                if not held[key]:
                    held[key] = True
                    notices.append(("prefilled", key))
            elif op < 0.7 and held:
                key = rng.choice(list(held))
                del held[key]
                notices.append(("ended", key))
            elif op < 0.8 and notices:
                kind, key = notices.pop(0)
                getattr(book, kind)(key, "a")
            elif op < 0.85 and notices:  # lost on the way
                kind, key = notices.pop(rng.randrange(len(notices)))
                lost += kind == "ended"
            else:  # a heartbeat
                share = JobShare(
                    sequences=len(held),
                    decoding=sum(held.values()),
                    prefill_tokens=5 * sum(1 for d in held.values() if not d),
                    oldest=min((seq_of[k] for k in held), default=0),
                )
                last = report(
                    running=sum(held.values()),
                    waiting=len(held) - sum(held.values()),
                    shares={"je": share} if held else {},
                    placements=placements,
                )
                book.report(last)
                # never below the truth; above it by no more than the notices on their way
                # or lost
                on_way = sum(1 for kind, _ in notices if kind == "ended")
                counted = ledger.sequences(last, book.unreported)
                assert len(held) <= counted <= len(held) + on_way + lost
        for kind, key in notices:
            getattr(book, kind)(key, "a")
        # A last heartbeat once the TE holds nothing more: lost notices or not, exact.
        for key in list(held):
            del held[key]
        last = report(placements=placements)
        book.report(last)
        assert ledger.sequences(last, book.unreported) == 0
        assert book.outstanding("a") == 0 and book.unreported == {}


def test_a_decode_tasks_incoming_kv_is_counted_until_it_starts_decoding():
    # PD: a decode task's prompt KV comes from a prefill TE; it is no prefill work there,
    # but it will take KV room, from placement until its first token.
    book = PlacementLedger("je")
    stale = report()
    book.placed("a", "r1", 0, import_tokens=5000)
    assert ledger.prefill_tokens(stale, book.unreported) == 0
    assert ledger.import_tokens(stale, book.unreported) == 5000
    # The TE's report now shows it: counted once, not twice.
    shown = report(shares={"je": JobShare(sequences=1, import_tokens=5000)}, placements=1)
    shown = dataclasses.replace(shown, queued_import_tokens=5000)
    book.accepted("r1", 1)
    book.report(shown)
    assert ledger.import_tokens(shown, book.unreported) == 5000
    book.prefilled("r1", "a")  # its KV is in, its first token out
    assert ledger.import_tokens(shown, book.unreported) == 0
    book.ended("r1", "a")
    assert ledger.import_tokens(report(placements=1), book.unreported) == 0
