"""The vLLM engine on a CUDA GPU. Skipped where no CUDA device or no vLLM is present (CI
has neither); run where the device tool lends a GPU."""

import importlib.util
from pathlib import Path

import pytest
import torch

from services.task_executor.engines.base import EngineRequest
from shared.messages.api import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (CUDA build) not installed"),
]


@pytest.fixture(scope="module")
def engine(demo_model_dir: Path):
    from services.task_executor.engines.vllm_engine import VLLMEngine

    e = VLLMEngine(demo_model_dir, dtype="float32", gpu_memory_fraction=0.3)
    yield e
    e.close()


def run(engine, reqs):
    for r in reqs:
        engine.add_request(r)
    out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    reasons = {}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    return out, reasons


def test_greedy_matches_transformers(engine, demo_model_dir: Path):
    from transformers import AutoModelForCausalLM

    prompt = [0, 17, 42, 99, 7, 301]
    out, reasons = run(engine, [EngineRequest("a", prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))])
    hf = AutoModelForCausalLM.from_pretrained(demo_model_dir, torch_dtype=torch.float32)
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert out["a"] == ref[0, len(prompt):].tolist()
    assert reasons["a"] == "length"


def test_batched_requests_stream_deltas(engine):
    reqs = [EngineRequest(f"r{i}", [0, 5 + i, 6, 7], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
            for i in range(4)]
    out, reasons = run(engine, reqs)
    assert all(len(v) == 8 for v in out.values())
    assert set(reasons.values()) == {"length"}


def test_seeded_sampling_is_reproducible(engine):
    p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    a, _ = run(engine, [EngineRequest("s1", [0, 9, 8, 7], p)])
    b, _ = run(engine, [EngineRequest("s2", [0, 9, 8, 7], p)])
    assert a["s1"] == b["s2"]
