"""A TE's training mode: an idle TE (no model loaded) takes a stage of a fine-tuning job
(``TrainTask``), reports ``training`` in its heartbeats so the scaler leaves it alone, runs
the stage on its engine thread (``stages.run_stage``) and goes back to idle. Progress and
the end go to the job executor that placed the stage; a cancel stops training between
steps (the last epoch checkpoint stays)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from services.task_executor.engine_thread import EngineThread
from services.task_executor.model_control import ModelControl
from services.task_executor.training.stages import run_stage, stage_done
from shared.bus import Bus
from shared.errors import Refused
from shared.logging import get_logger
from shared.messages.api import ErrorReply
from shared.messages.cluster import TEState
from shared.messages.training import (
    CancelTraining,
    TrainAccepted,
    TrainProgress,
    TrainTask,
)
from shared.runner import Lifecycle
from shared.settings import FineTuningSettings

log = get_logger(__name__)


def training_key(job_id: str, attempt: int) -> str:
    """What a TE's heartbeat says it trains: the job's placement there."""
    return f"{job_id}/{attempt}"


class TrainingRunner:
    def __init__(
        self,
        *,
        te_id: str,
        bus: Bus,
        control: ModelControl,
        thread: EngineThread,
        life: Lifecycle,
        changed: Callable[[], None],
        settings: FineTuningSettings,
    ) -> None:
        self._te_id, self._bus = te_id, bus
        self._control, self._thread, self._life = control, thread, life
        self._changed = changed
        self._settings = settings
        self.current = ""  # training_key of the stage running here ("": none)
        self._stop = threading.Event()

    async def on_task(self, task: TrainTask) -> TrainAccepted | ErrorReply:
        if self._control.state != TEState.IDLE:
            return Refused(
                f"TE {self._te_id} is {self._control.state}, not idle: it cannot train now"
            ).to_reply()
        self._control.state = TEState.TRAINING
        self.current = training_key(task.job_id, task.attempt)
        self._stop.clear()
        self._changed()
        self._life.spawn(self._run(task), name=f"training {self.current}", one_shot=True)
        log.info("training stage started", job=task.job_id, stage=task.stage, attempt=task.attempt)
        return TrainAccepted(te_id=self._te_id, job_id=task.job_id, attempt=task.attempt)

    async def on_cancel(self, msg: CancelTraining) -> TrainAccepted:
        if self.current == training_key(msg.job_id, msg.attempt):
            self._stop.set()
        return TrainAccepted(te_id=self._te_id, job_id=msg.job_id, attempt=msg.attempt)

    async def _run(self, task: TrainTask) -> None:
        loop = asyncio.get_running_loop()

        def report(progress: TrainProgress) -> None:  # on the engine thread
            loop.call_soon_threadsafe(self._publish, task.reply_to, progress)

        try:
            done = await self._thread.run(
                run_stage,
                task,
                self._te_id,
                report,
                self._stop.is_set,
                self._settings.max_example_tokens,
                self._settings.precision,
            )
        except Exception as e:  # a bug or the device: the job may run it again elsewhere
            log.exception("training stage crashed", job=task.job_id, stage=task.stage)
            done = stage_done(
                task,
                self._te_id,
                ok=False,
                retryable=True,
                error=f"{task.stage} crashed: {type(e).__name__}: {e}",
            )
        finally:
            if self._control.state == TEState.TRAINING:
                self._control.state = TEState.IDLE
            self.current = ""
            self._changed()
        log.info("training stage ended", job=task.job_id, stage=task.stage, ok=done.ok)
        await self._bus.publish(task.reply_to, done)

    def _publish(self, subject: str, msg: TrainProgress) -> None:
        self._life.spawn(self._bus.publish(subject, msg), name="training progress", one_shot=True)
