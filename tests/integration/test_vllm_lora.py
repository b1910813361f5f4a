"""LoRA adapters in the vLLM engine, served by vLLM's own multi-LoRA support, as a TE runs it: in
a child process of the interpreter that has vLLM (see ``test_vllm_engine.py``). An adapter's
greedy tokens are those of peft's merged model (transformers, fp32: vLLM runs the model and
the adapter in fp32 here); a batch mixing the base model and adapters gives each request what
it gets alone (on CPU, where vLLM's LoRA ops would apply an adapter to the base requests of
such a batch, the engine runs the two kinds apart: ``vllm_engine.py``); an adapter that is not
loaded is refused. The adapters are made with peft, A and B random (peft starts B at zero,
which would change nothing)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from services.task_executor.engines.base import EngineRequest
from services.task_executor.engines.capabilities import bind_features
from services.task_executor.engines.process import ProcessEngine
from shared.messages.api import SamplingParams
from tests.engines import drain, tokens

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

PROMPTS = {"p1": [0, 17, 42, 99, 7, 301], "p2": [0, 5, 6, 7, 8, 250, 9]}
NEW = 16
MAX_MODEL_LEN = 1024
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _base_model(model_dir: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _make_adapter(model_dir: Path, out: Path, seed: int, rank: int = 8) -> Path:
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0)
    model = peft.get_peft_model(_base_model(model_dir), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:  # lora_B random too: the adapter changes the output
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out)
    return out


def _greedy_tokens(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def adapters(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vllm-adapters")
    return {
        name: _make_adapter(demo_model_dir, root / name, seed)
        for name, seed in [("a", 1), ("b", 2)]
    }


@pytest.fixture(scope="module")
def expected(demo_model_dir: Path, adapters: dict[str, Path]) -> dict[tuple[str, str], list[int]]:
    """(prompt, adapter or "") -> transformers' greedy tokens: peft's merged model, or the base."""
    out = {}
    base = _base_model(demo_model_dir).eval()
    for prompt, ids in PROMPTS.items():
        out[prompt, ""] = _greedy_tokens(base, ids)
    for name, path in adapters.items():
        merged = peft.PeftModel.from_pretrained(_base_model(demo_model_dir), path)
        model = merged.merge_and_unload().eval()
        for prompt, ids in PROMPTS.items():
            out[prompt, name] = _greedy_tokens(model, ids)
    return out


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
            max_adapters=2,
            max_host_adapters=4,
            max_adapter_rank=8,
        ),
        label="vllm-lora-test",
        python=vllm_python,
    )
    yield e
    e.close()
    assert not e.alive()


def run(engine: ProcessEngine, requests: list[EngineRequest]) -> dict[str, list[int]]:
    for r in requests:
        engine.add_request(r)
    return {rid: tokens(outs) for rid, outs in drain(engine).items()}


def test_the_engine_declares_lora_and_serves_it_over_the_pipe(engine, adapters) -> None:
    assert engine.capabilities.lora and bind_features(engine).lora is engine
    assert not engine.capabilities.kv_events  # no meshserve chain describes vLLM's blocks
    assert engine.adapters() == []
    engine.load_adapter("a", str(adapters["a"]))
    engine.load_adapter("a", str(adapters["a"]))  # idempotent
    assert engine.adapters() == ["a"]  # mirrored from the child's last reply


def test_an_adapters_greedy_tokens_are_peft_merged_models(engine, adapters, expected) -> None:
    engine.load_adapter("a", str(adapters["a"]))
    got = run(engine, [EngineRequest("r", PROMPTS["p1"], greedy(), adapter="a")])["r"]
    assert got == expected["p1", "a"]
    assert got != expected["p1", ""]  # the adapter changes the output


def test_a_batch_mixing_base_and_adapters_gives_each_its_solo_output(
    engine, adapters, expected
) -> None:
    for name, path in adapters.items():
        engine.load_adapter(name, str(path))
    solo = {
        (prompt, adapter): run(engine, [EngineRequest("s", ids, greedy(), adapter=adapter)])["s"]
        for prompt, ids in PROMPTS.items()
        for adapter in ["", "a", "b"]
    }
    assert solo == expected  # alone, each is transformers' (merged) output
    batch = [
        EngineRequest(f"{prompt}-{adapter or 'base'}", ids, greedy(), adapter=adapter)
        for prompt, ids in PROMPTS.items()
        for adapter in ["", "a", "b"]
    ]
    for r in batch:
        engine.add_request(r)
    # On CPU, vLLM's LoRA ops would give the base requests the last slot's adapter in a batch
    # with adapter requests: the engine holds the rest back behind p1-base (the first of the
    # other kind), so a and b share batches, the base model runs apart. On a GPU, one batch.
    assert engine.stats().waiting == (len(batch) - 1 if engine.device == "cpu" else 0)
    got = {rid: tokens(outs) for rid, outs in drain(engine).items()}
    assert got == {f"{p}-{a or 'base'}": toks for (p, a), toks in solo.items()}


def test_an_adapter_that_is_not_loaded_is_refused(engine, adapters) -> None:
    with pytest.raises(ValueError, match="'nope' is not loaded"):
        engine.add_request(EngineRequest("x", PROMPTS["p1"], greedy(), adapter="nope"))
    assert not engine.has_work()
    with pytest.raises(FileNotFoundError):
        engine.load_adapter("missing", str(adapters["a"].parent / "no-such-adapter"))
    assert "missing" not in engine.adapters()


def test_an_adapter_above_the_rank_served_is_refused(engine, demo_model_dir, tmp_path) -> None:
    big = _make_adapter(demo_model_dir, tmp_path / "r16", seed=3, rank=16)
    with pytest.raises(ValueError, match="rank 16"):
        engine.load_adapter("big", str(big))


def test_an_adapter_vllm_cannot_read_is_refused_and_vllm_serves_on(
    engine, adapters, expected, tmp_path
) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_bytes((adapters["a"] / "adapter_config.json").read_bytes())
    (bad / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="vLLM refused add_lora for adapter 'bad'"):
        engine.load_adapter("bad", str(bad))
    assert "bad" not in engine.adapters()
    engine.load_adapter("a", str(adapters["a"]))
    got = run(engine, [EngineRequest("after", PROMPTS["p1"], greedy(), adapter="a")])["after"]
    assert got == expected["p1", "a"]


def test_other_weights_in_a_directory_served_before_are_refused(
    engine, adapters, demo_model_dir, tmp_path
) -> None:
    """vLLM keys cached KV by the adapter's name and directory: other weights there under the
    same name would reuse KV computed under the old ones."""
    path = _make_adapter(demo_model_dir, tmp_path / "c", seed=4)
    engine.load_adapter("c", str(path))
    assert engine.unload_adapter("c")
    _make_adapter(demo_model_dir, path, seed=5)  # retrained in place
    with pytest.raises(ValueError, match="other weights"):
        engine.load_adapter("c", str(path))
    engine.load_adapter("c2", str(path))  # under a new name: its own cache keys
    assert engine.unload_adapter("c2")


def test_unload_pin_and_reload(engine, adapters, expected) -> None:
    engine.load_adapter("a", str(adapters["a"]))
    engine.pin_adapter("a", True)  # vLLM's pin_lora
    engine.load_adapter("b", str(adapters["b"]))
    with pytest.raises(ValueError, match="at most 1"):  # max_adapters 2: one slot stays free
        engine.pin_adapter("b", True)
    assert (
        run(engine, [EngineRequest("p", PROMPTS["p2"], greedy(), adapter="a")])["p"]
        == (expected["p2", "a"])
    )
    engine.pin_adapter("a", False)
    engine.add_request(EngineRequest("busy", PROMPTS["p1"], greedy(), adapter="a"))
    with pytest.raises(ValueError, match="in use"):
        engine.unload_adapter("a")
    drain(engine)
    assert engine.unload_adapter("a") and not engine.unload_adapter("a")
    assert "a" not in engine.adapters()
    with pytest.raises(ValueError, match="not loaded"):
        engine.add_request(EngineRequest("gone", PROMPTS["p1"], greedy(), adapter="a"))
    engine.load_adapter("a", str(adapters["a"]))  # again, under the same name and id
    got = run(engine, [EngineRequest("again", PROMPTS["p1"], greedy(), adapter="a")])["again"]
    assert got == expected["p1", "a"]


def test_a_request_held_back_can_be_aborted(engine, adapters, expected) -> None:
    engine.load_adapter("a", str(adapters["a"]))
    engine.add_request(EngineRequest("base", PROMPTS["p1"], greedy()))
    engine.add_request(EngineRequest("held", PROMPTS["p1"], greedy(), adapter="a"))
    engine.add_request(EngineRequest("next", PROMPTS["p2"], greedy(), adapter="a"))
    assert engine.stats().waiting == (2 if engine.device == "cpu" else 0)
    engine.abort("held")
    got = {rid: tokens(outs) for rid, outs in drain(engine).items()}
    assert got == {"base": expected["p1", ""], "next": expected["p2", "a"]}
    assert not engine.has_work() and engine.stats().waiting == 0
