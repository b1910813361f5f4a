"""Fine-tuning jobs as OpenAI's API shows them, kept in Redis: the job, its events and its
checkpoints, and the adapters finished jobs published.

The frontend creates a job (``validating_files``) and marks it active; job executors run the
active ones (``services/job_executor/fine_tuning.py``), each under its task graph's fencing
number (``shared.task_graphs``), and move it along
``validating_files → queued → running → succeeded | failed | cancelled``. A status change is
one optimistic transaction on the job's own record that names the statuses it may leave, so
a cancel and a job executor's step never both win; registering the adapter and marking the
job succeeded are one transaction, and so are a cancel and withdrawing the adapter. A
terminal job stays in the active set until a job executor has stopped its stages and closed
its graph (``settle``): a job cancelled while its job executor was dead is still cleaned
up.

The adapter of a succeeded job is registered under its model name,
``ft:<base>:<suffix>:<job>`` (OpenAI's form; an empty suffix leaves ``::``), for its
tenant alone: the frontend lists it beside the base models and TEs of the base model serve
it."""

from __future__ import annotations

import enum
import secrets
import time
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
from redis.exceptions import WatchError

from shared.messages.training import TrainParams
from shared.store import Store
from shared.subjects import Keys

BASE_LEARNING_RATE = 2e-4  # learning_rate_multiplier 1.0
MAX_EVENTS = 10_000  # a job's newest events kept
AUTO = "auto"


class JobStatus(enum.StrEnum):
    VALIDATING_FILES = "validating_files"
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})
LIVE = frozenset(JobStatus) - TERMINAL


class Hyperparameters(msgspec.Struct, kw_only=True):
    """As asked (an int, a float or ``"auto"``); resolved ones are in ``FineTuneJob.params``."""

    n_epochs: int | str = AUTO
    batch_size: int | str = AUTO
    learning_rate_multiplier: float | str = AUTO


class JobError(msgspec.Struct, kw_only=True):
    code: str
    message: str
    param: str | None = None


class FineTuneJob(msgspec.Struct, kw_only=True):
    id: str
    tenant: str
    model: str
    training_file: str
    created_at: int
    hyperparameters: Hyperparameters
    validation_file: str | None = None
    suffix: str | None = None
    seed: int = 0
    metadata: dict[str, str] | None = None
    status: JobStatus = JobStatus.VALIDATING_FILES
    finished_at: int | None = None
    fine_tuned_model: str | None = None
    error: JobError | None = None
    trained_tokens: int | None = None
    estimated_finish: int | None = None
    # Internal: as preprocess resolved them; the latest epoch checkpoint (a resume starts
    # there); tokens an epoch; the published adapter.
    params: TrainParams | None = None
    checkpoint: str = ""
    tokens_per_epoch: int = 0
    adapter_path: str = ""  # the adapter evaluate published (served once the job succeeds)

    def model_name(self) -> str:
        return fine_tuned_name(self.model, self.suffix or "", self.id)

    def openai(self) -> dict[str, Any]:
        """As OpenAI's API shows a fine-tuning job."""
        hp = _resolved(self)
        return {
            "id": self.id,
            "object": "fine_tuning.job",
            "created_at": self.created_at,
            "error": msgspec.to_builtins(self.error) if self.error else None,
            "fine_tuned_model": self.fine_tuned_model,
            "finished_at": self.finished_at,
            "hyperparameters": hp,
            "model": self.model,
            "organization_id": self.tenant,
            "result_files": [],
            "seed": self.seed,
            "status": str(self.status),
            "trained_tokens": self.trained_tokens,
            "training_file": self.training_file,
            "validation_file": self.validation_file,
            "integrations": [],
            "metadata": self.metadata,
            "estimated_finish": self.estimated_finish,
            "suffix": self.suffix,
            "method": {"type": "supervised", "supervised": {"hyperparameters": hp}},
        }


def _resolved(job: FineTuneJob) -> dict[str, Any]:
    asked, p = job.hyperparameters, job.params
    if p is None:
        return msgspec.to_builtins(asked)  # type: ignore[no-any-return]
    return {
        "n_epochs": p.n_epochs,
        "batch_size": p.batch_size,
        "learning_rate_multiplier": round(p.learning_rate / BASE_LEARNING_RATE, 6),
    }


def fine_tuned_name(base: str, suffix: str, job_id: str) -> str:
    return f"ft:{base}:{suffix}:{job_id.removeprefix('ftjob-')}"


class JobEvent(msgspec.Struct, kw_only=True):
    id: str
    created_at: int
    level: str  # info, warn, error
    message: str
    type: str = "message"  # or "metrics"
    data: dict[str, Any] | None = None

    def openai(self) -> dict[str, Any]:
        out = msgspec.to_builtins(self)
        out["object"] = "fine_tuning.job.event"
        return out  # type: ignore[no-any-return]


class JobCheckpoint(msgspec.Struct, kw_only=True):
    id: str
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    step_number: int
    metrics: dict[str, float]
    epoch: int = 0
    path: str = ""  # internal: the checkpoint's directory

    def openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "fine_tuning.job.checkpoint",
            "created_at": self.created_at,
            "fine_tuned_model_checkpoint": self.fine_tuned_model_checkpoint,
            "fine_tuning_job_id": self.fine_tuning_job_id,
            "step_number": self.step_number,
            "metrics": self.metrics,
        }


class Adapter(msgspec.Struct, kw_only=True):
    """A LoRA adapter served beside its base model: ``name`` is the model id a client asks
    for."""

    name: str
    base: str
    path: str  # the adapter's directory (peft's layout)
    tenant: str
    job_id: str
    created: int


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


class FineTuneStore:
    """The cluster's fine-tuning jobs, events, checkpoints and adapters in Redis."""

    def __init__(self, store: Store, cluster: str) -> None:
        self._redis = store.redis
        self._keys = Keys(cluster)

    # -- jobs -------------------------------------------------------------------------------

    async def create(self, job: FineTuneJob) -> None:
        pipe = self._redis.pipeline(transaction=True)
        pipe.set(self._keys.ft_job(job.id), msgspec.json.encode(job))
        pipe.sadd(self._keys.ft_jobs(), job.id)
        pipe.zadd(self._keys.ft_active(), {job.id: job.created_at})
        await pipe.execute()

    async def get(self, job_id: str) -> FineTuneJob | None:
        blob = await self._redis.get(self._keys.ft_job(job_id))
        return None if blob is None else msgspec.json.decode(blob, type=FineTuneJob)

    async def jobs(self) -> list[FineTuneJob]:
        """Every job, the newest first."""
        ids = sorted(await self._redis.smembers(self._keys.ft_jobs()))
        blobs = await self._redis.mget([self._keys.ft_job(_text(i)) for i in ids]) if ids else []
        jobs = [msgspec.json.decode(b, type=FineTuneJob) for b in blobs if b is not None]
        return sorted(jobs, key=lambda j: (j.created_at, j.id), reverse=True)

    async def active(self) -> list[str]:
        """Jobs not yet terminal, the oldest first."""
        ids = await self._redis.zrange(self._keys.ft_active(), 0, -1)
        return [i.decode() if isinstance(i, bytes) else str(i) for i in ids]

    async def update(
        self,
        job_id: str,
        allowed: Iterable[JobStatus],
        *,
        register: Adapter | None = None,
        withdraw: str = "",
        checkpoint_record: JobCheckpoint | None = None,
        **changes: Any,
    ) -> FineTuneJob | None:
        """Apply ``changes`` to the job if its status is one of ``allowed``: the job as
        changed, or None (missing, or in another status). In the same transaction,
        ``register`` an adapter or ``withdraw`` one by name, and append ``checkpoint_record``
        to its checkpoints (with ``checkpoint=`` its path: a job executor that dies between
        two writes would leave an epoch listed that a successor resumes before, and trains
        twice). A terminal status stamps ``finished_at``; the job stays active until
        ``settle``."""
        allowed = frozenset(allowed)
        key = self._keys.ft_job(job_id)
        while True:
            async with self._redis.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(key)
                    blob = await pipe.get(key)
                    if blob is None:
                        return None
                    job = msgspec.json.decode(blob, type=FineTuneJob)
                    if job.status not in allowed:
                        return None
                    job = msgspec.structs.replace(job, **changes)
                    if job.status in TERMINAL and job.finished_at is None:
                        job.finished_at = int(time.time())
                    pipe.multi()  # type: ignore[no-untyped-call]
                    pipe.set(key, msgspec.json.encode(job))
                    if register is not None:
                        pipe.hset(
                            self._keys.adapters(), register.name, msgspec.json.encode(register)
                        )
                    if withdraw:
                        pipe.hdel(self._keys.adapters(), withdraw)
                    if checkpoint_record is not None:
                        pipe.rpush(
                            self._keys.ft_checkpoints(job_id),
                            msgspec.json.encode(checkpoint_record),
                        )
                    await pipe.execute()
                    return job
                except WatchError:
                    continue

    async def settle(self, job_id: str) -> None:
        """A terminal job whose stages are stopped and whose graph is closed: no longer
        active."""
        await self._redis.zrem(self._keys.ft_active(), job_id)

    # -- events and checkpoints -------------------------------------------------------------

    async def add_event(
        self,
        job_id: str,
        message: str,
        *,
        level: str = "info",
        data: dict[str, Any] | None = None,
    ) -> JobEvent:
        event = JobEvent(
            id=new_id("ftevent"),
            created_at=int(time.time()),
            level=level,
            message=message,
            type="metrics" if data else "message",
            data=data,
        )
        pipe = self._redis.pipeline(transaction=False)
        pipe.rpush(self._keys.ft_events(job_id), msgspec.json.encode(event))
        pipe.ltrim(self._keys.ft_events(job_id), -MAX_EVENTS, -1)
        await pipe.execute()
        return event

    async def events(self, job_id: str) -> list[JobEvent]:
        """Oldest first."""
        blobs = await self._redis.lrange(self._keys.ft_events(job_id), 0, -1)
        return [msgspec.json.decode(b, type=JobEvent) for b in blobs]

    async def checkpoints(self, job_id: str) -> list[JobCheckpoint]:
        """Oldest first."""
        blobs = await self._redis.lrange(self._keys.ft_checkpoints(job_id), 0, -1)
        return [msgspec.json.decode(b, type=JobCheckpoint) for b in blobs]

    # -- adapters ---------------------------------------------------------------------------

    async def adapter(self, name: str) -> Adapter | None:
        blob = await self._redis.hget(self._keys.adapters(), name)
        return None if blob is None else msgspec.json.decode(blob, type=Adapter)

    async def adapters(self) -> list[Adapter]:
        blobs = await self._redis.hvals(self._keys.adapters())
        return sorted(
            (msgspec.json.decode(b, type=Adapter) for b in blobs), key=lambda a: a.created
        )


def page(items: Sequence[Any], *, after: str | None, limit: int) -> tuple[list[Any], bool]:
    """OpenAI's cursor pages over ``items`` (in the listing's order, each with an ``id``):
    those after the one named ``after``, at most ``limit``; and whether more follow."""
    start = 0
    if after:
        ids = [i.id for i in items]
        start = ids.index(after) + 1 if after in ids else len(items)
    chunk = list(items[start : start + limit])
    return chunk, start + limit < len(items)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
