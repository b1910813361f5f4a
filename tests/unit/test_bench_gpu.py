"""scripts/bench_gpu.py where no GPU is needed: one batch run's phases on a real engine (the
torch engine on CPU), the ratios of its summary, and its arguments."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_gpu
from bench_common import prompts_for

from services.task_executor.engines.torch_engine import TorchEngine
from tests.unit.test_torch_engine import VOCAB, _write_tiny_llama


def test_a_batch_run_splits_the_first_tokens_from_the_decode(tmp_path: Path) -> None:
    engine = TorchEngine(_write_tiny_llama(tmp_path / "m"), device="cpu", num_kv_blocks=64)
    prompts = prompts_for(3, 20, VOCAB, seed=0)
    ttft, decode_s, decode_tokens = bench_gpu.batch_run(engine, prompts, 6)
    # One prefill iteration gives every request its first token; the other 5 each decode.
    assert ttft > 0 and decode_s > 0 and decode_tokens == 3 * 5
    assert not engine.has_work()


def test_weight_bytes_are_what_a_decode_step_streams(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    path = _write_tiny_llama(tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    # Tied embeddings: the table is read once, as the LM head.
    n = sum(t.numel() for t in tensors.values())
    assert bench_gpu.weight_bytes(path, torch.bfloat16) == 2 * n
    assert bench_gpu.weight_bytes(path, torch.float32) == 4 * n


def test_ratios_pair_rows_of_the_same_batch() -> None:
    rows = [
        {"engine": e, "batch": b, "decode_tok_s": tok, "ttft_ms": ttft}
        for e, b, tok, ttft in [
            ("torch", 1, 50.0, 20.0), ("vllm", 1, 500.0, 25.0),
            ("torch", 8, 400.0, 40.0), ("torch-sync", 8, 380.0, 44.0),
        ]
    ]  # fmt: skip
    assert bench_gpu.ratios(rows, "torch", "vllm") == [
        {"ratio": "torch / vllm", "batch": 1, "decode": 0.1, "ttft": 0.8}
    ]
    [sync] = bench_gpu.ratios(rows, "torch", "torch-sync")
    assert sync["batch"] == 8 and sync["decode"] == pytest.approx(400 / 380)


def test_unknown_engines_are_refused() -> None:
    with pytest.raises(SystemExit):
        bench_gpu.parse_args(["--engines", "torch,tgi"])
    assert bench_gpu.parse_args(["--engines", "torch"]).engines == ["torch"]
