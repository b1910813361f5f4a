"""The job executor's side of durable task graphs (``shared.task_graphs``): it keeps this JE's
liveness key alive, records each step of its durable graphs under their fencing number,
takes over the graph of a job a dead JE held when the frontend places that job again, and
sweeps orphans nobody will continue.

Without Redis (or while it is away) graphs run as before, in memory: a JE's death then costs
its disaggregated jobs their prefill (the frontend places them again from the start)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable, Collection

import msgspec
from redis.exceptions import RedisError

from services.job_executor.planner import (
    DECODE,
    MAY_RUN,
    Continuation,
    abandoned,
    continuation,
    durable,
    with_task,
)
from shared.logging import get_logger
from shared.messages.tasks import KvSource
from shared.runner import Lifecycle
from shared.store import Store
from shared.task_graphs import GraphStore, GraphTask, TaskGraph, TaskState

log = get_logger(__name__)

Cancel = Callable[[str, GraphTask], Awaitable[None]]  # (request id, task): cancel it on its TE
POLL_S = 0.1  # while a job's graph is held by a member not yet declared gone


@dataclasses.dataclass(slots=True)
class Running:
    """A graph this JE runs: its latest state and the epoch its writes carry (None: kept
    in memory only)."""

    graph: TaskGraph
    epoch: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Resumed:
    """A dead JE's graph, taken over: its decode task continues from ``source``."""

    run: Running
    source: KvSource


class GraphKeeper:
    def __init__(
        self,
        store: Store | None,
        *,
        cluster: str,
        je_id: str,
        liveness_s: float,
        heartbeat_s: float,
        cancel: Cancel,
    ) -> None:
        self._graphs = GraphStore(store, cluster, je_id) if store is not None else None
        self._liveness_s, self._heartbeat_s = liveness_s, heartbeat_s
        self._cancel = cancel
        self.taken_over = 0  # graphs continued from a dead JE's prefill

    def start(self, life: Lifecycle) -> None:
        if self._graphs is not None:
            life.spawn(self._stay_alive(), name="graph liveness")
            life.spawn(self._sweep(), name="graph sweeper")

    async def leave(self) -> None:
        if self._graphs is not None:
            with contextlib.suppress(RedisError, OSError):
                await self._graphs.leave()

    # -- running a graph ------------------------------------------------------------------

    async def start_graph(self, graph: TaskGraph) -> Running:
        run = Running(graph)
        if self._graphs is None or not durable(graph):
            return run
        try:
            run.epoch = await self._graphs.open(graph)
        except (RedisError, OSError) as e:
            log.warning("task graph kept in memory only", error=str(e))
            return run
        if run.epoch is None:  # a live peer holds it open: this run goes unrecorded
            log.warning("task graph held by a live job executor", graph=graph.graph_id)
        return run

    async def step(self, run: Running, graph: TaskGraph) -> None:
        """Record the graph's new state (``finished``: closed). Raises ``Deposed`` if another
        JE took it over: the caller undoes what it placed for it."""
        run.graph = graph
        if self._graphs is None or run.epoch is None:
            return
        try:
            await self._graphs.put(graph, run.epoch)
        except (RedisError, OSError) as e:
            log.warning("task graph step not recorded", graph=graph.graph_id, error=str(e))

    # -- continuing a dead JE's graph ------------------------------------------------------

    async def take_over(
        self, request_id: str, prompt: str, live_tes: Callable[[], Collection[str]]
    ) -> Resumed | None:
        """A job placed again by the frontend (its JE was declared gone): the graph that JE
        left, if it left one open. Waits for the owner's liveness key to expire (the frontend
        may hear of its death first); then cancels what cannot be continued and returns the
        prefill to continue from, or None (the job is planned anew)."""
        if self._graphs is None:
            return None
        give_up = time.monotonic() + self._liveness_s + 2 * self._heartbeat_s
        try:
            while True:
                held = await self._graphs.get(request_id)
                if held is None or not held.open:
                    return None
                # This JE's own graph, if the frontend gave up on it (its answer was lost):
                # taken over the same way, which deposes the placement still running it.
                if held.owner_alive and held.owner != self._graphs.me:
                    if time.monotonic() > give_up:
                        return None
                    await asyncio.sleep(POLL_S)
                    continue
                epoch = await self._graphs.claim(request_id, held.epoch)
                if epoch is not None:
                    break
            plan = continuation(held.graph, prompt=prompt, live_tes=live_tes())
            graph = await self._undo(request_id, held.graph, plan, "its job executor is gone")
            run = Running(graph, epoch)
            log.info(
                "task graph taken over",
                graph=request_id,
                dead_owner=held.owner,
                epoch=epoch,
                continued=plan.source is not None,
            )
            if plan.source is None:
                await self.step(run, msgspec.structs.replace(graph, finished=True))
                return None
            self.taken_over += 1
            return Resumed(run, plan.source)
        except (RedisError, OSError) as e:
            log.warning("task graph not read", graph=request_id, error=str(e))
            return None

    async def _undo(
        self, request_id: str, graph: TaskGraph, plan: Continuation, why: str
    ) -> TaskGraph:
        for task in plan.cancel:
            await self._cancel(request_id, task)
            graph = with_task(graph, task.name, state=TaskState.CANCELLED, reason=why)
        if plan.source is not None:  # the decode task is placed again, by this JE
            graph = with_task(graph, DECODE, state=TaskState.PLANNED, te_id="")
        return graph

    # -- orphans ---------------------------------------------------------------------------

    async def _stay_alive(self) -> None:
        assert self._graphs is not None
        while True:
            try:
                await self._graphs.alive(self._liveness_s)
            except (RedisError, OSError) as e:
                log.warning("job executor liveness not renewed", error=str(e))
            await asyncio.sleep(self._heartbeat_s)

    async def _sweep(self) -> None:
        """Every liveness timeout: open graphs whose owner is gone and that nobody will
        continue are closed, their tasks cancelled (a prefill's KV would also go when its
        lease ends; the record would stay forever)."""
        while True:
            await asyncio.sleep(self._liveness_s)
            try:
                await self.sweep_once(time.time())
            except (RedisError, OSError) as e:
                log.warning("task graph sweep failed", error=str(e))

    async def sweep_once(self, now: float) -> int:
        assert self._graphs is not None
        closed = 0
        for graph_id in await self._graphs.open_ids():
            held = await self._graphs.get(graph_id)
            if held is None or not held.open:
                await self._graphs.forget(graph_id)
                continue
            if held.owner_alive or not abandoned(held.graph, now=now):
                continue
            epoch = await self._graphs.claim(graph_id, held.epoch)
            if epoch is None:
                continue
            stray = tuple(t for t in held.graph.tasks if t.state in MAY_RUN)
            graph = await self._undo(
                graph_id, held.graph, Continuation(None, stray), "abandoned past its deadline"
            )
            await self.step(Running(graph, epoch), msgspec.structs.replace(graph, finished=True))
            log.info("orphaned task graph closed", graph=graph_id, dead_owner=held.owner)
            closed += 1
        return closed
