"""Fine-tuning: the stages of a fine-tuning job a job executor places on idle TEs, and what
those TEs report back (``services/job_executor/fine_tuning.py``,
``services/task_executor/training/runner.py``)."""

from __future__ import annotations

import enum

import msgspec

from shared.messages.base import Message


class TrainStage(enum.StrEnum):
    """A fine-tuning job's tasks, in order (``planner.plan_fine_tune``)."""

    PREPROCESS = "preprocess"  # read the files with the model's tokenizer; resolve ``auto``
    TRAIN = "train"  # LoRA training, a checkpoint per epoch
    EVALUATE = "evaluate"  # the adapter's losses; publish it into the adapter store


class TrainParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A job's hyperparameters as the training runs them (``auto`` resolved by preprocess;
    0 before)."""

    n_epochs: int = 0
    batch_size: int = 0
    learning_rate: float = 0.0
    rank: int = 16
    alpha: int = 32
    seed: int = 0


class TrainTask(Message):
    """Run one stage of a fine-tuning job on an idle TE, which trains instead of serving
    until it ends. The TE reports on ``reply_to`` (``TrainProgress``, then ``TrainDone``)."""

    job_id: str
    stage: TrainStage
    attempt: int  # the job's attempt at this stage: its key on the TE
    model: str
    model_path: str  # the base model's checkpoint directory
    training_file: str  # paths of the uploaded files' bytes
    out_dir: str  # where this attempt writes its checkpoints (epoch-<n>/)
    validation_file: str = ""
    params: TrainParams = TrainParams()
    resume_from: str = ""  # a checkpoint of an earlier attempt to continue from
    adapter_dir: str = ""  # evaluate: where this attempt publishes the finished adapter
    reply_to: str = ""


class CancelTraining(Message):
    job_id: str
    attempt: int


class TrainAccepted(Message):
    te_id: str
    job_id: str
    attempt: int


class TrainProgress(Message):
    """A step (``train_loss``), an epoch's end (``checkpoint``, ``valid_loss``) or what
    preprocess found (``params``, ``examples``, ``tokens``)."""

    te_id: str
    job_id: str
    attempt: int
    stage: TrainStage
    step: int = 0
    total_steps: int = 0
    train_loss: float | None = None
    epoch: int = 0
    checkpoint: str = ""  # the epoch's checkpoint directory
    valid_loss: float | None = None
    params: TrainParams | None = None
    examples: int = 0
    tokens: int = 0  # training tokens per epoch


class TrainDone(Message):
    """A stage ended: ``ok``, or ``error`` (the job's reason; ``retryable``: the stage may run
    again elsewhere). ``cancelled``: stopped by ``CancelTraining``."""

    te_id: str
    job_id: str
    attempt: int
    stage: TrainStage
    ok: bool
    error: str = ""
    retryable: bool = False
    cancelled: bool = False
    checkpoint: str = ""  # train: the last epoch's checkpoint; evaluate: the published adapter
    steps: int = 0
    train_loss: float | None = None  # evaluate: the mean over the training file
    valid_loss: float | None = None  # evaluate: over the validation file


class FineTuneSubmitted(Message):
    """A job was created (or cancelled): job executors pick queued jobs up from Redis."""

    job_id: str
