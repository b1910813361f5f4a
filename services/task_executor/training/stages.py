"""The stages of a fine-tuning job as a TE runs them (``TrainTask``), on its engine thread:
synchronous, reporting progress through ``report`` (called on that thread).

- preprocess: reads the training and validation files with the base model's own tokenizer
  and chat template (a file the template cannot render fails the job here, before any
  training), and resolves the ``auto`` hyperparameters from the data's size;
- train: ``lora.train_lora``, resumed from the job's last epoch checkpoint when there is one;
- evaluate: the finished adapter's mean loss per answer token on both files, and the
  adapter published, whole or not at all, in a directory of the attempt's own (TrainDone's
  ``checkpoint``), where TEs of the base model load it from once the job succeeds."""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from services.task_executor.training.lora import (
    LoraConfig,
    fast_dtype,
    mean_loss,
    read_examples,
    train_lora,
)
from shared.fine_tuning import BASE_LEARNING_RATE
from shared.messages.training import TrainDone, TrainParams, TrainProgress, TrainStage, TrainTask

Report = Callable[[TrainProgress], None]
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
MAX_AUTO_EPOCHS = 10


def auto_params(asked: TrainParams, examples: int) -> TrainParams:
    """``auto`` (0) resolved from the number of examples: enough epochs that a small file is
    seen about a hundred times in all (3 to 10), batches of about a sixteenth of it (1 to
    8), the base learning rate."""
    n_epochs = asked.n_epochs or min(MAX_AUTO_EPOCHS, max(3, math.ceil(100 / max(examples, 1))))
    batch_size = asked.batch_size or max(1, min(8, examples // 16))
    lr = asked.learning_rate or BASE_LEARNING_RATE
    return TrainParams(
        n_epochs=n_epochs,
        batch_size=batch_size,
        learning_rate=lr,
        rank=asked.rank,
        alpha=asked.alpha,
        seed=asked.seed,
    )


def stage_done(task: TrainTask, te_id: str, **fields: Any) -> TrainDone:
    """The stage's end, as its TE reports it."""
    return TrainDone(
        te_id=te_id, job_id=task.job_id, attempt=task.attempt, stage=task.stage, **fields
    )


def _progress(task: TrainTask, te_id: str, **fields: Any) -> TrainProgress:
    return TrainProgress(
        te_id=te_id, job_id=task.job_id, attempt=task.attempt, stage=task.stage, **fields
    )


def _config(p: TrainParams, max_tokens: int, precision: str) -> LoraConfig:
    if precision == "auto":
        autocast = fast_dtype(_device())
    else:
        autocast = None if precision == "float32" else getattr(torch, precision)
    return LoraConfig(
        autocast=autocast,
        n_epochs=p.n_epochs,
        batch_size=p.batch_size,
        learning_rate=p.learning_rate,
        rank=p.rank,
        alpha=p.alpha,
        seed=p.seed,
        max_tokens=max_tokens,
    )


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def run_stage(
    task: TrainTask,
    te_id: str,
    report: Report,
    should_stop: Callable[[], bool],
    max_tokens: int = 1024,
    precision: str = "auto",
) -> TrainDone:
    """One stage; a failure of the data or the model is returned as the job's reason."""
    try:
        if task.stage == TrainStage.PREPROCESS:
            return _preprocess(task, te_id, report, max_tokens)
        if task.stage == TrainStage.TRAIN:
            return _train(
                task, te_id, report, should_stop, _config(task.params, max_tokens, precision)
            )
        return _evaluate(task, te_id, should_stop, max_tokens)
    except (ValueError, KeyError, OSError) as e:  # the data, the template, the files
        return stage_done(task, te_id, ok=False, error=f"{task.stage} failed: {e}")


def _tokenizer(model_path: str) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_path)


def _preprocess(task: TrainTask, te_id: str, report: Report, max_tokens: int) -> TrainDone:
    tok = _tokenizer(task.model_path)
    train = read_examples(Path(task.training_file), tok, max_tokens)
    if task.validation_file:
        read_examples(Path(task.validation_file), tok, max_tokens)
    if not train:
        return stage_done(task, te_id, ok=False, error="the training file holds no example")
    params = auto_params(task.params, len(train))
    tokens = sum(len(e.input_ids) for e in train)
    report(_progress(task, te_id, params=params, examples=len(train), tokens=tokens))
    return stage_done(task, te_id, ok=True)


def _train(
    task: TrainTask,
    te_id: str,
    report: Report,
    should_stop: Callable[[], bool],
    config: LoraConfig,
) -> TrainDone:
    p = task.params
    out = Path(task.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    examples = sum(1 for line in Path(task.training_file).read_text().splitlines() if line.strip())
    total = p.n_epochs * math.ceil(examples / p.batch_size)

    last: list[Any] = [0, None]  # the latest step and its loss

    def on_step(step: int, loss: float) -> None:
        last[:] = [step, loss]
        report(_progress(task, te_id, step=step, total_steps=total, train_loss=loss))

    def on_epoch(epoch: int, valid_loss: float | None) -> None:
        checkpoint = str(out / f"epoch-{epoch}")
        report(
            _progress(
                task,
                te_id,
                epoch=epoch,
                step=last[0],
                train_loss=last[1],
                checkpoint=checkpoint,
                valid_loss=valid_loss,
            )
        )

    trained = train_lora(
        Path(task.model_path),
        Path(task.training_file),
        out,
        config,
        validation_file=Path(task.validation_file) if task.validation_file else None,
        resume_from=Path(task.resume_from) if task.resume_from else None,
        device=_device(),
        on_step=on_step,
        on_epoch=on_epoch,
        should_stop=should_stop,
    )
    if trained.epochs < p.n_epochs:
        return stage_done(task, te_id, ok=False, cancelled=True, steps=trained.steps)
    return stage_done(task, te_id, ok=True, checkpoint=str(trained.checkpoint), steps=trained.steps)


def _evaluate(
    task: TrainTask, te_id: str, should_stop: Callable[[], bool], max_tokens: int
) -> TrainDone:
    import peft
    import transformers

    checkpoint = Path(task.resume_from)
    tok = _tokenizer(task.model_path)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    base: Any = transformers.AutoModelForCausalLM.from_pretrained(
        task.model_path, dtype=torch.float32
    )
    model = peft.PeftModel.from_pretrained(base.to(_device()), checkpoint)
    batch = max(task.params.batch_size, 1)

    def loss_of(path: str) -> float | None:
        if not path:
            return None
        examples = read_examples(Path(path), tok, max_tokens)
        return mean_loss(model, examples, batch, pad_id, _device())

    train_loss, valid_loss = loss_of(task.training_file), loss_of(task.validation_file)
    if should_stop():  # cancelled: nothing published
        return stage_done(task, te_id, ok=False, cancelled=True)
    publish_adapter(checkpoint, Path(task.adapter_dir))
    return stage_done(
        task,
        te_id,
        ok=True,
        checkpoint=task.adapter_dir,
        train_loss=train_loss,
        valid_loss=valid_loss,
    )


def publish_adapter(checkpoint: Path, target: Path) -> None:
    """The adapter's files copied to ``target`` whole: into a temporary directory beside it,
    then renamed over it (a reader sees the old adapter or the new one, never part)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    for name in ADAPTER_FILES:
        shutil.copyfile(checkpoint / name, staging / name)
    if target.exists():
        shutil.rmtree(target)
    os.replace(staging, target)
