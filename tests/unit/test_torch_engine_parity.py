"""The torch engine computes the same next-token logits as Hugging Face transformers.

Each case builds a tiny random checkpoint with transformers (GQA, a non-default rope_theta),
runs a batch of prompts of different lengths through the engine's real iteration (schedule,
forward over the paged cache, advance), and compares every request's logits with those of
transformers on the same tokens, at the prefill and after each of several decode steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from services.task_executor.engines.base import EngineRequest  # noqa: E402
from services.task_executor.engines.torch_engine import TorchEngine  # noqa: E402
from services.task_executor.engines.torch_engine.kv_cache import PagedKVCache  # noqa: E402
from services.task_executor.engines.torch_engine.model import SeqChunk, build_batch  # noqa: E402
from shared.messages.api import SamplingParams  # noqa: E402

TOL = 1e-3
VOCAB = 512
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)


def _save(model: torch.nn.Module, out: Path, **save_kwargs: object) -> Path:
    # The default init (std 0.02, unit norms, zero biases) gives near-uniform logits that
    # would hide mistakes; wider random weights give logits of order 1-10, and random norms
    # and biases make those code paths count.
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out, safe_serialization=True, **save_kwargs)
    return out


def _llama_llama3_rope(out: Path) -> Path:
    cfg = transformers.LlamaConfig(
        **COMMON,
        rope_theta=50_000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        tie_word_embeddings=False,
    )
    return _save(transformers.LlamaForCausalLM(cfg), out)


def _qwen2_bias_tied(out: Path) -> Path:
    cfg = transformers.Qwen2Config(**COMMON, rope_theta=1_000_000.0, tie_word_embeddings=True)
    model = transformers.Qwen2ForCausalLM(cfg)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    return _save(model, out)


def _llama_linear_rope(out: Path) -> Path:
    cfg = transformers.LlamaConfig(
        **COMMON, rope_theta=20_000.0, rope_scaling={"rope_type": "linear", "factor": 2.0}
    )
    # Sharded, so the loader follows model.safetensors.index.json.
    _save(transformers.LlamaForCausalLM(cfg), out, max_shard_size="100KB")
    assert (out / "model.safetensors.index.json").is_file()
    return out


CHECKPOINTS = {
    "llama-llama3-rope": _llama_llama3_rope,
    "qwen2-bias-tied": _qwen2_bias_tied,
    "llama-linear-rope": _llama_linear_rope,
}


@pytest.fixture(params=sorted(CHECKPOINTS))
def checkpoint(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    return CHECKPOINTS[request.param](tmp_path / request.param)


def _hf_next_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0, -1].float()


def test_logits_match_transformers_in_a_batch_through_decode(checkpoint: Path) -> None:
    torch.manual_seed(1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    # Prompts of different lengths, some spanning several blocks, so padding and block
    # boundaries are exercised.
    prompts = [torch.randint(0, VOCAB, (n,)).tolist() for n in (7, 1, 23, 16)]
    engine = TorchEngine(checkpoint, device="cpu", dtype="float32", block_size=4, num_kv_blocks=64)
    for i, prompt in enumerate(prompts):
        greedy = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
        engine.add_request(EngineRequest(f"r{i}", prompt, greedy))

    sequences = {f"r{i}": list(p) for i, p in enumerate(prompts)}
    for step in range(6):
        scheduled = engine._schedule()
        assert len(scheduled) == len(prompts)
        logits = engine._forward(scheduled)
        for row, req in enumerate(scheduled):
            expected = _hf_next_logits(hf, sequences[req.request_id])
            diff = (logits[row] - expected).abs().max().item()
            assert diff <= TOL, f"step {step}, {req.request_id}: max abs diff {diff}"
        for out in engine._advance(scheduled, logits):
            sequences[out.request_id].extend(out.new_token_ids)
    engine.close()


def test_prefill_over_a_cached_prefix_matches_one_pass(checkpoint: Path) -> None:
    # The path chunked prefill and prefix caching use: the second half of a prompt attends
    # to K/V the first half left in the cache.
    engine = TorchEngine(checkpoint, device="cpu", dtype="float32", block_size=4, num_kv_blocks=16)
    prompt = torch.randint(0, VOCAB, (13,), generator=torch.Generator().manual_seed(2)).tolist()
    blocks = list(range(4))
    cache: PagedKVCache = engine.cache
    runner, dev = engine.runner, torch.device("cpu")

    whole = runner.forward(
        build_batch([SeqChunk(prompt, 0, blocks)], block_size=4, device=dev), cache
    )
    runner.forward(build_batch([SeqChunk(prompt[:6], 0, blocks)], block_size=4, device=dev), cache)
    rest = runner.forward(
        build_batch([SeqChunk(prompt[6:], 6, blocks)], block_size=4, device=dev), cache
    )
    assert (whole - rest).abs().max().item() <= TOL
    engine.close()
