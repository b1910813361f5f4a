"""The planner: chat jobs into task graphs, which tasks may start, and what a job executor
that takes over a dead one's graph continues or cancels."""

from __future__ import annotations

from services.job_executor.planner import (
    DECODE,
    GENERATE,
    PREFILL,
    abandoned,
    continuation,
    durable,
    plan_chat,
    ready,
    with_task,
)
from shared.messages.tasks import KvSource, TaskMode
from shared.task_graphs import TaskState, prompt_digest

SOURCE = KvSource(te_id="te-p", address="127.0.0.1:1", key="r-0/prefill")
PROMPT = prompt_digest([1, 2, 3])


def _pd(**prefill: object):  # type: ignore[no-untyped-def]
    g = plan_chat(
        graph_id="r",
        model="m",
        deadline=100.0,
        prompt=PROMPT,
        decode_te="te-d",
        prefill_te="te-p",
    )
    return with_task(g, PREFILL, **prefill) if prefill else g


def test_a_colocated_job_is_one_task_and_is_not_kept() -> None:
    g = plan_chat(graph_id="r", model="m", deadline=1.0, prompt=PROMPT, decode_te="te-c")
    assert [(t.name, t.kind, t.te_id) for t in g.tasks] == [(GENERATE, TaskMode.COLOCATED, "te-c")]
    assert not durable(g)
    assert ready(g) == g.tasks


def test_the_decode_task_may_start_once_the_prefill_is_placed() -> None:
    g = _pd()
    assert durable(g)
    assert [t.name for t in ready(g)] == [PREFILL]
    assert ready(_pd(state=TaskState.PLACING)) == []  # its answer is not known yet
    assert [t.name for t in ready(_pd(state=TaskState.PLACED))] == [DECODE]
    assert ready(_pd(state=TaskState.FAILED)) == []


def test_a_placed_prefill_is_continued_for_the_same_prompt_on_a_live_te() -> None:
    g = _pd(state=TaskState.PLACED, kv_source=SOURCE)
    c = continuation(g, prompt=PROMPT, live_tes={"te-p", "te-d"})
    assert c.source == SOURCE and c.cancel == ()


def test_what_cannot_be_continued_is_cancelled() -> None:
    placed = _pd(state=TaskState.PLACED, kv_source=SOURCE)
    # Its TE is gone: nothing to continue from, nothing to cancel but the prefill record.
    gone = continuation(placed, prompt=PROMPT, live_tes={"te-d"})
    assert gone.source is None and [t.name for t in gone.cancel] == [PREFILL]
    # Another prompt (the request moved on after tokens were generated).
    other = continuation(placed, prompt=prompt_digest([1, 2, 3, 4]), live_tes={"te-p"})
    assert other.source is None and [t.name for t in other.cancel] == [PREFILL]
    # The decode task was being placed: it is cancelled, the prefill continued (were its KV
    # pulled already, the new decode task's pull fails and it prefills itself).
    both = with_task(placed, DECODE, state=TaskState.PLACING, attempt=0)
    c = continuation(both, prompt=PROMPT, live_tes={"te-p", "te-d"})
    assert c.source == SOURCE and [t.name for t in c.cancel] == [DECODE]
    # A prefill whose answer never came may run there: cancelled, planned anew.
    c = continuation(_pd(state=TaskState.PLACING), prompt=PROMPT, live_tes={"te-p"})
    assert c.source is None and [t.name for t in c.cancel] == [PREFILL]
    # A refused one is nowhere.
    c = continuation(_pd(state=TaskState.FAILED), prompt=PROMPT, live_tes={"te-p"})
    assert c == type(c)(None, ())


def test_an_orphaned_chat_graph_is_abandoned_past_its_deadline() -> None:
    assert not abandoned(_pd(), now=99.0)
    assert abandoned(_pd(), now=101.0)


def test_digests_tell_prompts_apart() -> None:
    assert prompt_digest([1, 2, 3]) == PROMPT
    assert prompt_digest([1, 2, 3, 0]) != PROMPT
    assert prompt_digest([70000]) != prompt_digest([70000 % 65536])
