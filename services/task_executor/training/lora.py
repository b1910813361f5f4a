"""LoRA fine-tuning of a checkpoint on a chat-format JSONL file (``shared.file_store``), with
Hugging Face ``transformers`` and ``peft`` on torch: CPU here, CUDA where present.

Each example is the model's own chat template over its messages; the loss is on the tokens
of its last assistant message only (what the model should learn to answer), the rest of the
conversation is context. Batches are padded on the right. The order of the examples in each
epoch comes from ``seed`` and the epoch number alone, and every epoch ends with a checkpoint
(``epoch-<n>/``: the adapter in peft's layout, ``adapter_config.json`` +
``adapter_model.safetensors``, and ``trainer.pt``: the optimizer's state and the step), so a
run resumed from a checkpoint continues exactly as the uninterrupted run would have.

Progress goes to ``on_step(step, train_loss)`` and ``on_epoch(epoch, valid_loss)``;
``should_stop()`` is asked between steps (a cancel, or serving's need for the device)."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

IGNORE = -100  # labels the loss skips


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    n_epochs: int = 3
    batch_size: int = 4
    learning_rate: float = 2e-4
    rank: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    max_tokens: int = 1024  # an example longer than this is cut (its answer first kept)
    seed: int = 0
    # The forward and backward in this dtype under autocast (the adapter's weights and the
    # optimizer stay float32); None: all float32.
    autocast: torch.dtype | None = None


@dataclasses.dataclass(frozen=True)
class Example:
    input_ids: list[int]
    labels: list[int]  # IGNORE where no loss is taken


@dataclasses.dataclass
class Trained:
    """What a run did: the last epoch's checkpoint, and the losses it saw."""

    checkpoint: Path
    epochs: int
    steps: int
    train_losses: list[float]  # per step
    valid_losses: list[float]  # per epoch (empty without a validation file)


def read_examples(path: Path, tokenizer: Any, max_tokens: int) -> list[Example]:
    """The file's conversations as token ids, the loss on each one's last assistant turn."""
    examples = []
    for raw in path.read_text(encoding="utf-8").splitlines():
        if not raw.strip():
            continue
        messages = json.loads(raw)["messages"]
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        context = tokenizer.apply_chat_template(
            messages[:last], tokenize=True, add_generation_prompt=True
        )
        whole = tokenizer.apply_chat_template(messages[: last + 1], tokenize=True)
        context, whole = _ids(context), _ids(whole)
        if whole[: len(context)] != context:  # a template that rewrites earlier turns
            raise ValueError("the chat template does not extend a conversation's prefix")
        answer = whole[len(context) :]
        keep = max(max_tokens - len(answer), 1)
        context = context[-keep:]
        ids = (context + answer)[:max_tokens]
        labels = ([IGNORE] * len(context) + answer)[:max_tokens]
        examples.append(Example(ids, labels))
    return examples


def _ids(out: Any) -> list[int]:
    """``apply_chat_template``'s token ids (a list, or a mapping with ``input_ids``)."""
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(t) for t in out]


def _batches(examples: Sequence[Example], size: int, seed: int, epoch: int) -> list[list[Example]]:
    order = list(range(len(examples)))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return [[examples[i] for i in order[k : k + size]] for k in range(0, len(order), size)]


def _tensors(batch: Sequence[Example], pad_id: int) -> dict[str, torch.Tensor]:
    n = max(len(e.input_ids) for e in batch)
    ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), n), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(batch), n), dtype=torch.long)
    for i, e in enumerate(batch):
        ids[i, : len(e.input_ids)] = torch.tensor(e.input_ids)
        labels[i, : len(e.labels)] = torch.tensor(e.labels)
        mask[i, : len(e.input_ids)] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def train_lora(
    model_dir: Path,
    train_file: Path,
    out_dir: Path,
    config: LoraConfig,
    *,
    validation_file: Path | None = None,
    resume_from: Path | None = None,
    device: str = "cpu",
    on_step: Callable[[int, float], None] | None = None,
    on_epoch: Callable[[int, float | None], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> Trained:
    """Train a LoRA adapter of ``model_dir`` on ``train_file``; a checkpoint per epoch under
    ``out_dir``. ``resume_from``: an ``epoch-<n>`` checkpoint of this very run (same file,
    same config) to continue from."""
    import peft
    import transformers

    torch.manual_seed(config.seed)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    train = read_examples(train_file, tokenizer, config.max_tokens)
    valid = read_examples(validation_file, tokenizer, config.max_tokens) if validation_file else []
    base: Any = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base.to(device)
    first_epoch, step = 1, 0
    if resume_from is not None:
        model = peft.PeftModel.from_pretrained(base, resume_from, is_trainable=True)
        state = torch.load(resume_from / "trainer.pt", weights_only=True)
        first_epoch, step = int(state["epoch"]) + 1, int(state["step"])
    else:
        lora = peft.LoraConfig(
            r=config.rank,
            lora_alpha=config.alpha,
            lora_dropout=config.dropout,
            target_modules=list(config.target_modules),
            task_type="CAUSAL_LM",
        )
        model = peft.get_peft_model(base, lora)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate)
    if resume_from is not None:
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
    train_losses: list[float] = []
    valid_losses: list[float] = []
    checkpoint = resume_from or out_dir
    for epoch in range(first_epoch, config.n_epochs + 1):
        model.train()
        for batch in _batches(train, config.batch_size, config.seed, epoch):
            if should_stop is not None and should_stop():
                return Trained(checkpoint, epoch - 1, step, train_losses, valid_losses)
            inputs = {k: v.to(device) for k, v in _tensors(batch, pad_id).items()}
            with _autocast(device, config.autocast):
                loss = model(**inputs).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            train_losses.append(float(loss.detach()))
            if on_step is not None:
                on_step(step, train_losses[-1])
        valid_loss = (
            mean_loss(model, valid, config.batch_size, pad_id, device, config.autocast)
            if valid
            else None
        )
        if valid_loss is not None:
            valid_losses.append(valid_loss)
        checkpoint = out_dir / f"epoch-{epoch}"
        model.save_pretrained(str(checkpoint))
        torch.save(
            {
                "epoch": epoch,
                "step": step,
                "optimizer": optimizer.state_dict(),
                "rng": torch.get_rng_state(),
            },
            checkpoint / "trainer.pt",
        )
        if on_epoch is not None:
            on_epoch(epoch, valid_loss)
    return Trained(checkpoint, config.n_epochs, step, train_losses, valid_losses)


def _autocast(device: str, dtype: torch.dtype | None) -> Any:
    return torch.autocast(device.split(":")[0], dtype=dtype, enabled=dtype is not None)


def fast_dtype(device: str) -> torch.dtype | None:
    """bfloat16 where the device computes it natively (CUDA that supports it; a CPU with AMX
    or AVX-512 BF16: about 2x fp32's training rate on the Qwen2-0.5B shape, 2-core AMX
    Xeon), else None (float32)."""
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    from shared.native import cpu_flags

    flags = cpu_flags().split()
    return torch.bfloat16 if "amx_bf16" in flags or "avx512_bf16" in flags else None


@torch.no_grad()
def mean_loss(
    model: Any,
    examples: Sequence[Example],
    batch_size: int,
    pad_id: int,
    device: str,
    autocast: torch.dtype | None = None,
) -> float:
    """The mean loss per answer token over ``examples``."""
    model.eval()
    total, tokens = 0.0, 0
    for k in range(0, len(examples), batch_size):
        batch = examples[k : k + batch_size]
        inputs = {key: v.to(device) for key, v in _tensors(batch, pad_id).items()}
        n = int((inputs["labels"][:, 1:] != IGNORE).sum())
        with _autocast(device, autocast):
            total += float(model(**inputs).loss) * n
        tokens += n
    model.train()
    return total / tokens if tokens else math.nan
