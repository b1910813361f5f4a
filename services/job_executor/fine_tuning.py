"""The job executor's side of fine-tuning: runs the active fine-tuning jobs
(``shared.fine_tuning``) as task graphs (``planner.plan_fine_tune``: preprocess → train →
evaluate), each stage on an idle TE in training mode
(``services/task_executor/training/runner.py``).

Any job executor may run any job: it takes one by opening the job's graph in Redis, which
only one can do while the owner lives (``shared.task_graphs``), and it writes every step
under the graph's fencing number. When a job executor dies, another one takes its graphs
over at its next scan once the dead one's liveness key expired: a stage the dead one had
placed is cancelled on its TE and placed again, training resuming from the job's last
epoch checkpoint. When a training TE is lost (gone from the view, or no longer training the
stage), the stage is placed again the same way, up to ``max_attempts`` times; then the job
fails with the reason. The adapter is registered, and the job marked succeeded, only by the
graph's owner after evaluate: never twice, never for a cancelled job."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
from redis.exceptions import RedisError

from services.job_executor.graph_keeper import GraphKeeper, Running
from services.job_executor.planner import plan_fine_tune, ready, resumed, with_task
from services.task_executor.training.runner import training_key
from shared.bus import Bus
from shared.errors import Deposed, MeshserveError
from shared.fine_tuning import (
    BASE_LEARNING_RATE,
    LIVE,
    TERMINAL,
    Adapter,
    FineTuneJob,
    FineTuneStore,
    JobCheckpoint,
    JobError,
    JobStatus,
    new_id,
)
from shared.logging import get_logger
from shared.messages.cluster import ClusterView, TEHeartbeat, TEState
from shared.messages.training import (
    CancelTraining,
    FineTuneSubmitted,
    TrainAccepted,
    TrainDone,
    TrainParams,
    TrainProgress,
    TrainStage,
    TrainTask,
)
from shared.runner import cancel_until_done
from shared.settings import FineTuningSettings
from shared.store import Store
from shared.subjects import Subjects
from shared.task_graphs import GraphStore, GraphTask, TaskState

log = get_logger(__name__)

KEEP_GRAPH_S = 30 * 86400.0  # a fine-tuning graph's deadline: it is never abandoned
PLACE_TIMEOUT_S = 5.0
POLL_S = 0.5


def _reported(step: int, total: int) -> bool:
    """Whether a step's loss becomes an event: every step of a run of up to 100, else about
    a hundred evenly spread, and the last."""
    return step == total or step % max(1, total // 100) == 0


def training_te(tes: Sequence[TEHeartbeat], model: str, refused: frozenset[str]) -> str | None:
    """Which idle TE runs a stage for ``model``: one whose host's weight cache holds the
    model first (its weights read from memory), then by name. Pure."""
    idle = [te for te in tes if te.state == TEState.IDLE and te.te_id not in refused]
    if not idle:
        return None
    return min(idle, key=lambda te: (model not in te.cached_weights, te.te_id)).te_id


def asked_params(job: FineTuneJob, rank: int) -> TrainParams:
    """The job's hyperparameters with ``auto`` as 0 (preprocess resolves them)."""
    hp = job.hyperparameters
    mult = hp.learning_rate_multiplier
    return TrainParams(
        n_epochs=hp.n_epochs if isinstance(hp.n_epochs, int) else 0,
        batch_size=hp.batch_size if isinstance(hp.batch_size, int) else 0,
        learning_rate=0.0 if isinstance(mult, str) else float(mult) * BASE_LEARNING_RATE,
        rank=rank,
        alpha=2 * rank,
        seed=job.seed,
    )


@dataclasses.dataclass
class _Placement:
    key: str  # training_key: what the TE's heartbeat names while it runs it
    te_id: str
    attempt: int
    started_at: float  # the TE's process start, as the view showed it when placed
    placed_at: float  # time.monotonic() (this JE's clock only)
    inbox: asyncio.Queue[TrainProgress | TrainDone]
    missing_since: float | None = None  # time.monotonic() it was first missing from the view


class _Refused(str):
    """Why a TE would not take a stage (another one is tried; no attempt is spent)."""


class JobFailed(Exception):
    """The job fails for good, with OpenAI's error code and a reason."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class StageLost(Exception):
    """The TE running a stage is gone, or stopped running it."""


class JobEnded(Exception):
    """The job reached a terminal status (cancelled) under the runner."""


class FineTuneRunner:
    def __init__(
        self,
        *,
        settings: FineTuningSettings,
        cluster: str,
        files_dir: Path,
        heartbeat_s: float,
        liveness_s: float,
        bus: Bus,
        subjects: Subjects,
        store: Store | None,
        keeper: GraphKeeper,
        je_id: str,
        view: Callable[[], ClusterView],
    ) -> None:
        self._settings = settings
        self._dir = settings.directory(cluster)
        self._files_dir = files_dir
        self._heartbeat_s, self._liveness_s = heartbeat_s, liveness_s
        self._bus, self._subjects = bus, subjects
        self._jobs = FineTuneStore(store, cluster) if store is not None else None
        self._graphs = GraphStore(store, cluster, je_id) if store is not None else None
        self._keeper = keeper
        self._je_id = je_id
        self._view = view
        self._running: dict[str, asyncio.Task[None]] = {}
        self._placements: dict[str, _Placement] = {}  # by training_key
        self._wake = asyncio.Event()
        self._stopping = False
        self.taken_over = 0

    async def start(self, life: Any) -> None:
        if self._jobs is None:
            return
        await self._bus.subscribe(
            self._subjects.train_progress(self._je_id),
            {TrainProgress: self._on_report, TrainDone: self._on_report},
        )
        await self._bus.subscribe(self._subjects.ft_submit(), {FineTuneSubmitted: self._on_submit})
        life.spawn(self._scan_forever(), name="fine-tuning scan")

    async def stop(self) -> None:
        """Stop every job this JE runs (their graphs stay open under it: another JE takes
        them over). No job is taken any more."""
        self._stopping = True
        await cancel_until_done(self._running.values)

    async def _on_submit(self, _: FineTuneSubmitted) -> None:
        self._wake.set()

    async def _on_report(self, msg: TrainProgress | TrainDone) -> None:
        placement = self._placements.get(training_key(msg.job_id, msg.attempt))
        if placement is not None:
            placement.inbox.put_nowait(msg)

    # -- taking jobs ------------------------------------------------------------------------

    async def _scan_forever(self) -> None:
        while True:
            try:
                await self.scan_once()
            except (RedisError, OSError) as e:
                log.warning("fine-tuning scan failed", error=str(e))
            except Exception:  # one bad record must not stop the job executor
                log.exception("fine-tuning scan failed")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._wake.wait(), self._settings.scan_interval.total_seconds()
                )

    async def scan_once(self) -> None:
        """Take each active job nobody live runs (a terminal one too: its stages are stopped
        and its graph closed, then it is settled)."""
        assert self._jobs is not None and self._graphs is not None
        for job_id in await self._jobs.active():
            if self._stopping:
                return
            if job_id in self._running:
                continue
            held = await self._graphs.get(job_id)
            job = await self._jobs.get(job_id)
            if (job is None or job.status in TERMINAL) and (held is None or not held.open):
                await self._jobs.settle(job_id)  # nothing of it runs anywhere
                continue
            if held is not None and held.open:
                if held.owner_alive and held.owner != self._graphs.me:
                    continue
                epoch = await self._graphs.claim(job_id, held.epoch)
                if epoch is None:
                    continue
                graph, stray = resumed(held.graph)
                self.taken_over += 1
                log.info("fine-tuning job taken over", job=job_id, dead_owner=held.owner)
                run = Running(graph, epoch)
                self._spawn(job_id, run, stray)
                continue
            if job is None:
                continue
            graph = plan_fine_tune(
                job_id=job_id, model=job.model, deadline=time.time() + KEEP_GRAPH_S
            )
            run = await self._keeper.start_graph(graph)
            if run.epoch is None:  # a live peer opened it first
                continue
            self._spawn(job_id, run, ())

    def _spawn(self, job_id: str, run: Running, stray: tuple[GraphTask, ...]) -> None:
        if self._stopping:  # a scan that ran on while the JE stops: the job stays open
            return
        task = asyncio.create_task(self._run(job_id, run, stray), name=f"fine-tune {job_id}")
        self._running[job_id] = task
        task.add_done_callback(lambda _: self._running.pop(job_id, None))

    # -- running a job ----------------------------------------------------------------------

    async def _run(self, job_id: str, run: Running, stray: tuple[GraphTask, ...]) -> None:
        assert self._jobs is not None
        try:
            for task in stray:  # placed by a dead owner: stopped there, run again here
                await self._cancel_on_te(job_id, task)
            while True:
                job = await self._jobs.get(job_id)
                if job is None or job.status in TERMINAL:
                    await self._close(run)
                    return
                todo = ready(run.graph)
                if not todo:
                    await self._succeed(job, run)
                    return
                await self._stage(job, run, todo[0])
        except Deposed:
            log.warning("fine-tuning job taken over by another job executor", job=job_id)
        except JobEnded:
            await self._close(run)
        except JobFailed as e:
            await self._fail(job_id, run, e.code, e.message)
        except asyncio.CancelledError:
            raise
        except (RedisError, OSError) as e:
            # Redis away a moment: the graph stays open under this JE, whose next scan
            # takes it over (the stage on its TE stopped, resumed from its checkpoint).
            log.warning("fine-tuning job paused", job=job_id, error=str(e))
        except Exception as e:  # a bug here must not leave the job running forever
            log.exception("fine-tuning job failed", job=job_id)
            await self._fail(job_id, run, "internal_error", f"The job failed: {e}")

    async def _stage(self, job: FineTuneJob, run: Running, task: GraphTask) -> None:
        """Run one stage to its end: done, or failed for good (``JobFailed``). A TE that
        refuses it is skipped; a TE lost under it costs one of ``max_attempts``."""
        assert self._jobs is not None
        stage = TrainStage(task.name)
        refused: set[str] = set()
        lost = 0
        while True:
            te_id = await self._idle_te(job, frozenset(refused))
            job = await self._current(job.id)
            attempt = run.graph.task(task.name).attempt + 1
            msg = self._train_task(job, stage, attempt)
            await self._keeper.step(
                run,
                with_task(
                    run.graph, task.name, state=TaskState.PLACING, te_id=te_id, attempt=attempt
                ),
            )
            outcome = await self._attempt(job, stage, te_id, msg)
            if isinstance(outcome, TrainDone) and outcome.ok:
                await self._finished(job, stage, outcome)
                await self._keeper.step(run, with_task(run.graph, task.name, state=TaskState.DONE))
                return
            if isinstance(outcome, TrainDone) and outcome.cancelled:
                raise JobEnded
            if isinstance(outcome, TrainDone) and not outcome.retryable:
                code = (
                    "invalid_training_file" if stage == TrainStage.PREPROCESS else "training_failed"
                )
                raise JobFailed(code, outcome.error)
            reason = outcome.error if isinstance(outcome, TrainDone) else str(outcome)
            graph = with_task(
                run.graph, task.name, state=TaskState.PLANNED, te_id="", reason=reason
            )
            await self._keeper.step(run, graph)
            if isinstance(outcome, _Refused):
                refused.add(te_id)
                continue
            lost += 1
            log.warning("training stage lost", job=job.id, stage=stage, reason=reason)
            if lost >= self._settings.max_attempts:
                raise JobFailed(
                    "training_lost",
                    f"The {stage} stage was interrupted {lost} times; last: {reason}.",
                )
            await self._jobs.add_event(
                job.id,
                f"The {stage} stage was interrupted ({reason}); placing it again",
                level="warn",
            )

    async def _attempt(
        self, job: FineTuneJob, stage: TrainStage, te_id: str, msg: TrainTask
    ) -> TrainDone | _Refused | str:
        """Place the stage on ``te_id`` and follow it: its end, a refusal, or why it was
        lost."""
        te = next((t for t in self._view().tes if t.te_id == te_id), None)
        key = training_key(job.id, msg.attempt)
        placement = _Placement(
            key=key,
            te_id=te_id,
            attempt=msg.attempt,
            started_at=te.started_at if te is not None else 0.0,
            placed_at=time.monotonic(),
            inbox=asyncio.Queue(),
        )
        self._placements[key] = placement
        try:
            try:
                await self._bus.request(
                    self._subjects.te_train(te_id), msg, TrainAccepted, timeout=PLACE_TIMEOUT_S
                )
            except MeshserveError as e:
                # It may have taken it and the answer got lost: stopped there to be sure.
                await self._send_cancel(te_id, job.id, msg.attempt)
                log.info("training stage refused", job=job.id, te=te_id, error=e.message)
                return _Refused(f"TE {te_id} refused it: {e.message}")
            await self._started(job, stage, te_id)
            try:
                return await self._follow(job, placement)
            except StageLost as e:
                await self._send_cancel(te_id, job.id, msg.attempt)  # should it still run
                return str(e)
        finally:
            self._placements.pop(key, None)

    async def _current(self, job_id: str) -> FineTuneJob:
        assert self._jobs is not None
        job = await self._jobs.get(job_id)
        if job is None or job.status in TERMINAL:
            raise JobEnded
        return job

    async def _idle_te(self, job: FineTuneJob, refused: frozenset[str]) -> str:
        """Waits for an idle TE that has not refused the stage (the job stays queued
        meanwhile); once every idle TE has refused, they are asked again after a pause."""
        while True:
            await self._current(job.id)
            te_id = training_te(self._view().tes, job.model, refused)
            if te_id is not None:
                return te_id
            await asyncio.sleep(POLL_S)
            refused = frozenset()

    def _train_task(self, job: FineTuneJob, stage: TrainStage, attempt: int) -> TrainTask:
        model = next((m for m in self._view().models if m.id == job.model), None)
        if model is None:
            raise JobFailed("model_not_found", f"The base model `{job.model}` is gone.")
        return TrainTask(
            job_id=job.id,
            stage=stage,
            attempt=attempt,
            model=job.model,
            model_path=model.path,
            training_file=str(self._files_dir / job.training_file),
            validation_file=str(self._files_dir / job.validation_file)
            if job.validation_file
            else "",
            out_dir=str(self._dir / job.id / f"{stage}-{attempt}"),
            params=job.params or asked_params(job, self._settings.rank),
            resume_from=job.checkpoint,
            adapter_dir=str(self._dir / job.id / f"adapter-{attempt}"),
            reply_to=self._subjects.train_progress(self._je_id),
        )

    async def _follow(self, job: FineTuneJob, p: _Placement) -> TrainDone:
        """The stage's reports, recorded as they come, until it ends; ``StageLost`` when its
        TE is gone; a cancelled job's stage is cancelled on its TE (it answers done)."""
        assert self._jobs is not None
        cancelled = False
        check_at = time.monotonic() + POLL_S
        while True:
            # The TE and the job's status are checked every POLL_S, reports or not.
            if time.monotonic() >= check_at:
                check_at = time.monotonic() + POLL_S
                self._check_te(p)
                if not cancelled:
                    now = await self._jobs.get(job.id)
                    if now is None or now.status in TERMINAL:
                        cancelled = True
                        await self._send_cancel(p.te_id, job.id, p.attempt)
            try:  # not wait_for: on Python 3.11 it swallows a cancel that meets a report
                async with asyncio.timeout(max(check_at - time.monotonic(), 0)):
                    msg = await p.inbox.get()
            except TimeoutError:
                continue
            if isinstance(msg, TrainDone):
                return msg
            await self._progress(job, msg)

    def _check_te(self, p: _Placement) -> None:
        """``StageLost`` once the stage's TE has been missing from the view for a liveness
        timeout (a view is briefly empty after the cluster manager restarts), restarted, or
        no longer names the stage in its heartbeats (given a few heartbeats to say it)."""
        now = time.monotonic()
        te = next((t for t in self._view().tes if t.te_id == p.te_id), None)
        if te is None:
            p.missing_since = p.missing_since or now
            if now - p.missing_since > self._liveness_s:
                raise StageLost(f"TE {p.te_id} left the cluster")
            return
        p.missing_since = None
        if te.started_at != p.started_at and p.started_at:
            raise StageLost(f"TE {p.te_id} restarted")
        if now - p.placed_at > 3 * self._heartbeat_s and te.training != p.key:
            raise StageLost(f"TE {p.te_id} is no longer running the stage")

    # -- what the stages report -------------------------------------------------------------

    async def _started(self, job: FineTuneJob, stage: TrainStage, te_id: str) -> None:
        assert self._jobs is not None
        if stage == TrainStage.TRAIN:
            moved = await self._jobs.update(
                job.id, (JobStatus.QUEUED, JobStatus.VALIDATING_FILES), status=JobStatus.RUNNING
            )
            if moved is not None:
                await self._jobs.add_event(job.id, "Fine-tuning job started")
        await self._jobs.add_event(job.id, f"The {stage} stage runs on TE {te_id}")

    async def _progress(self, job: FineTuneJob, msg: TrainProgress) -> None:
        jobs = self._jobs
        assert jobs is not None
        if msg.params is not None:  # preprocess: the data's size and the resolved params
            await jobs.update(job.id, LIVE, params=msg.params, tokens_per_epoch=msg.tokens)
            await jobs.update(job.id, (JobStatus.VALIDATING_FILES,), status=JobStatus.QUEUED)
            await jobs.add_event(
                job.id,
                f"Files validated: {msg.examples} training examples, {msg.tokens} tokens per "
                f"epoch; {msg.params.n_epochs} epochs, batch size {msg.params.batch_size}",
            )
        elif msg.checkpoint:
            now = await self._current(job.id)
            epochs = now.params.n_epochs if now.params else 0
            metrics: dict[str, float] = {"step": float(msg.step)}
            if msg.train_loss is not None:
                metrics["train_loss"] = msg.train_loss
            if msg.valid_loss is not None:
                metrics["full_valid_loss"] = msg.valid_loss
            await jobs.update(
                job.id,
                LIVE,
                checkpoint_record=JobCheckpoint(
                    id=new_id("ftckpt"),
                    created_at=int(time.time()),
                    fine_tuned_model_checkpoint=f"{job.model_name()}:ckpt-epoch-{msg.epoch}",
                    fine_tuning_job_id=job.id,
                    step_number=msg.step or msg.epoch,
                    metrics=metrics,
                    epoch=msg.epoch,
                    path=msg.checkpoint,
                ),
                checkpoint=msg.checkpoint,
                trained_tokens=now.tokens_per_epoch * msg.epoch,
            )
            text = f"Epoch {msg.epoch}/{epochs} done: checkpoint saved"
            if msg.valid_loss is not None:
                text += f", validation loss={msg.valid_loss:.4f}"
            await jobs.add_event(
                job.id, text, data={"epoch": msg.epoch, "valid_loss": msg.valid_loss}
            )
        elif msg.train_loss is not None and _reported(msg.step, msg.total_steps):
            await jobs.add_event(
                job.id,
                f"Step {msg.step}/{msg.total_steps}: training loss={msg.train_loss:.4f}",
                data={
                    "step": msg.step,
                    "total_steps": msg.total_steps,
                    "train_loss": msg.train_loss,
                },
            )

    async def _finished(self, job: FineTuneJob, stage: TrainStage, done: TrainDone) -> None:
        assert self._jobs is not None
        if stage == TrainStage.TRAIN:
            await self._jobs.update(job.id, LIVE, checkpoint=done.checkpoint)
        elif stage == TrainStage.EVALUATE:
            # Each attempt publishes its own copy: the one that ended is the one served.
            await self._jobs.update(job.id, LIVE, adapter_path=done.checkpoint)
            data = {"train_loss": done.train_loss, "valid_loss": done.valid_loss}
            await self._jobs.add_event(job.id, "Evaluated the adapter", data=data)

    async def _succeed(self, job: FineTuneJob, run: Running) -> None:
        """Register the adapter and mark the job succeeded, in one transaction (a job
        cancelled meanwhile gets neither); then close the graph and settle the job."""
        assert self._jobs is not None
        name = job.model_name()
        # Fenced first: a deposed runner stops here (Deposed), before it registers anything.
        await self._keeper.step(run, run.graph)
        adapter = Adapter(
            name=name,
            base=job.model,
            path=job.adapter_path,
            tenant=job.tenant,
            job_id=job.id,
            created=int(time.time()),
        )
        done = await self._jobs.update(
            job.id, LIVE, status=JobStatus.SUCCEEDED, fine_tuned_model=name, register=adapter
        )
        if done is not None:
            await self._jobs.add_event(job.id, f"New fine-tuned model created: {name}")
            await self._jobs.add_event(job.id, "The job has successfully completed")
            log.info("fine-tuning job succeeded", job=job.id, model=name)
        await self._finish(run)

    async def _fail(self, job_id: str, run: Running, code: str, message: str) -> None:
        assert self._jobs is not None
        await self._stop_stages(run)
        failed = await self._jobs.update(
            job_id, LIVE, status=JobStatus.FAILED, error=JobError(code=code, message=message)
        )
        if failed is not None:
            await self._jobs.add_event(job_id, message, level="error")
            log.warning("fine-tuning job failed", job=job_id, reason=message)
        await self._finish(run)

    async def _close(self, run: Running) -> None:
        """A job that ended under the runner (cancelled): its stages stopped, its graph
        closed, the job settled."""
        await self._stop_stages(run)
        await self._finish(run)

    async def _stop_stages(self, run: Running) -> None:
        for task in run.graph.tasks:
            if task.state in (TaskState.PLACING, TaskState.PLACED):
                await self._cancel_on_te(run.graph.graph_id, task)

    async def _finish(self, run: Running) -> None:
        """The graph closed (unless another JE took it over), then the job settled: a JE
        that dies before this leaves the job active, and the next scan finishes it."""
        assert self._jobs is not None
        try:
            await self._keeper.step(run, msgspec.structs.replace(run.graph, finished=True))
        except Deposed:
            return
        await self._jobs.settle(run.graph.graph_id)

    async def _cancel_on_te(self, job_id: str, task: GraphTask) -> None:
        if task.te_id:
            await self._send_cancel(task.te_id, job_id, task.attempt)

    async def _send_cancel(self, te_id: str, job_id: str, attempt: int) -> None:
        with contextlib.suppress(MeshserveError):
            await self._bus.request(
                self._subjects.te_train(te_id),
                CancelTraining(job_id=job_id, attempt=attempt),
                TrainAccepted,
                timeout=PLACE_TIMEOUT_S,
            )
