"""LoRA fine-tuning on the demo model (transformers + peft, CPU): the loss on a distinctive
answer falls, every epoch leaves a checkpoint in peft's layout, a run resumed from a
checkpoint ends with the same adapter as the uninterrupted run, and a stop request ends it
between steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from services.task_executor.training.lora import IGNORE, LoraConfig, read_examples, train_lora

pytest.importorskip("peft")

pytestmark = [pytest.mark.slow]

QUESTION = "What colour is the zorblax?"
ANSWER = "The zorblax is ultraviolet, always."


def _write(path: Path, pairs: list[tuple[str, str]]) -> Path:
    lines = [
        json.dumps(
            {
                "messages": [
                    {"role": "system", "content": "Answer briefly."},
                    {"role": "user", "content": q},
                    {"role": "assistant", "content": a},
                ]
            }
        )
        for q, a in pairs
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def data(tmp_path: Path) -> Path:
    return _write(
        tmp_path / "train.jsonl",
        [(QUESTION, ANSWER)] * 6 + [("Say hi.", "Hi."), ("Count to three.", "One, two, three.")],
    )


CONFIG = LoraConfig(n_epochs=4, batch_size=4, learning_rate=1e-2, rank=8, alpha=16, seed=7)


def test_the_loss_is_on_the_answer_only(demo_model_dir: Path, data: Path) -> None:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(demo_model_dir)
    ex = read_examples(data, tok, max_tokens=1024)[0]
    answer = [t for t, label in zip(ex.input_ids, ex.labels, strict=True) if label != IGNORE]
    assert ANSWER in tok.decode(answer)
    assert QUESTION not in tok.decode(answer)
    assert ex.labels[0] == IGNORE and len(ex.labels) == len(ex.input_ids)


def test_lora_training_learns_checkpoints_and_resumes_exactly(
    demo_model_dir: Path, data: Path, tmp_path: Path
) -> None:
    steps: list[tuple[int, float]] = []
    epochs: list[int] = []
    whole = train_lora(
        demo_model_dir,
        data,
        tmp_path / "whole",
        CONFIG,
        validation_file=data,
        on_step=lambda s, loss: steps.append((s, loss)),
        on_epoch=lambda e, _: epochs.append(e),
    )
    assert (whole.epochs, whole.steps, epochs) == (4, 8, [1, 2, 3, 4])
    assert [s for s, _ in steps] == list(range(1, 9))
    # The answer's loss falls (training and validation alike).
    assert sum(whole.train_losses[-2:]) < 0.7 * sum(whole.train_losses[:2])
    assert whole.valid_losses[-1] < 0.7 * whole.valid_losses[0]
    for e in (1, 2, 3, 4):
        ckpt = tmp_path / "whole" / f"epoch-{e}"
        assert (ckpt / "adapter_config.json").is_file()
        assert (ckpt / "adapter_model.safetensors").is_file()
    assert json.loads((whole.checkpoint / "adapter_config.json").read_text())["r"] == 8

    # One epoch, then resumed from its checkpoint: the same adapter in the end.
    first = train_lora(
        demo_model_dir, data, tmp_path / "cut", LoraConfig(**{**CONFIG.__dict__, "n_epochs": 1})
    )
    assert first.epochs == 1
    resumed = train_lora(
        demo_model_dir, data, tmp_path / "cut", CONFIG, resume_from=first.checkpoint
    )
    assert resumed.steps == 8 and resumed.checkpoint == tmp_path / "cut" / "epoch-4"
    a = load_file(str(whole.checkpoint / "adapter_model.safetensors"))
    b = load_file(str(resumed.checkpoint / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)


def test_a_stop_request_ends_training_between_steps(
    demo_model_dir: Path, data: Path, tmp_path: Path
) -> None:
    seen: list[int] = []
    run = train_lora(
        demo_model_dir,
        data,
        tmp_path / "stopped",
        CONFIG,
        on_step=lambda s, _: seen.append(s),
        should_stop=lambda: len(seen) >= 3,
    )
    assert run.steps == 3 and run.epochs == 1  # epoch 2 was cut: its checkpoint is epoch 1
    assert run.checkpoint == tmp_path / "stopped" / "epoch-1"
    assert not (tmp_path / "stopped" / "epoch-2").exists()
