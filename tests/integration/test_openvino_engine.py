"""Behaviour of the OpenVINO GenAI engine a TE would notice: the same greedy tokens as
transformers, token-by-token streaming, seeded sampling, stop rules, abort, prefix caching, the
KV cache budget; and the converter's one-time, atomic export.

The demo model is exported once per session (fp16 weights, ~12 s; the first run on a machine
also builds the exporter's venv, about a minute). The engines here compute in f32 with an f32
KV cache, where OpenVINO's greedy tokens equal transformers' float32 ones.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from services.task_executor.engines.base import EngineOutput, EngineRequest
from services.task_executor.engines.openvino_engine import OpenVINOEngine
from services.task_executor.engines.openvino_engine.convert import (
    STAMP,
    ConversionError,
    ensure_ir,
)
from services.task_executor.engines.openvino_engine.engine import load_ir_config
from shared.messages.api import SamplingParams
from tests.engines import drain, tokens

# Converts the checkpoint to IR with optimum-intel in its own venv (built on first use).
pytestmark = pytest.mark.openvino

EXACT = {"inference_precision": "f32", "kv_cache_precision": "f32"}


@pytest.fixture(scope="session")
def ov_ir(demo_model_dir: Path) -> Path:
    return ensure_ir(demo_model_dir, "fp16")


def _engine(ir: Path, **kwargs: object) -> OpenVINOEngine:
    kwargs = {"max_num_seqs": 8, "kv_cache_bytes": 8 << 20, **EXACT, **kwargs}
    return OpenVINOEngine(ir.parent.parent, ir_dir=ir, **kwargs)  # type: ignore[arg-type]


def greedy(max_tokens: int, **kwargs: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kwargs)  # type: ignore[arg-type]


def _prompts(
    n: int, seed: int = 0, lengths: tuple[int, ...] = (5, 12, 31, 33, 64, 7)
) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(4, 4000, (lengths[i % len(lengths)],), generator=gen).tolist()
        for i in range(n)
    ]


def _run_alone(
    ir: Path, prompt: list[int], params: SamplingParams, **kwargs: object
) -> list[EngineOutput]:
    engine = _engine(ir, **kwargs)
    engine.add_request(EngineRequest("r", prompt, params))
    try:
        return drain(engine)["r"]
    finally:
        engine.close()


def _first_new(tokens: list[int], start: int = 2) -> int:
    """An index whose token does not occur before it (a stop token that cuts exactly there)."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


# --- correctness ---------------------------------------------------------------------------


def test_greedy_tokens_equal_transformers_in_a_continuous_batch(ov_ir: Path) -> None:
    import transformers

    n_new = 24
    prompts = _prompts(6)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        ov_ir.parent.parent, dtype=torch.float32
    ).eval()
    expected = []
    with torch.inference_mode():
        for p in prompts:
            # A plain argmax loop: generate() would suppress or stop on EOS differently.
            out = hf(torch.tensor([p]), use_cache=True)
            toks = [int(out.logits[0, -1].argmax())]
            while len(toks) < n_new:
                out = hf(
                    torch.tensor([toks[-1:]]), past_key_values=out.past_key_values, use_cache=True
                )
                toks.append(int(out.logits[0, -1].argmax()))
            expected.append(toks)

    engine = _engine(ov_ir)
    # Half join while the others are decoding: continuous batching must not change tokens.
    for i, p in enumerate(prompts[:3]):
        engine.add_request(EngineRequest(str(i), p, greedy(n_new)))
    outs: dict[str, list[EngineOutput]] = {}
    for _ in range(3):
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    for i, p in enumerate(prompts[3:], start=3):
        engine.add_request(EngineRequest(str(i), p, greedy(n_new)))
    for rid, seq in drain(engine).items():
        outs.setdefault(rid, []).extend(seq)
    assert [tokens(outs[str(i)]) for i in range(len(prompts))] == expected
    assert all(outs[str(i)][-1].finish_reason == "length" for i in range(len(prompts)))
    engine.close()


def test_tokens_stream_one_per_step_after_the_prefill(ov_ir: Path) -> None:
    engine = _engine(ov_ir)
    prompts = _prompts(2, seed=1)
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(str(i), p, greedy(6)))
    per_step = []
    while engine.has_work():
        per_step.append({o.request_id: o for o in engine.step()})
    assert len(per_step) == 6
    for n, step in enumerate(per_step):
        assert set(step) == {"0", "1"}
        for o in step.values():
            assert len(o.new_token_ids) == 1
            assert o.finished == (n == 5)
            assert o.num_prompt_tokens == len(prompts[int(o.request_id)])
    engine.close()


def test_seeded_sampling_is_reproducible_alone_or_batched(ov_ir: Path) -> None:
    prompt = _prompts(1, seed=2)[0]
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = tokens(_run_alone(ov_ir, prompt, params))

    engine = _engine(ov_ir)
    for i, p in enumerate(_prompts(3, seed=3)):
        engine.add_request(
            EngineRequest(f"other{i}", p, SamplingParams(max_tokens=12, temperature=1.0, seed=i))
        )
    engine.add_request(EngineRequest("r", prompt, params))
    batched = tokens(drain(engine)["r"])
    engine.close()
    assert batched == alone
    other_seed = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True)
    assert tokens(_run_alone(ov_ir, prompt, other_seed)) != alone


# --- stop rules ----------------------------------------------------------------------------


def test_max_tokens_finishes_with_length(ov_ir: Path) -> None:
    outs = _run_alone(ov_ir, _prompts(1)[0], greedy(5))
    assert len(tokens(outs)) == 5
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert not any(o.finished for o in outs[:-1])


def test_generation_is_clipped_at_max_model_len(ov_ir: Path) -> None:
    engine = _engine(ov_ir, max_model_len=40)
    engine.add_request(EngineRequest("a", _prompts(1)[0][:5] * 6, greedy(100)))  # 30 tokens
    outs = drain(engine)["a"]
    assert len(tokens(outs)) == 10
    assert outs[-1].finish_reason == "length"


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_stop_token_ids_finish_with_stop(ov_ir: Path, ignore_eos: bool) -> None:
    prompt = _prompts(1, seed=4)[0]
    free_run = tokens(_run_alone(ov_ir, prompt, greedy(12)))
    i = _first_new(free_run)
    params = SamplingParams(
        max_tokens=12, temperature=0, stop_token_ids=[free_run[i]], ignore_eos=ignore_eos
    )
    outs = _run_alone(ov_ir, prompt, params)
    assert tokens(outs) == free_run[: i + 1]
    assert outs[-1].finished and outs[-1].finish_reason == "stop"


def test_eos_finishes_with_stop_unless_ignored(ov_ir: Path, tmp_path: Path) -> None:
    prompt = _prompts(1, seed=5)[0]
    free_run = tokens(_run_alone(ov_ir, prompt, greedy(12)))
    i = _first_new(free_run)
    # The same IR, with the token greedy decoding reaches at step i declared EOS.
    eos_ir = tmp_path / "openvino" / "fp16"
    shutil.copytree(ov_ir, eos_ir, symlinks=True)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((eos_ir / name).read_text())
        cfg["eos_token_id"] = [free_run[i]]
        (eos_ir / name).write_text(json.dumps(cfg))
    assert load_ir_config(eos_ir).eos_token_ids == {free_run[i]}

    engine = _engine(eos_ir)
    engine.add_request(EngineRequest("a", prompt, SamplingParams(max_tokens=12, temperature=0)))
    engine.add_request(EngineRequest("x", prompt, greedy(12)))
    outs = drain(engine)
    engine.close()
    assert tokens(outs["a"]) == free_run[: i + 1]
    assert outs["a"][-1].finish_reason == "stop"
    assert tokens(outs["x"]) == free_run
    assert outs["x"][-1].finish_reason == "length"


# --- abort, cache, stats -------------------------------------------------------------------


def test_abort_stops_a_request_and_frees_its_blocks(ov_ir: Path) -> None:
    engine = _engine(ov_ir, enable_prefix_caching=False)
    total = engine.stats().total_kv_blocks
    a, b = _prompts(2, seed=6, lengths=(100, 40))
    engine.add_request(EngineRequest("a", a, greedy(30)))
    engine.add_request(EngineRequest("b", b, greedy(5)))
    engine.step()
    engine.step()
    assert engine.stats().free_kv_blocks < total
    engine.abort("a")
    engine.abort("never-added")  # ignored
    outs = drain(engine)
    assert set(outs) == {"b"} and outs["b"][-1].finish_reason == "length"
    assert engine.stats().free_kv_blocks == total  # a's blocks came back

    engine.add_request(EngineRequest("d", a, greedy(30)))
    engine.step()
    engine.abort("d")
    assert engine.has_work()  # the pipeline retires it at its next step
    assert engine.step() == []
    assert not engine.has_work()
    engine.close()


def test_repeated_long_prompt_hits_the_prefix_cache(ov_ir: Path) -> None:
    # Prefill runs in chunks of 32 tokens, so a 256-token prompt needs 8 steps to its first
    # token, unless its blocks are already cached.
    prompt = _prompts(1, seed=7, lengths=(256,))[0]
    engine = _engine(ov_ir, max_num_batched_tokens=32)

    def steps_to_first_token(rid: str) -> tuple[int, list[int]]:
        engine.add_request(EngineRequest(rid, prompt, greedy(4)))
        steps = 0
        first = None
        tokens: list[int] = []
        while engine.has_work():
            steps += 1
            for o in engine.step():
                first = first or steps
                tokens += o.new_token_ids
        assert first is not None
        return first, tokens

    cold, cold_tokens = steps_to_first_token("cold")
    warm, warm_tokens = steps_to_first_token("warm")
    assert cold == 8
    assert warm == 1
    assert warm_tokens == cold_tokens
    # It caches prefixes, but GenAI does not say what its cache holds: no events to promise.
    assert engine.capabilities.prefix_cache and not engine.capabilities.kv_events
    engine.close()


def test_requests_the_engine_can_never_serve_are_rejected(ov_ir: Path) -> None:
    engine = _engine(ov_ir, max_model_len=64)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(EngineRequest("a", [], greedy(4)))
    with pytest.raises(ValueError, match="prompt tokens"):
        engine.add_request(EngineRequest("a", [5] * 64, greedy(4)))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request(EngineRequest("a", [5, 4096], greedy(4)))
    with pytest.raises(ValueError, match="top_p"):
        engine.add_request(EngineRequest("a", [5], SamplingParams(max_tokens=4, top_p=0)))
    engine.add_request(EngineRequest("a", [5, 6], greedy(4)))
    with pytest.raises(ValueError, match="already"):
        engine.add_request(EngineRequest("a", [5, 6], greedy(4)))
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.add_request(EngineRequest("b", [5, 6], greedy(4)))


# f32 inference needs an f32 cache; None is the plugin's own choice (bf16 where the CPU has it).
@pytest.mark.parametrize(("inference", "kv"), [("f32", "f32"), (None, None), (None, "u8")])
def test_kv_cache_takes_the_budget_it_is_given(
    ov_ir: Path, inference: str | None, kv: str | None
) -> None:
    budget = 3 << 20
    engine = _engine(
        ov_ir, kv_cache_bytes=budget, inference_precision=inference, kv_cache_precision=kv
    )
    engine.add_request(EngineRequest("a", [5, 6, 7], greedy(1)))
    drain(engine)
    allocated = engine.kv_cache_bytes_allocated()
    assert allocated == engine.num_kv_blocks * engine.block_bytes
    assert budget - engine.block_bytes < allocated <= budget
    assert engine.max_model_len == engine.num_kv_blocks * engine.block_size
    engine.close()


# --- conversion ----------------------------------------------------------------------------


def test_the_compiled_model_cache_is_written_and_changes_no_output(
    ov_ir: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "compiled"
    expected = _run_alone(ov_ir, [5, 17, 42, 8], greedy(6))
    first = _run_alone(ov_ir, [5, 17, 42, 8], greedy(6), model_cache=cache)
    assert list(cache.glob("*.blob")), "the load stored its compiled model"
    again = _run_alone(ov_ir, [5, 17, 42, 8], greedy(6), model_cache=cache)
    tokens = [[t for o in outs for t in o.new_token_ids] for outs in (expected, first, again)]
    assert tokens[0] == tokens[1] == tokens[2]


def test_conversion_happens_once_and_leaves_a_complete_ir(
    ov_ir: Path, demo_model_dir: Path
) -> None:
    assert ov_ir == demo_model_dir / "openvino" / "fp16"
    for name in (
        "openvino_model.xml",
        "openvino_model.bin",
        "openvino_tokenizer.xml",
        "openvino_detokenizer.xml",
        "generation_config.json",
        STAMP,
    ):
        assert (ov_ir / name).is_file(), name
    stamp = json.loads((ov_ir / STAMP).read_text())
    assert stamp["weight_format"] == "fp16"
    # Present: returned as is, without running the exporter (which would fail here).
    assert ensure_ir(demo_model_dir, "fp16", python="/bin/false") == ov_ir


def test_a_failed_conversion_leaves_nothing_behind(demo_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "ir" / "int8"
    with pytest.raises(ConversionError):
        ensure_ir(demo_model_dir, "int8", out_dir=out, python="/bin/false")
    assert not out.exists()
    assert [p.name for p in out.parent.iterdir()] == [".int8.lock"]
    with pytest.raises(ValueError, match="weight_format"):
        ensure_ir(demo_model_dir, "bf16")
