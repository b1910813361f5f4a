"""Durable task graphs on a real Redis: one owner at a time under a fencing number; a graph is
taken over only from an owner whose liveness key expired, a deposed owner's late write is
refused, a job executor placing a job again continues the dead one's prefill (cancelling
what it cannot continue), and orphans nobody continues are swept past their deadline."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.job_executor.graph_keeper import GraphKeeper
from services.job_executor.planner import DECODE, PREFILL, plan_chat, with_task
from shared.errors import Deposed
from shared.messages.tasks import KvSource
from shared.store import Store
from shared.task_graphs import GraphStore, GraphTask, TaskState, prompt_digest

pytestmark = [pytest.mark.redis]

PROMPT = prompt_digest(list(range(40)))
SOURCE = KvSource(te_id="te-p", address="127.0.0.1:9", key="r1-0/prefill")


def _graph(graph_id: str = "r1", deadline: float | None = None):  # type: ignore[no-untyped-def]
    g = plan_chat(
        graph_id=graph_id,
        model="m",
        deadline=deadline if deadline is not None else time.time() + 60,
        prompt=PROMPT,
        decode_te="te-d",
        prefill_te="te-p",
    )
    return with_task(g, PREFILL, state=TaskState.PLACED, kv_source=SOURCE, attempt=0)


async def test_one_owner_at_a_time_and_a_deposed_write_is_refused(
    store: Store, cluster: str
) -> None:
    a, b = GraphStore(store, cluster, "je-a"), GraphStore(store, cluster, "je-b")
    await a.alive(30)
    g = _graph()
    epoch = await a.open(g)
    assert epoch == 1
    assert await a.open_ids() == ["r1"]
    # A live owner's graph can be neither opened anew nor claimed by a peer.
    assert await b.open(g) is None
    held = await b.get("r1")
    assert held is not None and held.owner == "je-a" and held.owner_alive and held.open
    assert await b.claim("r1", held.epoch) is None
    # The owner is gone: the peer takes it over; the old owner's late write is refused.
    await a.leave()
    held = await b.get("r1")
    assert held is not None and not held.owner_alive
    new = await b.claim("r1", held.epoch)
    assert new == 2
    assert await a.claim("r1", held.epoch) is None  # a second claimant of that epoch loses
    with pytest.raises(Deposed):
        await a.put(with_task(g, DECODE, state=TaskState.PLACING), epoch)
    # The new owner finishes it: it leaves the open set and expires.
    done = with_task(held.graph, DECODE, state=TaskState.PLACED)
    done.finished = True
    await b.put(done, new)
    assert await b.open_ids() == []
    after = await b.get("r1")
    assert after is not None and not after.open and after.graph.task(DECODE).state == "placed"
    ttl = await store.redis.pttl(f"{cluster}:graph:r1")
    assert 0 < ttl <= 120_000
    # A later attempt may open a graph of the same id again, its epoch still rising.
    assert await a.open(_graph()) == 3


async def test_liveness_expires_on_its_own(store: Store, cluster: str) -> None:
    a, b = GraphStore(store, cluster, "je-a"), GraphStore(store, cluster, "je-b")
    await a.alive(0.2)
    await a.open(_graph())
    held = await b.get("r1")
    assert held is not None and held.owner_alive
    await asyncio.sleep(0.3)
    held = await b.get("r1")
    assert held is not None and not held.owner_alive
    assert await b.claim("r1", held.epoch) == 2


class _Cancels:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str, int]] = []

    async def __call__(self, request_id: str, task: GraphTask) -> None:
        self.calls.append((request_id, task.kind, task.te_id, task.attempt))


def _keeper(store: Store, cluster: str, je: str, cancels: _Cancels) -> GraphKeeper:
    return GraphKeeper(
        store, cluster=cluster, je_id=je, liveness_s=0.3, heartbeat_s=0.05, cancel=cancels
    )


async def test_a_job_placed_again_continues_the_dead_jes_prefill(
    store: Store, cluster: str
) -> None:
    dead = GraphStore(store, cluster, "je-dead")
    await dead.alive(0.3)  # it dies now: its key expires after the liveness timeout
    await dead.open(_graph())
    cancels = _Cancels()
    keeper = _keeper(store, cluster, "je-new", cancels)
    t0 = time.monotonic()
    resumed = await keeper.take_over("r1", PROMPT, lambda: {"te-p", "te-d"})
    assert resumed is not None and resumed.source == SOURCE
    assert time.monotonic() - t0 < 1.0  # waited for the key, not much longer
    assert cancels.calls == [] and keeper.taken_over == 1
    assert resumed.run.epoch == 2
    assert resumed.run.graph.task(DECODE).state == TaskState.PLANNED
    # The continuation is recorded under the new epoch.
    graph = with_task(resumed.run.graph, DECODE, state=TaskState.PLACING, te_id="te-d2")
    await keeper.step(resumed.run, graph)
    held = await GraphStore(store, cluster, "x").get("r1")
    assert held is not None and held.owner == "je-new" and held.epoch == 2
    assert held.graph.task(DECODE).te_id == "te-d2"


async def test_what_a_dead_je_left_that_cannot_continue_is_cancelled(
    store: Store, cluster: str
) -> None:
    dead = GraphStore(store, cluster, "je-dead")
    g = with_task(_graph(), DECODE, state=TaskState.PLACING, te_id="te-d", attempt=0)
    await dead.open(g)  # never alive: gone from the start
    cancels = _Cancels()
    keeper = _keeper(store, cluster, "je-new", cancels)
    # Its prefill TE is gone too: nothing to continue from.
    assert await keeper.take_over("r1", PROMPT, lambda: {"te-d"}) is None
    assert sorted(cancels.calls) == [("r1", "decode", "te-d", 0), ("r1", "prefill", "te-p", 0)]
    held = await dead.get("r1")
    assert held is not None and not held.open
    assert {t.state for t in held.graph.tasks} == {TaskState.CANCELLED}
    # No graph, or a finished one: the job is planned anew without waiting.
    assert await keeper.take_over("nope", PROMPT, lambda: set()) is None
    assert await keeper.take_over("r1", PROMPT, lambda: set()) is None


async def test_orphans_are_swept_only_past_their_deadline(store: Store, cluster: str) -> None:
    dead = GraphStore(store, cluster, "je-dead")
    now = time.time()
    await dead.open(_graph("late", deadline=now - 1))
    await dead.open(_graph("fresh", deadline=now + 60))
    live = GraphStore(store, cluster, "je-live")
    await live.alive(30)
    await live.open(_graph("held", deadline=now - 1))
    cancels = _Cancels()
    keeper = _keeper(store, cluster, "je-sweeper", cancels)
    assert await keeper.sweep_once(time.time()) == 1
    assert cancels.calls == [("late", "prefill", "te-p", 0)]
    assert sorted(await live.open_ids()) == ["fresh", "held"]
