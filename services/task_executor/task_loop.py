"""A TE's tasks: take them (checked against the model and engine it serves now), feed them
to the engine between iterations, run the iterations, and stream each iteration's tokens
straight to the frontend while the next one runs; tell the job executor that placed a task
when it prefilled and when it ended (``TaskProgress``); cancel a task, or every task of a
frontend that is gone; end what is left with a retryable error when the TE drains.

With PD disaggregation (``disaggregation``), a prefill task streams its prompt's KV to the
decode TE that pulls it and sends no tokens; a decode task first pulls its prompt's KV, then
streams tokens like any other, the prefill TE's first token first."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec
from opentelemetry import context as otel_context

from services.task_executor import task_spans
from services.task_executor.device_arbiter import Instance, NoKvRoom, TurnClient
from services.task_executor.disaggregation import PrefillSide, prefill_request, pull_prompt
from services.task_executor.engine_thread import EngineThread
from services.task_executor.engines.base import Engine, EngineOutput, EngineRequest
from services.task_executor.engines.capabilities import LoraServing
from services.task_executor.engines.factory import kv_floor_bytes
from services.task_executor.engines.process import EngineProcessDied
from services.task_executor.engines.torch_engine.kv_transfer import KvExport
from services.task_executor.kv_pool import KvPool
from services.task_executor.kv_publisher import KvEventPublisher
from services.task_executor.kv_transport.client import TransferFailed
from services.task_executor.kv_transport.outbox import Outbox
from services.task_executor.model_control import ModelControl
from shared import tracing
from shared.bus import Bus
from shared.errors import (
    DEVICE_BUSY,
    BadRequest,
    InstanceLost,
    Internal,
    KvTransferFailed,
    MeshserveError,
    PeerUnreachable,
    Refused,
)
from shared.headroom import RequestView, Urgency, earliest_deadline, request_view, urgency
from shared.logging import get_logger
from shared.messages.api import ErrorReply
from shared.messages.cluster import JobShare, MemberDown, TEState
from shared.messages.scaling import ControlAck, LoadModel, UnloadModel
from shared.messages.tasks import (
    CancelTask,
    ChatTask,
    KvTransferNote,
    TaskAccepted,
    TaskMode,
    TaskProgress,
    TokenChunk,
)
from shared.perf_model import PerfModel
from shared.settings import Settings, TaskExecutorSettings
from shared.subjects import Subjects

log = get_logger(__name__)


def books_device(te: TaskExecutorSettings) -> str:
    """The device a TE names to its pool's arbiter for the KV books (the pool's one device)
    before an engine says which it runs on: the pool's, as the torch engine (the one whose
    KV pool resizes) will name it (``auto``: a GPU where there is one; ``cuda``: its
    index)."""
    from services.task_executor.engines.torch_engine.build import resolve_device

    return str(resolve_device(te.device))


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
    # a decode task's (PD): the prompt tokens whose KV it takes in, until the engine has it
    import_tokens: int = 0
    je_id: str = ""  # the job executor that placed it (told when it prefilled and ended)
    placement: int = 0  # this TE's number for the placement (TaskAccepted.seq)
    seq: int = 0
    generated: int = 0
    accepted_at: float = 0.0  # time.monotonic()
    mode: TaskMode = TaskMode.COLOCATED
    prompt: Sequence[int] = ()  # a prefill task's (its KV's tokens are the prompt and more)
    outbox: Outbox | None = None  # a prefill task's KV, offered to its decode TE
    head: list[int] = dataclasses.field(default_factory=list)  # a decode task's first tokens
    kv_note: KvTransferNote | None = None  # a decode task's: how its prompt's KV came
    # Traced: the placement's context (its spans' parent), and when the engine took it and
    # its first token came (time.monotonic()).
    trace: otel_context.Context | None = None
    model: str = ""
    started_at: float = 0.0
    first_token_at: float = 0.0
    kv_window: tuple[float, float] | None = None  # a decode task's pull: began, ended
    arrival: float = 0.0  # when the request reached its frontend, on this TE's clock
    max_tokens: int = 0  # the tokens it may generate


@dataclasses.dataclass(frozen=True, slots=True)
class _Import:
    """A decode task whose prompt's KV arrived: the engine continues from it."""

    request: EngineRequest
    export: KvExport


@dataclasses.dataclass(frozen=True, slots=True)
class _Prefill:
    """A prefill task: its prompt's KV streams into the outbox as it is computed."""

    request: EngineRequest
    outbox: Outbox


class TaskLoop:
    def __init__(
        self,
        *,
        te_id: str,
        bus: Bus,
        subjects: Subjects,
        control: ModelControl,
        thread: EngineThread,
        kv: KvEventPublisher,
        step_lock: asyncio.Lock,
        settings: Settings,
    ) -> None:
        self._te_id = te_id
        self._settings = settings
        self.prefill = PrefillSide(settings, self._on_kv_end)
        self._pulls: dict[str, asyncio.Task[None]] = {}  # decode tasks' pulls, by key
        self._bus = bus
        self._subjects = subjects
        self._control = control
        self._thread = thread
        self._adapter_paths: dict[str, str] = {}  # LoRA adapters requests named: their files
        self._kv = kv
        self._step_lock = step_lock  # held while an iteration runs; an unload waits for it
        self._streams: dict[str, _Stream] = {}  # by attempt key
        self._kv_pool: KvPool | None = None  # its KV pool sized by demand (MESHSERVE_KV_SIZING)
        self._engine_streams: dict[str, _Stream] = {}  # the same, by engine id
        self.placements = 0
        self.generated_tokens = 0
        self.kv_pulled_bytes = 0  # prompt KV pulled from prefill TEs (decode tasks)
        self.kv_fallbacks = 0  # decode tasks whose KV did not arrive
        self.last_active = time.time()
        # Tasks that prefilled or ended since the last notice, by the JE that placed them.
        self._progress: dict[str, TaskProgress] = {}
        self._progress_due = asyncio.Event()
        # Accepted, not yet handed to the engine (between iterations), by attempt key.
        self._adds: dict[str, EngineRequest | _Import | _Prefill] = {}
        self._aborts: set[str] = set()  # engine ids
        self._work = asyncio.Event()
        self._closing = False
        self._idle = asyncio.Event()
        self._idle.set()
        # Turns on the device this pool's TEs share (device_arbiter.py; or an arbiter that
        # only observes, granting every turn at once); each iteration asks with the most
        # urgent deadline among this TE's requests.
        self._turns = TurnClient(settings.task_executor.device_arbiter, te_id)
        self._turns.on_squeeze = self._squeezed
        self._squeezing: asyncio.Task[None] | None = None
        self._preempting: asyncio.Task[ControlAck] | None = None
        # Preempted: where each request validated (request key -> TE id), said as it is
        # handed back.
        self._moves: dict[str, str] = {}
        self._announcing: asyncio.Task[None] | None = None
        # Told to shrink, and held back by blocks in use: it goes on shrinking at once.
        self._squeeze_left = False
        self._reserved = False  # room in the device's books for a load's KV, not yet held
        self.kv_floor_bytes = 0  # the floor of the loading or loaded model's pool in the books
        self._slo = settings.scaler.slo()
        self._turns.on_preempt = self._preempted
        # Shadow validation of each colocated task on the device before it is taken; for it,
        # and for other pools validating a preempted neighbour's requests here, the arbiter
        # hears what this TE serves and the requests it holds.
        te = settings.task_executor
        self._shadow = te.shadow_admission and self._turns.active
        self._views = (te.shadow_admission or te.kv_preemption) and self._turns.active
        self._told_perf: PerfModel | None = None

    # -- observation -------------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Accepted, not yet handed to the engine."""
        return len(self._adds)

    def kv_offers(self) -> list[str]:
        """The prefill tasks whose KV this TE holds for a decode TE (keys)."""
        return [s.key for s in self._streams.values() if s.outbox is not None]

    def shares(self) -> dict[str, JobShare]:
        """The streams by the JE that placed them (``TEHeartbeat.shares``; "": tasks
        placed with no JE named)."""
        counts: dict[str, list[int]] = {}
        for stream in self._streams.values():
            c = counts.setdefault(stream.je_id, [0, 0, 0, 0, stream.placement])
            c[0] += 1
            if stream.generated:
                c[1] += 1
            else:
                c[2] += stream.prefill_tokens
                c[3] += stream.import_tokens
            c[4] = min(c[4], stream.placement)
        return {
            je: JobShare(sequences=n, decoding=d, prefill_tokens=t, import_tokens=i, oldest=o)
            for je, (n, d, t, i, o) in counts.items()
        }

    def wake(self) -> None:
        """Ask the engine for work now (a new engine: none yet lets its background work go,
        e.g. the torch engine's store of a first load's weights)."""
        self.last_active = time.time()
        self._work.set()

    def stop(self) -> None:
        """End the loop after the step in flight (``run`` returns)."""
        self._closing = True
        self._work.set()

    async def drain(self, grace: float) -> None:
        """Let running tasks finish within grace; hand the rest back for a retry."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), grace)
        for pull in list(self._pulls.values()):
            pull.cancel()
        for stream in list(self._streams.values()):
            self._aborts.add(stream.engine_id)
            await self._finish(stream, InstanceLost(f"task executor {self._te_id} is stopping"))
        self._moves = {}  # those of requests that ended meanwhile
        self._work.set()

    # -- intake --------------------------------------------------------------------------

    async def on_task(self, task: ChatTask) -> TaskAccepted:
        control, engine = self._control, self._control.engine
        if control.state != TEState.READY or engine is None or task.model != control.model:
            raise Refused(f"TE {self._te_id} does not serve {task.model} now ({control.state})")
        if time.time() > task.deadline:
            raise Refused("the task's deadline has passed")
        if task.mode not in engine.capabilities.modes:
            raise BadRequest(
                f"the {engine.name} engine of TE {self._te_id} cannot run a {task.mode} task "
                f"(it runs: {', '.join(sorted(engine.capabilities.modes))})",
                code="unsupported_task_mode",
            )
        if (task.mode == TaskMode.PREFILL) != (control.role == TaskMode.PREFILL):
            raise Refused(f"TE {self._te_id} serves {task.model} as {control.role}")
        if task.mode == TaskMode.DECODE and task.kv_source is None:
            raise BadRequest("a decode task names no prefill TE to pull its KV from")
        if task.adapter and (control.features.lora is None or task.mode != TaskMode.COLOCATED):
            raise BadRequest(
                f"the {engine.name} engine of TE {self._te_id} cannot run a {task.mode} task "
                "under a LoRA adapter",
                code="unsupported_adapter",
            )
        n = len(task.prompt_token_ids)
        if n == 0:
            raise BadRequest("the prompt is empty", param="messages")
        if n >= engine.max_model_len:
            raise BadRequest(
                f"the prompt has {n} tokens; this model's context is {engine.max_model_len}",
                param="messages",
                code="context_length_exceeded",
            )
        if (known := self._streams.get(task.key)) is not None:
            # The same task again while it is still ours (a placement whose answer was lost
            # or late, retried): it is running or queued already.
            return self._accepted(task, known)
        if self._shadow and task.mode == TaskMode.COLOCATED:
            await self._admit(task, engine)
            if (known := self._streams.get(task.key)) is not None:  # taken meanwhile
                return self._accepted(task, known)
        # A task placed again after a cancel (the JE cancels and retries when the TE answered
        # too late, e.g. while a long engine step held the GIL) replaces any copy still queued;
        # a copy already in the engine is aborted first (_apply_queued: aborts before adds).
        self.placements += 1
        uncached = n - min(max(task.matched_tokens, 0), n - 1)
        stream = _Stream(
            request_id=task.request_id,
            attempt=task.attempt,
            key=task.key,
            engine_id=f"{task.key}@{self.placements}",
            reply_to=task.reply_to,
            prompt_tokens=n,
            # a decode task's prompt is computed elsewhere, its KV comes in
            prefill_tokens=0 if task.mode == TaskMode.DECODE else uncached,
            import_tokens=uncached if task.mode == TaskMode.DECODE else 0,
            je_id=task.je_id,
            placement=self.placements,
            accepted_at=time.monotonic(),
            arrival=time.monotonic() - task.age_s,
            max_tokens=task.sampling.max_tokens,
            mode=task.mode,
            trace=tracing.current(),
            model=task.model,
        )
        self._streams[stream.key] = self._engine_streams[stream.engine_id] = stream
        request = EngineRequest(
            stream.engine_id,
            task.prompt_token_ids,
            task.sampling,
            adapter=task.adapter,
            arrival=stream.arrival,
        )
        if task.adapter:
            self._adapter_paths[task.adapter] = task.adapter_path
        if task.mode == TaskMode.PREFILL and (exporter := control.features.kv_export):
            stream.prompt = task.prompt_token_ids
            stream.outbox = self.prefill.offer(stream.key, exporter, n)
            self._adds[stream.key] = _Prefill(prefill_request(request), stream.outbox)
        elif task.mode == TaskMode.DECODE:
            self._pulls[stream.key] = asyncio.create_task(self._pull(stream, task, request))
        else:
            self._adds[stream.key] = request
        self.last_active = time.time()
        self._idle.clear()
        self._work.set()
        log.debug("task accepted", attempt=task.attempt, prompt_tokens=n)
        return self._accepted(task, stream)

    def _accepted(self, task: ChatTask, stream: _Stream) -> TaskAccepted:
        return TaskAccepted(
            request_id=task.request_id,
            te_id=self._te_id,
            attempt=task.attempt,
            seq=stream.placement,
        )

    async def on_cancel(self, msg: CancelTask) -> None:
        if (known := self._streams.get(msg.key)) is not None and known.mode == TaskMode.PREFILL:
            self.prefill.withdraw(msg.key, "cancelled")  # its KV goes (_on_kv_end)
            return
        if (pull := self._pulls.pop(msg.key, None)) is not None:
            pull.cancel()  # the connection drops: the prefill TE frees the KV
        if (stream := self._close_stream(msg.key)) is not None:
            log.debug("task cancelled", attempt=msg.attempt, generated=stream.generated)
            if self._adds.pop(msg.key, None) is None:  # not queued: in the engine
                self._aborts.add(stream.engine_id)
            self._work.set()

    async def on_member_down(self, msg: MemberDown) -> None:
        """A frontend is gone: nobody reads the tokens of its requests any more, so their
        generations stop here instead of running to max_tokens. (A request whose frontend
        only lost its bus moves with the tokens it has, wherever it goes next.)"""
        orphans = [
            s for s in self._streams.values() if Subjects.owner_of(s.reply_to) == msg.member_id
        ]
        for s in orphans:
            await self.on_cancel(CancelTask(request_id=s.request_id, attempt=s.attempt))
        if orphans:
            log.info(
                "generations stopped: their frontend is gone",
                frontend=msg.member_id,
                n=len(orphans),
            )

    def _close_stream(
        self, key: str, *, finished: bool = False, reason: str | None = None
    ) -> _Stream | None:
        """``finished``: it ran to its end (``reason``: stop or length), with ``generated``
        tokens."""
        stream = self._streams.pop(key, None)
        if stream is not None and stream.trace is not None:
            task_spans.record(
                stream.trace,
                model=stream.model,
                request_id=stream.request_id,
                accepted=stream.accepted_at,
                started=stream.started_at,
                first_token=stream.first_token_at,
                ended=time.monotonic(),
                prompt_tokens=stream.prompt_tokens,
                output_tokens=stream.generated,
                finish_reason=reason if finished else None,
                kv=stream.kv_note,
                kv_window=stream.kv_window,
            )
        if stream is not None:
            del self._engine_streams[stream.engine_id]
            progress = self._progress_of(stream)
            progress.ended.append(stream.key)
            if finished:
                progress.outputs[stream.key] = stream.generated
                if self._kv_pool is not None:
                    self._kv_pool.finished(stream.generated)
        return stream

    def _progress_of(self, stream: _Stream) -> TaskProgress:
        """The notice its JE gets next (``run_progress``)."""
        note = self._progress.get(stream.je_id)
        if note is None:
            note = self._progress[stream.je_id] = TaskProgress(te_id=self._te_id)
        self._progress_due.set()
        return note

    async def run_progress(self) -> None:
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

    # -- the engine loop -----------------------------------------------------------------

    @property
    def _budgeted(self) -> bool:
        """Whether its KV pool is kept in the device's books (``MESHSERVE_DEVICE_KV_BYTES``)."""
        te = self._settings.task_executor
        return te.kv_sizing and te.device_kv_bytes > 0 and self._turns.active

    def device_kv_free(self) -> int | None:
        """What the device's books have not given any pool (``TEHeartbeat
        .device_kv_free_bytes``), for the scaler's placement of a load; None without books."""
        free = self._turns.kv_device_free
        return int(free) if self._budgeted and math.isfinite(free) else None

    async def run(self) -> None:
        if self._budgeted:  # an idle TE hears the books too (the scaler places loads by them)
            await self._turns.announce(books_device(self._settings.task_executor))
        while not self._closing:
            try:  # an idle TE still looks at its KV pool now and then (it shrinks lazily)
                tick = self._kv_pool.idle_tick_s if self._kv_pool is not None else None
                await asyncio.wait_for(self._work.wait(), tick)
            except TimeoutError:
                async with self._step_lock:
                    if (engine := self._control.engine) is not None:
                        await self._size_kv(engine)
                    else:
                        self.engine_changed()
                continue
            self._work.clear()
            # An iteration's tokens are published while the next iteration runs on the
            # engine thread (in order: each publish waits for the previous one).
            emitting: asyncio.Task[None] | None = None
            while not self._closing and (engine := self._control.engine) is not None:
                try:
                    # The whole iteration holds the lock: an unload waits for it to end
                    # rather than closing the engine under a running step.
                    async with self._step_lock:
                        if self._control.engine is not engine:
                            break
                        await self._apply_queued(engine)
                        if not engine.has_work():
                            break
                        if self._views:
                            self._sync_instance(engine)
                        async with self._turns.turn(
                            self._urgency(),
                            engine.device,
                            self._request_views() if self._views else None,
                        ):
                            outputs = await self._thread.run(engine.step)
                        self._kv.collect(self._control.features.kv_events)
                        await self._size_kv(engine)
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
                    failure = engine_failure(e, self._te_id)
                    for stream in streams:
                        with contextlib.suppress(Exception):
                            engine.abort(stream.engine_id)
                        await self._finish(stream, failure)
                    if isinstance(e, EngineProcessDied):
                        await self._control.lose(engine, e)
                    break
            await _settle(emitting)
            if self._views:  # what it holds now that it waits for work
                self._turns.requests(self._request_views())
            if not self._streams:
                self._idle.set()
        self._turns.close()

    async def _size_kv(self, engine: Engine) -> None:
        """The KV pool sized by what the TE holds (``kv_pool``), where the setting is on and
        the engine can; with the step lock held. Under a device KV budget, a grow goes only
        into the room the device arbiter grants, and asks for the rest."""
        te = self._settings.task_executor
        resizer = self._control.features.kv_resize
        if not te.kv_sizing or resizer is None:
            self._kv_pool = None
            return
        budgeted = self._budgeted
        squeeze = self._turns.take_squeeze() or self._squeeze_left
        loaded = False  # a model just loaded: its pool enters the device's books
        if self._kv_pool is None or self._kv_pool.engine is not resizer:
            self._kv_pool = KvPool(
                resizer,
                max_model_len=engine.max_model_len,
                shrink_after_s=te.kv_shrink_after.total_seconds(),
            )
            loaded = budgeted
        pool = self._kv_pool
        held = ((s.prompt_tokens, s.max_tokens) for s in self._streams.values())
        # A load's pool is first shrunk to its demand, then held: the books never count the
        # size its engine allocated by default, and a grow beyond it asks for room like any.
        room = 0.0 if loaded else self._turns.kv_room if budgeted else math.inf
        plan = pool.plan(held, time.monotonic(), room_bytes=room, squeeze=squeeze or loaded)
        before = blocks = resizer.kv_blocks[0]
        if plan.blocks is not None:
            blocks = await self._thread.run(pool.resize, plan.blocks)
        # Told to shrink and held back by blocks in use, it shrinks again after each iteration
        # as its requests end, and tells the arbiter only a size that changed: the same size
        # again would have it told to shrink again at once, a ping-pong while a grow waits.
        self._squeeze_left = squeeze and plan.blocks is not None and blocks > plan.blocks
        if budgeted and (blocks != before or loaded):
            self._turns.kv_hold(blocks * resizer.kv_block_bytes)
            self._reserved = False
        if budgeted and plan.need_bytes is not None:
            self._turns.kv_need(plan.need_bytes, self._earliest_deadline())
        elif budgeted:
            self._turns.kv_enough()

    def kv_growable_blocks(self) -> int:
        """Blocks its KV pool, sized by demand, could still grow by: up to what its engine
        allocated, as far as the device's books have room (``TEHeartbeat.growable_kv_blocks``:
        a pool at its floor is not a full one). Every TE of the device reports the same free
        memory, so a router may count it more than once; the books still hold (each grow
        asks for its room), and what does not fit waits or is preempted."""
        resizer = self._control.features.kv_resize
        if self._kv_pool is None or resizer is None:
            return 0
        current, most = resizer.kv_blocks
        free = self._turns.kv_device_free  # inf without a device budget
        if math.isfinite(free):
            most = min(most, current + int(free // resizer.kv_block_bytes))
        return max(0, most - current)

    def engine_changed(self) -> None:
        """The model control's state moved. An engine gone (unloaded and closed, or its
        process lost) gives its KV pool back to the device's books at once: another TE's grow
        (or the next model's load) need not wait for memory nothing holds any more; not while
        it drains or closes (its memory is still in use). A new engine sizes its pool at once,
        so the books count it before its first request."""
        control = self._control
        if control.engine is None:
            if self._told_perf is not None:
                self._told_perf = None  # it serves nothing: no instance for the device's plays
                self._turns.serving(None)
            if self._kv_pool is not None and control.state != TEState.DRAINING:
                self._kv_pool = None
                if self._budgeted:
                    self._turns.kv_hold(0)
            elif self._reserved and control.state == TEState.IDLE:  # the load failed
                self._reserved = False
                self._turns.kv_hold(0)
            if control.state == TEState.IDLE:
                self.kv_floor_bytes = 0
        else:
            if self._views and control.perf is not self._told_perf:
                # Other pools' plays see the instance before its first request.
                self._sync_instance(control.engine)
                self._announcing = asyncio.get_running_loop().create_task(
                    self._turns.announce(control.engine.device)
                )
            if self._kv_pool is None and self._settings.task_executor.kv_sizing:
                self._squeezed()  # sizes the pool now, whether idle or not

    async def reserve_kv(self, cmd: LoadModel) -> None:
        """Before a model loads (``ModelControl``'s ``before_load``), where KV pools are sized
        by demand under a device budget: room in the device's books for the new pool's
        floor (``factory.kv_floor_bytes``), the device's other TEs told to shrink to their
        demand while it waits, for up to ``MESHSERVE_KV_ROOM_WAIT``; ``NoKvRoom`` (the load
        fails, and says why) when none came. A load that fails later gives the room back
        (``engine_changed``); one that succeeds holds its pool in its place."""
        te = self._settings.task_executor
        if not self._budgeted:
            return
        floor = kv_floor_bytes(cmd.model, Path(cmd.path), self._settings)
        if floor is None:  # an engine that cannot resize its KV: it keeps no books
            return
        wait_s = te.kv_room_wait.total_seconds()
        self._reserved = True
        self.kv_floor_bytes = floor
        device = books_device(te)
        if not await self._turns.kv_reserve(floor, device, time.monotonic(), wait_s):
            self._reserved = False
            raise NoKvRoom(
                f"no room on the device for {cmd.model}'s KV ({floor} bytes, its floor) "
                f"within {wait_s:g} s: the device's TEs hold the rest of "
                f"MESHSERVE_DEVICE_KV_BYTES={te.device_kv_bytes}"
            )

    def _preempted(self, moves: dict[str, str]) -> None:
        """The device arbiter preempts this TE (``DeviceArbiter.preempt_blocked``): a
        neighbour's KV pool cannot grow, and each of this TE's requests validated on another
        device (``moves``: request key -> that device's TE). It hands them back at once, each
        naming its TE (``TokenChunk.move_to``: its frontend resubmits it from the tokens it
        had, so greedy output is unchanged, and its job executor places it there first), and
        unloads; its KV then goes to the grow."""
        control = self._control
        if control.state != TEState.READY:
            return
        self._moves = moves
        log.info("preempted by the device arbiter: handing requests back", model=control.model)
        self._preempting = asyncio.get_running_loop().create_task(
            control.on_unload(UnloadModel(reason="preempted for a neighbour's KV", drain_s=0.0))
        )

    def _squeezed(self) -> None:
        """The device arbiter asks this TE's KV pool to shrink to its demand (another waits
        for room): at once, even while idle."""
        if self._squeezing is None or self._squeezing.done():
            self._squeezing = asyncio.get_running_loop().create_task(self._resize_now())

    async def _resize_now(self) -> None:
        async with self._step_lock:
            if (engine := self._control.engine) is not None:
                await self._size_kv(engine)

    async def _admit(self, task: ChatTask, engine: Engine) -> None:
        """Shadow validation on the device (``device_arbiter``): Refused when the task would
        be late, push another request on the device past its deadline, or stretch a decode
        round past the TPOT; the job executor then tries another instance."""
        self._sync_instance(engine)
        n = len(task.prompt_token_ids)
        new = request_view(
            self._slo,
            arrival=time.monotonic() - task.age_s,
            prompt_tokens=n,
            expected_output=task.sampling.max_tokens,
            computed_tokens=min(max(task.matched_tokens, 0), n - 1),
            id=task.key,
        )
        verdict = await self._turns.check(new, engine.device)
        if not verdict.ok:
            what = {
                "late": (
                    f"miss its TTFT (first token in {verdict.first_token_s:.2f} s)"
                    if verdict.first_token_s < 1e9  # the play stopped at its deadline
                    else "miss its TTFT"
                ),
                "pushes": f"push request {verdict.request} past its deadline",
                "tpot": "stretch a decode round of its device past the TPOT",
            }.get(verdict.reason, verdict.reason)
            raise Refused(
                f"TE {self._te_id} is too busy: the request would {what}", code=DEVICE_BUSY
            )

    def _sync_instance(self, engine: Engine) -> None:
        """Tell the arbiter what this TE serves when it changed (a load, an unload)."""
        perf = self._control.perf
        if perf is self._told_perf:
            return
        self._told_perf = perf
        budget = engine.prefill_budget
        self._turns.serving(
            None
            if perf is None
            else Instance(
                perf=perf,
                max_num_seqs=self._settings.task_executor.max_num_seqs,
                max_prefill_tokens=budget.paced_tokens or budget.tokens,
                model=self._control.model or "",
                role=self._control.role,
                late_yield_s=self._late_yield_s(),
            )
        )

    def _request_view(self, s: _Stream) -> RequestView:
        """A request of this TE as its deadlines and shadow validation see it."""
        return request_view(
            self._slo,
            arrival=s.arrival,
            prompt_tokens=s.prompt_tokens,
            expected_output=s.max_tokens,
            computed_tokens=(
                s.prompt_tokens if s.first_token_at else s.prompt_tokens - s.prefill_tokens
            ),
            output_tokens=s.generated,
            id=s.key,
        )

    def _request_views(self) -> list[RequestView]:
        return [self._request_view(s) for s in self._streams.values()]

    def _late_yield_s(self) -> float:
        """Its engine's late yield (0: prompts go by deadline alone, or no deadlines)."""
        pacing = self._control.features.prefill_pacing
        return pacing.late_yield_s if pacing is not None else 0.0

    def _urgency(self) -> Urgency:
        """Its claim on the device's next turn (``shared.headroom.urgency``): its most urgent
        request's deadline, as its engine orders prompts (those it lets yield, behind)."""
        views = (self._request_view(s) for s in self._streams.values())
        return urgency(views, time.monotonic(), self._late_yield_s())

    def _earliest_deadline(self) -> float:
        """When the most urgent of this TE's requests is due its next token
        (``shared.headroom``), on the host's monotonic clock."""
        return earliest_deadline(self._request_view(s) for s in self._streams.values())

    async def _apply_queued(self, engine: Engine) -> None:
        for engine_id in self._aborts:
            engine.abort(engine_id)
        self._aborts.clear()
        adds, self._adds = self._adds, {}
        features = self._control.features
        for add in adds.values():
            req = add if isinstance(add, EngineRequest) else add.request
            stream = self._engine_streams.get(req.request_id)
            if stream is None:
                continue  # cancelled before it started
            try:
                if req.adapter and features.lora is not None:
                    await self._load_adapter(features.lora, req.adapter)
                if isinstance(add, _Import) and features.kv_import is not None:
                    features.kv_import.import_kv(add.export, req)
                    stream.import_tokens = 0  # the engine holds it now
                elif isinstance(add, _Prefill) and features.kv_export is not None:
                    features.kv_export.add_request(req, retain_kv=True, kv_sink=add.outbox)
                else:
                    engine.add_request(req)
                stream.started_at = time.monotonic()
            except ValueError as e:  # a prompt (or an adapter) this engine can never serve
                await self._finish(stream, BadRequest(str(e), param="messages"))
            except OSError as e:  # the adapter's files are not readable here
                await self._finish(stream, Internal(f"LoRA adapter {req.adapter}: {e}"))

    async def _load_adapter(self, lora: LoraServing, name: str) -> None:
        """Loaded the first time a request names it, then kept (LRU) by the engine; pinned
        in a device slot if the settings say so (a pin the engine refuses is logged: the
        request still runs)."""
        await self._thread.run(lora.load_adapter, name, self._adapter_paths.get(name, ""))
        if name in self._settings.lora.pinned:
            try:
                await self._thread.run(lora.pin_adapter, name, True)
            except ValueError as e:
                log.warning("adapter not pinned", adapter=name, error=str(e))

    async def _emit(self, outputs: Sequence[EngineOutput]) -> None:
        if outputs:
            self.last_active = time.time()
        for out in outputs:
            stream = self._engine_streams.get(out.request_id)
            if stream is None:
                continue  # cancelled (the task may run again as another copy: not this one)
            if stream.mode == TaskMode.PREFILL:
                self._prefilled(stream, out)
                continue
            if stream.head:  # a decode task's first output: the prefill TE's tokens first
                out = msgspec.structs.replace(out, new_token_ids=[*stream.head, *out.new_token_ids])
                stream.head = []
            if not stream.generated and out.new_token_ids:
                stream.first_token_at = time.monotonic()
                if self._control.ready_at:
                    # The first task's first token after a load: the end of the scale-up.
                    first = time.monotonic() - stream.accepted_at
                    self._control.load_steps.setdefault("te_first_token", first)
                if not out.finished:
                    self._progress_of(stream).prefilled.append(stream.key)
            stream.generated += len(out.new_token_ids)
            self.generated_tokens += len(out.new_token_ids)
            chunk = self._chunk(
                stream,
                out.new_token_ids,
                out.finish_reason if out.finished else None,
                cached_tokens=out.num_cached_tokens,
            )
            if out.finished:
                self._close_stream(stream.key, finished=True, reason=out.finish_reason)
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

    def _prefilled(self, stream: _Stream, out: EngineOutput) -> None:
        """A prefill task's prompt is computed (its KV all in the outbox): the decode TE may
        take it. The KV stays until the lease ends (``_on_kv_end``)."""
        if not out.finished or stream.outbox is None:
            return
        self._progress_of(stream).prefilled.append(stream.key)
        stream.generated = len(out.new_token_ids)
        # Its one token ends the request only where the request itself would end.
        reason = out.finish_reason if out.finish_reason == "stop" else None
        stream.outbox.done(
            [*stream.prompt, *out.new_token_ids], len(stream.prompt), finish_reason=reason
        )

    def _on_kv_end(self, key: str, reason: str) -> None:
        """A prefill task's lease ended (the decode TE released it, said no, went away or
        went silent; the task was cancelled or failed): its KV is freed now."""
        stream = self._close_stream(key)
        if stream is None:
            return
        if self._adds.pop(key, None) is None:
            self._aborts.add(stream.engine_id)  # drops the retained KV
        self._work.set()
        log.debug("prefill KV freed", request_id=stream.request_id, reason=reason)

    async def _pull(self, stream: _Stream, task: ChatTask, request: EngineRequest) -> None:
        """A decode task: its prompt's KV from the prefill TE, then into the engine; on a
        failed or stalled transfer, the fallback (``MESHSERVE_PD_FALLBACK``)."""
        assert task.kv_source is not None
        importer = self._control.features.kv_import
        began = time.monotonic()
        try:
            if importer is None:
                raise TransferFailed("this engine imports no KV")
            got = await pull_prompt(task.kv_source, task.prompt_token_ids, importer, self._settings)
        except Exception as e:  # TransferFailed, or a KV that does not fit: never a hang
            if not isinstance(e, TransferFailed):
                log.exception("KV pull failed", request_id=stream.request_id)
            if self._streams.get(stream.key) is not stream:
                return
            stream.kv_window = (began, time.monotonic())
            self.kv_fallbacks += 1
            fallback = self._settings.task_executor.pd_fallback
            stream.kv_note = KvTransferNote(prefill_te=task.kv_source.te_id, fallback=str(e))
            log.warning(
                "KV transfer failed",
                request_id=stream.request_id,
                prefill_te=task.kv_source.te_id,
                error=str(e),
                fallback=fallback,
            )
            if fallback == "fail":
                await self._finish(
                    stream,
                    KvTransferFailed(
                        f"the prompt's KV did not arrive from prefill instance "
                        f"{task.kv_source.te_id}: {e}"
                    ),
                )
                return
            self._adds[stream.key] = request  # prefill it here
            stream.prefill_tokens, stream.import_tokens = stream.import_tokens, 0
        else:
            if self._streams.get(stream.key) is not stream:
                return
            stream.kv_window = (began, time.monotonic())
            pulled = got.pulled
            self.kv_pulled_bytes += pulled.nbytes
            stream.kv_note = KvTransferNote(
                prefill_te=task.kv_source.te_id,
                transport=pulled.transport,
                bytes=pulled.nbytes,
                seconds=pulled.seconds,
                held_tokens=pulled.first_token,
            )
            log.info(
                "KV pulled",
                request_id=stream.request_id,
                prefill_te=task.kv_source.te_id,
                transport=pulled.transport,
                bytes=pulled.nbytes,
                seconds=round(pulled.seconds, 4),
                held_tokens=pulled.first_token,
            )
            if got.finish_reason is not None:  # the prefill's token ended it
                stream.head = []
                await self._end_with(stream, got.head, got.finish_reason)
                return
            stream.head = got.head
            self._adds[stream.key] = _Import(request, got.export)
        finally:
            self._pulls.pop(stream.key, None)
        self._work.set()

    async def _end_with(self, stream: _Stream, token_ids: list[int], reason: str) -> None:
        """End a decode task with the tokens its prefill produced (they finished it)."""
        stream.generated = len(token_ids)
        self._close_stream(stream.key, finished=True)
        self.generated_tokens += len(token_ids)
        chunk = self._chunk(stream, token_ids, reason)
        with contextlib.suppress(PeerUnreachable):
            await self._bus.publish(stream.reply_to, chunk, request_id=stream.request_id)

    def _chunk(
        self,
        stream: _Stream,
        token_ids: list[int],
        finish_reason: str | None,
        *,
        cached_tokens: int = 0,
        error: str | None = None,
        failure: ErrorReply | None = None,
        move_to: str = "",
    ) -> TokenChunk:
        """The stream's next chunk (its first carries the TE's time and how the KV came)."""
        first = stream.seq == 0
        stream.seq += 1
        return TokenChunk(
            request_id=stream.request_id,
            attempt=stream.attempt,
            seq=stream.seq - 1,
            token_ids=token_ids,
            finish_reason=finish_reason,
            prompt_tokens=stream.prompt_tokens,
            completion_tokens=stream.generated,
            cached_tokens=cached_tokens,
            error=error,
            te_id=self._te_id,
            failure=failure,
            te_s=time.monotonic() - stream.accepted_at if first else 0.0,
            kv=stream.kv_note if first else None,
            move_to=move_to,
        )

    async def _finish(self, stream: _Stream, failure: MeshserveError) -> None:
        """End a stream with an error: a retryable one sends the request elsewhere. A
        prefill task's decode TE hears it instead (the pull fails: it falls back)."""
        if stream.outbox is not None:
            if self._streams.get(stream.key) is stream:
                stream.outbox.fail(failure.message)
                self.prefill.withdraw(stream.key, f"failed: {failure.message}")
            return
        if self._close_stream(stream.key) is None:
            return
        log.info(
            "task ended early",
            request_id=stream.request_id,
            attempt=stream.attempt,
            failure=type(failure).__name__,
            error=failure.message,
        )
        chunk = self._chunk(
            stream,
            [],
            "error",
            error=failure.message,
            failure=failure.to_reply(),
            move_to=self._moves.pop(stream.key, "") if failure.retryable else "",
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
