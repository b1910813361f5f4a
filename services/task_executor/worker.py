"""One task executor (TE): a pre-warmed, model-agnostic process that wraps one engine once
the scaler assigns it a model, takes tasks, and streams tokens straight to the frontend.

The engine is synchronous. It is loaded, stepped and closed on one dedicated thread;
requests to add or abort are queued and applied by the engine loop between steps, so the
engine is only ever touched by one thread at a time. One thread, not asyncio's pool: each
thread that runs torch ops gets its own OpenMP team, and on a small host an idle team's
spinning threads steal cores from the team doing the forward."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

import msgspec

from services.task_executor.capacity import find_or_measure
from services.task_executor.engines.base import Engine, EngineOutput, EngineRequest, LoadReport
from services.task_executor.engines.capabilities import EngineFeatures, bind_features
from services.task_executor.engines.factory import (
    create_engine,
    engine_choice,
    preload,
    prewarm,
)
from services.task_executor.engines.process import EngineProcessDied
from services.task_executor.host_cache_watch import HostCacheWatch
from services.task_executor.kv_publisher import KvEventPublisher
from services.task_executor.weight_cache import relay
from services.views import queued_prompt_tokens, remember_model
from shared import heap
from shared.bus import Bus
from shared.clients import ClusterClient, Heartbeater
from shared.errors import (
    BadRequest,
    InstanceLost,
    Internal,
    MeshserveError,
    PeerUnreachable,
    Refused,
    Unavailable,
)
from shared.logging import get_logger
from shared.messages.cluster import JobShare, MemberDown, TEHeartbeat, TEState
from shared.messages.scaling import (
    ControlAck,
    Drain,
    InstanceCapacity,
    LoadModel,
    PreloadModel,
    UnloadModel,
)
from shared.messages.tasks import CancelTask, ChatTask, TaskAccepted, TaskProgress, TokenChunk
from shared.runner import Lifecycle, run_service
from shared.settings import Settings
from shared.store import Store
from shared.subjects import Subjects

if TYPE_CHECKING:
    from services.task_executor.weight_cache.store import Received

log = get_logger(__name__)


class EngineFactory(Protocol):
    def __call__(
        self,
        model: str,
        model_path: Path,
        settings: Settings,
        *,
        report: LoadReport,
        weights_from: str | None = None,
        received: Received | None = None,
    ) -> Engine: ...


_T = TypeVar("_T")

# Longest a stopping TE waits for the engine step in flight.
STEP_STOP_TIMEOUT_S = 30.0


@dataclasses.dataclass(slots=True)
class _Stream:
    """One placement of a task: its tokens go to reply_to. ``key`` is the attempt's (the
    frontend's placement); the engine knows it by engine_id, unique per placement on this TE,
    so tokens a cancelled copy still produces never reach a later copy of the same task."""

    request_id: str
    attempt: int
    key: str
    engine_id: str
    reply_to: str
    prompt_tokens: int
    prefill_tokens: int  # of those, the ones not expected in the prefix cache (queued work)
    je_id: str = ""  # the job executor that placed it (told when it prefilled and ended)
    placement: int = 0  # this TE's number for the placement (TaskAccepted.seq)
    seq: int = 0
    generated: int = 0
    accepted_at: float = 0.0  # time.monotonic()


class TaskExecutor:
    def __init__(
        self,
        *,
        settings: Settings,
        bus: Bus,
        te_id: str,
        pool_id: str,
        engine_factory: EngineFactory = create_engine,
        prewarm: Callable[[Settings], None] | None = prewarm,
        store: Store | None = None,
    ) -> None:
        """``prewarm``: what every load of this TE's engine would pay first (imports, kernel
        compiles), run on the engine thread as the TE starts; None: nothing."""
        self._settings = settings
        self._bus = bus
        self._store = store
        self._subjects = Subjects(settings.cluster)
        self.te_id = te_id
        self.pool_id = pool_id
        self._engine_factory = engine_factory
        self._prewarm_engine = prewarm
        self._engine_thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="engine"
        )
        self._life = Lifecycle(f"task_executor {te_id}")
        self.state = TEState.IDLE
        self.model: str | None = None
        self.engine: Engine | None = None
        self._features = EngineFeatures()  # of the engine loaded: what it can do beyond generating
        self._error: str | None = None
        self._failed_model: str | None = None
        self._generated_tokens = 0
        self._recent_models: list[str] = []  # loaded here before, newest first
        self._host_cache = HostCacheWatch(settings, pool_id, store)
        # Where this TE receives multicasts of a model's weights (with the host cache on).
        self._relay: socket.socket | None = None
        if settings.host_cache.bytes != 0:
            with contextlib.suppress(OSError):
                self._relay = relay.listen(f"{settings.host_cache.serve_host}:0")
        self._capacity: InstanceCapacity | None = None  # of the model loaded
        self._choice = engine_choice(settings)  # for any model; for the model loaded once one is
        self._load_steps: dict[str, float] = {}  # of the last load
        self._ready_at = 0.0
        self._streams: dict[str, _Stream] = {}  # by attempt key
        self._engine_streams: dict[str, _Stream] = {}  # the same, by engine id
        self._placements = 0
        # Tasks that prefilled or ended since the last notice, by the JE that placed them.
        self._progress: dict[str, TaskProgress] = {}
        self._progress_due = asyncio.Event()
        # Accepted, not yet handed to the engine (between iterations), by attempt key.
        self._adds: dict[str, EngineRequest] = {}
        self._aborts: set[str] = set()  # engine ids
        self._work = asyncio.Event()
        self._step_lock = asyncio.Lock()  # held while an iteration runs; unload waits for it
        self._closing = False
        self._kv = KvEventPublisher(
            te_id=te_id,
            bus=bus,
            subjects=self._subjects,
            store=store,
            cluster=settings.cluster,
            model=lambda: self.model,
        )
        self._idle = asyncio.Event()
        self._idle.set()
        self._last_active = time.time()
        self._started = time.time()
        self._hb = Heartbeater(
            ClusterClient(bus, self._subjects),
            self._heartbeat,
            settings.membership.heartbeat_interval.total_seconds(),
        )
        # The load or unload in progress (one at a time: each starts from its own state).
        self._control_task: asyncio.Task[None] | None = None
        self.ready = asyncio.Event()  # set once the TE listens for tasks and commands

    # -- observation -------------------------------------------------------------------

    def _heartbeat(self) -> TEHeartbeat:
        hb = TEHeartbeat(
            te_id=self.te_id,
            pool_id=self.pool_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            state=self.state,
            started_at=self._started,
            model=self.model,
            last_active=self._last_active,
            error=self._error,
            sent_at=time.time(),
            failed_model=self._failed_model,
            generated_tokens=self._generated_tokens,
            engine=self._choice.engine,
            engine_reason=self._choice.reason,
            recent_models=list(self._recent_models),
            load_steps=self._load_steps,
            ready_at=self._ready_at,
            weight_server=self._settings.host_cache.server,
            cached_weights=self._host_cache.state.models,
            cache_free_bytes=self._host_cache.state.free_bytes,
            weight_relay=self._settings.host_cache.relay,
            relay_address=relay.address_of(self._relay) if self._relay is not None else "",
        )
        if self.engine is not None:
            st = self.engine.stats()
            hb.device = self.engine.device
            hb.engine = self.engine.name
            hb.max_model_len = self.engine.max_model_len
            hb.engine_capabilities = self.engine.capabilities
            hb.running = st.running
            hb.waiting = st.waiting + len(self._adds)
            hb.free_kv_blocks = st.free_kv_blocks
            hb.total_kv_blocks = st.total_kv_blocks
            hb.capacity = self._capacity
            shares = self._shares()
            hb.queued_prompt_tokens = queued_prompt_tokens(shares)
            hb.shares = {je: share for je, share in shares.items() if je}
            hb.placements = self._placements
        return hb

    def _shares(self) -> dict[str, JobShare]:
        """The streams by the JE that placed them (``TEHeartbeat.shares``; "": tasks
        placed with no JE named)."""
        counts: dict[str, list[int]] = {}
        for stream in self._streams.values():
            c = counts.setdefault(stream.je_id, [0, 0, 0, stream.placement])
            c[0] += 1
            if stream.generated:
                c[1] += 1
            else:
                c[2] += stream.prefill_tokens
            c[3] = min(c[3], stream.placement)
        return {
            je: JobShare(sequences=n, decoding=d, prefill_tokens=t, oldest=o)
            for je, (n, d, t, o) in counts.items()
        }

    # -- lifecycle -----------------------------------------------------------------------

    async def run(self) -> None:
        await self._bus.subscribe(
            self._subjects.te_task(self.te_id),
            {ChatTask: self._on_task, CancelTask: self._on_cancel},
        )
        await self._bus.subscribe(
            self._subjects.te_control(self.te_id),
            {
                LoadModel: self._on_load,
                PreloadModel: self._on_preload,
                UnloadModel: self._on_unload,
                Drain: self._on_drain,
            },
        )
        await self._bus.subscribe(self._subjects.member_down(), {MemberDown: self._on_member_down})
        if self._prewarm_engine is not None:  # a load queued meanwhile waits its turn
            self._engine_thread.submit(self._prewarm, self._prewarm_engine)
        self._hb.start(self._life)
        loop_task = self._life.spawn(self._engine_loop(), name="engine loop")
        self._life.spawn(self._kv.run(), name="kv event publisher")
        self._life.spawn(self._progress_publisher(), name="task progress publisher")
        if self._settings.host_cache.bytes != 0:
            self._life.spawn(self._host_cache.run(), name="host cache watch")
        self.ready.set()
        try:
            await self._life.wait()
            self.state = TEState.DRAINING
            self._hb.beat_now()
            await self._drain(self._settings.membership.shutdown_grace.total_seconds())
        finally:
            # Let a step in flight finish (a thread cannot be interrupted) before the
            # engine is closed under it.
            self._closing = True
            self._work.set()
            _, pending = await asyncio.wait({loop_task}, timeout=STEP_STOP_TIMEOUT_S)
            if pending:
                log.error("engine step did not finish; closing anyway")
            if self._control_task is not None and not self._control_task.done():
                # An unload closing its engine, or a load that would leave one behind.
                await asyncio.wait({self._control_task}, timeout=STEP_STOP_TIMEOUT_S)
            await self._life.cancel_tasks()
            await ClusterClient(self._bus, self._subjects).leave(self.te_id)
            if self.engine is not None:
                self.engine.close()
            if self.model is not None:
                await self._kv.forget(self.model)
            if self._store is not None:
                await self._store.close()
            if self._relay is not None:
                self._relay.close()
            self._engine_thread.shutdown(wait=False)
            self._life.stopped()

    def _prewarm(self, prewarm: Callable[[Settings], None]) -> None:
        t = time.monotonic()
        try:
            prewarm(self._settings)
        except Exception:  # the first load pays for it instead
            log.exception("pre-warming the engine failed")
        else:
            log.info("engine pre-warmed", seconds=round(time.monotonic() - t, 2))

    async def shutdown(self) -> None:
        self._life.request_stop()

    def _on_engine_thread(self, fn: Callable[..., _T], *args: object) -> asyncio.Future[_T]:
        return asyncio.get_running_loop().run_in_executor(self._engine_thread, fn, *args)

    async def _drain(self, grace: float) -> None:
        """Let running requests finish within grace; hand the rest back for a retry."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), grace)
        for stream in list(self._streams.values()):
            self._aborts.add(stream.engine_id)
            await self._finish(stream, InstanceLost(f"task executor {self.te_id} is stopping"))
        self._work.set()

    # -- control -------------------------------------------------------------------------

    async def _on_load(self, cmd: LoadModel) -> ControlAck:
        if self.state != TEState.IDLE:
            return ControlAck(te_id=self.te_id, ok=False, error=f"TE is {self.state}, not idle")
        self.state, self.model = TEState.LOADING, cmd.model
        self._error = self._failed_model = None
        self._hb.beat_now()
        self._control_task = self._life.spawn(self._load(cmd), name="load", one_shot=True)
        return ControlAck(te_id=self.te_id, ok=True)

    async def _on_preload(self, cmd: PreloadModel) -> ControlAck:
        if self.state != TEState.IDLE:
            return ControlAck(te_id=self.te_id, ok=False, error=f"TE is {self.state}, not idle")
        self.state = TEState.PRELOADING
        self._hb.beat_now()
        self._control_task = self._life.spawn(self._preload(cmd), name="preload", one_shot=True)
        return ControlAck(te_id=self.te_id, ok=True)

    async def _preload(self, cmd: PreloadModel) -> None:
        t0 = time.monotonic()
        try:
            report = await self._on_engine_thread(
                functools.partial(
                    preload,
                    cmd.model,
                    Path(cmd.path),
                    self._settings,
                    weights_from=cmd.weights_from,
                )
            )
        except Exception:
            log.exception("preload failed", model=cmd.model)
        else:
            log.info(
                "model preloaded into the host cache",
                model=cmd.model,
                seconds=round(time.monotonic() - t0, 2),
                built=report.misses,
                already_there=report.hits,
                fetched=report.fetched,
            )
        self.state = TEState.IDLE
        await self._host_cache.read()  # report what the cache holds now
        self._hb.beat_now()

    async def _load(self, cmd: LoadModel) -> None:
        t0 = time.monotonic()
        steps: dict[str, float] = {}
        self._load_steps, self._ready_at = steps, 0.0
        try:
            engine, features, self._capacity = await self._on_engine_thread(
                self._build_engine, cmd, t0, steps
            )
        except Exception as e:
            log.exception("model load failed", model=cmd.model)
            self.state, self.model, self._error = TEState.IDLE, None, f"{type(e).__name__}: {e}"
            self._failed_model = cmd.model
        else:
            self.engine, self._features = engine, features
            self._kv.block_size = features.kv_events.block_size if features.kv_events else 0
            heap.settle()  # the model lives as long as it is loaded: out of the collector's way
            self.state = TEState.READY
            self._last_active = self._ready_at = time.time()
            self._recent_models = list(remember_model(self._recent_models, cmd.model))
            log.info(
                "model loaded",
                model=cmd.model,
                seconds=round(time.monotonic() - t0, 2),
                steps={k: round(v, 3) for k, v in steps.items()},
                device=engine.device,
            )
            self._work.set()  # the loop asks the new engine for work: none yet lets its
            # background work go (the torch engine's store of a first load's weights)
        self._hb.beat_now()

    def _build_engine(
        self, cmd: LoadModel, t0: float, steps: dict[str, float]
    ) -> tuple[Engine, EngineFeatures, InstanceCapacity | None]:
        """The engine; what it declares it can do checked against what it implements (a
        declaration it cannot keep fails the load, and the engine is closed); and its
        capacity, measured here when the scaler has none stored. ``steps``: DeepServe's
        TE-side steps of a scale-up, in seconds."""
        t1 = time.monotonic()
        steps["te_pre_load"] = t1 - t0  # the command's wait for the engine thread
        self._choice = engine_choice(self._settings, cmd.model, Path(cmd.path))
        report = LoadReport()
        received = self._receive_multicast(cmd, steps)
        engine = self._engine_factory(
            cmd.model,
            Path(cmd.path),
            self._settings,
            report=report,
            weights_from=cmd.weights_from,
            received=received,
        )
        t2 = time.monotonic()
        steps["te_load"] = t2 - t1
        steps.update({f"te_load_{name}": s for name, s in report.phases.items()})
        try:
            features = bind_features(engine)
            capacity = cmd.capacity or self._measure_capacity(engine, Path(cmd.path))
            if features.prefill_pacing is not None and capacity is not None:
                slo = self._settings.scaler.slo()
                features.prefill_pacing.pace_prefill(
                    capacity,
                    slo.tpot_s,
                    ttft_s=slo.ttft_s,
                    ttft_per_token_s=slo.ttft_per_input_token_s,
                )
        except Exception:
            engine.close()
            raise
        steps["te_post_load"] = time.monotonic() - t2
        return engine, features, capacity

    def _receive_multicast(self, cmd: LoadModel, steps: dict[str, float]) -> Received | None:
        """This load's part of a multicast of its model's weights (``cmd.multicast``); None
        where there is none, or it failed (logged: the load forks or reads instead)."""
        if cmd.multicast is None or self._relay is None:
            return None
        from services.task_executor.weight_cache.store import receive_multicast

        t = time.monotonic()
        try:
            received = receive_multicast(cmd.model, cmd.multicast, self._relay)
        except Exception as e:
            log.warning("multicast failed; forking instead", model=cmd.model, error=str(e))
            return None
        steps["te_load_multicast"] = time.monotonic() - t
        return received

    def _measure_capacity(self, engine: Engine, path: Path) -> InstanceCapacity | None:
        """The capacity stored with the model or on this host for its architecture and this
        engine, or measured now (and stored): ``capacity.find_or_measure``."""
        try:
            capacity, where = find_or_measure(engine, path, self._settings)
        except Exception:  # the scaler sizes the model by its queue alone until one is stored
            log.exception("measuring the instance's capacity failed")
            return None
        if where == "measured" and capacity is not None:
            log.info(
                "capacity measured on the load's critical path (`meshserve profile` stores it "
                "with the model beforehand)",
                **msgspec.structs.asdict(capacity),
            )
        return capacity

    async def _on_unload(self, cmd: UnloadModel) -> ControlAck:
        """Acknowledged at once, as a load is: draining takes up to the shutdown grace and
        closing an engine seconds (vLLM's), longer than a control request waits. Heartbeats
        show the TE DRAINING, then IDLE."""
        if self.state != TEState.READY:
            return ControlAck(te_id=self.te_id, ok=False, error=f"TE is {self.state}, not ready")
        self.state = TEState.DRAINING
        self._hb.beat_now()
        self._control_task = self._life.spawn(self._unload(cmd), name="unload", one_shot=True)
        return ControlAck(te_id=self.te_id, ok=True)

    async def _unload(self, cmd: UnloadModel) -> None:
        grace = self._settings.membership.shutdown_grace.total_seconds()
        await self._drain(grace if cmd.drain_s is None else cmd.drain_s)
        async with self._step_lock:
            engine, self.engine = self.engine, None
        if engine is not None:
            try:
                await self._on_engine_thread(engine.close)
            except Exception:  # gone either way: the TE takes the next model
                log.exception("closing the engine failed", model=self.model)
            self._kv.collect(self._features.kv_events)
            await self._kv.flush()
        if self.model is not None:
            await self._kv.forget(self.model)
        self._features = EngineFeatures()
        self._capacity = None
        self._choice = engine_choice(self._settings)
        heap.unsettle()  # the model's reference cycles, if any, go now
        heap.settle()
        log.info("model unloaded", model=self.model, reason=cmd.reason)
        self.state, self.model = TEState.IDLE, None
        self._hb.beat_now()

    async def _on_drain(self, _: Drain) -> ControlAck:
        self._life.request_stop()
        return ControlAck(te_id=self.te_id, ok=True)

    # -- tasks ---------------------------------------------------------------------------

    async def _on_task(self, task: ChatTask) -> TaskAccepted:
        if self.state != TEState.READY or self.engine is None or task.model != self.model:
            raise Refused(f"TE {self.te_id} does not serve {task.model} now ({self.state})")
        if time.time() > task.deadline:
            raise Refused("the task's deadline has passed")
        if task.mode not in self.engine.capabilities.modes:
            raise BadRequest(
                f"the {self.engine.name} engine of TE {self.te_id} cannot run a {task.mode} task "
                f"(it runs: {', '.join(sorted(self.engine.capabilities.modes))})",
                code="unsupported_task_mode",
            )
        n = len(task.prompt_token_ids)
        if n == 0:
            raise BadRequest("the prompt is empty", param="messages")
        if n >= self.engine.max_model_len:
            raise BadRequest(
                f"the prompt has {n} tokens; this model's context is {self.engine.max_model_len}",
                param="messages",
                code="context_length_exceeded",
            )
        if (known := self._streams.get(task.key)) is not None:
            # The same task again while it is still ours (a placement whose answer was lost
            # or late, retried): it is running or queued already.
            return TaskAccepted(
                request_id=task.request_id,
                te_id=self.te_id,
                attempt=task.attempt,
                seq=known.placement,
            )
        # A task placed again after a cancel (the JE cancels and retries when the TE answered
        # too late, e.g. while a long engine step held the GIL) replaces any copy still queued;
        # a copy already in the engine is aborted first (_apply_queued: aborts before adds).
        self._placements += 1
        stream = _Stream(
            request_id=task.request_id,
            attempt=task.attempt,
            key=task.key,
            engine_id=f"{task.key}@{self._placements}",
            reply_to=task.reply_to,
            prompt_tokens=n,
            prefill_tokens=n - min(max(task.matched_tokens, 0), n - 1),
            je_id=task.je_id,
            placement=self._placements,
            accepted_at=time.monotonic(),
        )
        self._streams[stream.key] = self._engine_streams[stream.engine_id] = stream
        self._adds[stream.key] = EngineRequest(
            stream.engine_id, task.prompt_token_ids, task.sampling
        )
        self._last_active = time.time()
        self._idle.clear()
        self._work.set()
        log.debug("task accepted", attempt=task.attempt, prompt_tokens=n)
        return TaskAccepted(
            request_id=task.request_id, te_id=self.te_id, attempt=task.attempt, seq=stream.placement
        )

    async def _on_cancel(self, msg: CancelTask) -> None:
        if (stream := self._close_stream(msg.key)) is not None:
            log.debug("task cancelled", attempt=msg.attempt, generated=stream.generated)
            if self._adds.pop(msg.key, None) is None:  # not queued: in the engine
                self._aborts.add(stream.engine_id)
            self._work.set()

    async def _on_member_down(self, msg: MemberDown) -> None:
        """A frontend is gone: nobody reads the tokens of its requests any more, so their
        generations stop here instead of running to max_tokens. (A request whose frontend
        only lost its bus moves with the tokens it has, wherever it goes next.)"""
        orphans = [
            s for s in self._streams.values() if Subjects.owner_of(s.reply_to) == msg.member_id
        ]
        for s in orphans:
            await self._on_cancel(CancelTask(request_id=s.request_id, attempt=s.attempt))
        if orphans:
            log.info(
                "generations stopped: their frontend is gone",
                frontend=msg.member_id,
                n=len(orphans),
            )

    def _close_stream(self, key: str) -> _Stream | None:
        stream = self._streams.pop(key, None)
        if stream is not None:
            del self._engine_streams[stream.engine_id]
            self._progress_of(stream).ended.append(stream.key)
        return stream

    def _progress_of(self, stream: _Stream) -> TaskProgress:
        """The notice its JE gets next (``_progress_publisher``)."""
        note = self._progress.get(stream.je_id)
        if note is None:
            note = self._progress[stream.je_id] = TaskProgress(te_id=self.te_id)
        self._progress_due.set()
        return note

    async def _progress_publisher(self) -> None:
        """Notices leave as soon as the loop is free, one per JE for all that happened
        meanwhile (an iteration's tokens, a cancel)."""
        while True:
            await self._progress_due.wait()
            self._progress_due.clear()
            notes, self._progress = self._progress, {}
            for je_id, note in notes.items():
                if not je_id:  # placed by a JE that does not count (none in service)
                    continue
                try:
                    await self._bus.publish(self._subjects.task_progress(je_id), note)
                except PeerUnreachable as e:  # its heartbeat share corrects the count
                    log.warning("task progress publish failed", je=je_id, error=str(e))

    async def _engine_loop(self) -> None:
        while not self._closing:
            await self._work.wait()
            self._work.clear()
            # An iteration's tokens are published while the next iteration runs on the
            # engine thread (in order: each publish waits for the previous one).
            emitting: asyncio.Task[None] | None = None
            while not self._closing and (engine := self.engine) is not None:
                try:
                    # The whole iteration holds the lock: an unload waits for it to end
                    # rather than closing the engine under a running step.
                    async with self._step_lock:
                        if self.engine is not engine:
                            break
                        await self._apply_queued(engine)
                        if not engine.has_work():
                            break
                        outputs = await self._on_engine_thread(engine.step)
                        self._kv.collect(self._features.kv_events)
                    previous, emitting = emitting, None
                    if previous is not None:
                        await previous
                    emitting = asyncio.create_task(self._emit(outputs))
                except Exception as e:
                    streams = list(self._streams.values())
                    log.exception(
                        "engine iteration failed", request_ids=[s.request_id for s in streams]
                    )
                    await _settle(emitting)  # the last good tokens go out first
                    emitting = None
                    failure = engine_failure(e, self.te_id)
                    for stream in streams:
                        with contextlib.suppress(Exception):
                            engine.abort(stream.engine_id)
                        await self._finish(stream, failure)
                    if isinstance(e, EngineProcessDied):
                        await self._lose_engine(engine, e)
                    break
            await _settle(emitting)
            if not self._streams:
                self._idle.set()

    async def _lose_engine(self, engine: Engine, e: Exception) -> None:
        """The engine's process died: this TE serves nothing until the scaler loads a model
        again (the heartbeat reports the failure, as for a failed load)."""
        async with self._step_lock:
            if self.engine is not engine:
                return
            self.engine, self._features = None, EngineFeatures()
        with contextlib.suppress(Exception):
            engine.close()
        log.error("engine process died; model unloaded", model=self.model, error=str(e))
        self._failed_model, self._error = self.model, f"{type(e).__name__}: {e}"
        self.state, self.model = TEState.IDLE, None
        self._hb.beat_now()

    async def _apply_queued(self, engine: Engine) -> None:
        for engine_id in self._aborts:
            engine.abort(engine_id)
        self._aborts.clear()
        adds, self._adds = self._adds, {}
        for req in adds.values():
            stream = self._engine_streams.get(req.request_id)
            if stream is None:
                continue  # cancelled before it started
            try:
                engine.add_request(req)
            except ValueError as e:  # a prompt this engine can never serve
                await self._finish(stream, BadRequest(str(e), param="messages"))

    async def _emit(self, outputs: Sequence[EngineOutput]) -> None:
        if outputs:
            self._last_active = time.time()
        for out in outputs:
            stream = self._engine_streams.get(out.request_id)
            if stream is None:
                continue  # cancelled (the task may run again as another copy: not this one)
            if not stream.generated and out.new_token_ids:
                if self._ready_at:
                    # The first task's first token after a load: the end of the scale-up.
                    first = time.monotonic() - stream.accepted_at
                    self._load_steps.setdefault("te_first_token", first)
                if not out.finished:
                    self._progress_of(stream).prefilled.append(stream.key)
            stream.generated += len(out.new_token_ids)
            self._generated_tokens += len(out.new_token_ids)
            chunk = TokenChunk(
                request_id=stream.request_id,
                attempt=stream.attempt,
                seq=stream.seq,
                token_ids=out.new_token_ids,
                finish_reason=out.finish_reason if out.finished else None,
                prompt_tokens=stream.prompt_tokens,
                completion_tokens=stream.generated,
                cached_tokens=out.num_cached_tokens,
                te_id=self.te_id,
                te_s=0.0 if stream.seq else time.monotonic() - stream.accepted_at,
            )
            stream.seq += 1
            if out.finished:
                self._close_stream(stream.key)
                log.debug(
                    "task finished",
                    request_id=stream.request_id,
                    attempt=stream.attempt,
                    reason=out.finish_reason,
                    generated=stream.generated,
                )
            try:
                await self._bus.publish(stream.reply_to, chunk, request_id=stream.request_id)
            except PeerUnreachable as e:
                log.warning("token publish failed", request_id=stream.request_id, error=str(e))

    async def _finish(self, stream: _Stream, failure: MeshserveError) -> None:
        """End a stream with an error: a retryable one sends the request elsewhere."""
        if self._close_stream(stream.key) is None:
            return
        log.info(
            "task ended early",
            request_id=stream.request_id,
            attempt=stream.attempt,
            failure=type(failure).__name__,
            error=failure.message,
        )
        chunk = TokenChunk(
            request_id=stream.request_id,
            attempt=stream.attempt,
            seq=stream.seq,
            token_ids=[],
            finish_reason="error",
            prompt_tokens=stream.prompt_tokens,
            completion_tokens=stream.generated,
            error=failure.message,
            te_id=self.te_id,
            failure=failure.to_reply(),
        )
        with contextlib.suppress(PeerUnreachable):
            await self._bus.publish(stream.reply_to, chunk, request_id=stream.request_id)


def engine_failure(e: Exception, te_id: str) -> MeshserveError:
    """What a failed engine iteration means for its requests: a dead engine process is the
    instance lost (they continue on another TE); an error inside the engine is not retried
    (the same request would likely fail the next engine too)."""
    if isinstance(e, EngineProcessDied):
        return InstanceLost(f"the engine process of TE {te_id} died: {e}")
    return Internal(f"engine failure: {type(e).__name__}: {e}")


async def _settle(task: asyncio.Task[None] | None) -> None:
    """Wait for a publishing task; its failure is logged, not raised (the engine loop goes on)."""
    if task is None:
        return
    try:
        await task
    except Exception:
        log.exception("publishing tokens failed")


def main() -> None:
    te_id, pool_id = sys.argv[1], sys.argv[2]
    settings = Settings.load()

    async def factory(settings: Settings, bus: Bus) -> TaskExecutor:
        try:
            store = await Store.connect(settings.redis_url) if settings.redis_url else None
        except Unavailable as e:  # it serves; routing learns its cache from its events alone
            log.warning("prompt index entries not stored", error=e.message)
            store = None
        return TaskExecutor(settings=settings, bus=bus, te_id=te_id, pool_id=pool_id, store=store)

    run_service(f"task_executor.{te_id}", factory, settings)


if __name__ == "__main__":
    main()
