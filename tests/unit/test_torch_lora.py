"""Batched multi-LoRA serving in the torch engine: an adapter's output is that of peft's merged
model, a batch mixing adapters and the base model gives each request what it gets alone,
cached KV never crosses adapters, slots are evicted and refilled without changing outputs,
and what the engine cannot serve is refused.

A tiny random Qwen2 (q/k/v biases, tied embeddings) is built with transformers; adapters are
made with peft, their A and B random (peft starts B at zero, which would change nothing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from services.task_executor.engines.base import EngineCapabilities, EngineRequest  # noqa: E402
from services.task_executor.engines.capabilities import (  # noqa: E402
    CapabilityError,
    bind_features,
)
from services.task_executor.engines.torch_engine import TorchEngine  # noqa: E402
from services.task_executor.engines.torch_engine.cuda_graphs import DecodeGraphs  # noqa: E402
from services.task_executor.engines.torch_engine.lora import LoraLimits  # noqa: E402
from services.task_executor.engines.torch_engine.model import SeqChunk, build_batch  # noqa: E402
from shared.block_hash import adapter_root, chain_hashes  # noqa: E402
from shared.messages.api import SamplingParams  # noqa: E402
from tests.engines import TEST_DEVICE, drain, tokens  # noqa: E402
from tests.unit.test_engine_capabilities import _Minimal  # noqa: E402

VOCAB = 256
NEW = 8
BLOCK = 4
PROMPTS = {
    "p1": [5, 17, 42, 8, 61, 3, 29, 100, 7, 220, 13],
    "p2": [11, 2, 90, 45, 1, 18, 64],
    "p3": [7, 70, 33, 12, 90, 45, 1, 18, 64, 23, 9, 150, 201, 33, 4, 87, 19],
}
# name: (rank, alpha, target modules, rsLoRA)
ADAPTERS: dict[str, tuple[int, int, tuple[str, ...], bool]] = {
    "attn": (4, 8, ("q_proj", "k_proj", "v_proj", "o_proj"), False),
    "mlp": (2, 4, ("q_proj", "gate_proj", "up_proj", "down_proj"), True),
    "all": (
        8,
        16,
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        False,
    ),
}


def _randomize(model: torch.nn.Module, seed: int, *, only: str = "") -> None:
    """Wide random weights (logits of order 1-10: greedy tokens are far from ties), random
    norms and biases; ``only``: just the parameters whose name contains it."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if only not in name:
                continue
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
    )
    model = transformers.Qwen2ForCausalLM(cfg)
    _randomize(model, 0)
    out = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(out, safe_serialization=True)
    return out


def _base_model(base_dir: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)


def _make_adapter(
    base_dir: Path,
    out: Path,
    rank: int,
    alpha: int,
    targets: tuple[str, ...],
    rslora: bool,
    seed: int,
) -> Path:
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora, lora_dropout=0.0
    )
    model = peft.get_peft_model(_base_model(base_dir), config)
    _randomize(model, seed, only="lora_")
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: _make_adapter(base_dir, root / name, *spec, seed=10 + i)
        for i, (name, spec) in enumerate(ADAPTERS.items())
    }


def _engine(base_dir: Path, **kwargs: object) -> TorchEngine:
    kwargs = {
        "device": TEST_DEVICE,
        "dtype": "float32",
        "block_size": BLOCK,
        "num_kv_blocks": 128,
        "lora": LoraLimits(max_adapters=4),
    } | kwargs
    return TorchEngine(base_dir, **kwargs)  # type: ignore[arg-type]


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)


def _request(rid: str, prompt: str, adapter: str = "") -> EngineRequest:
    return EngineRequest(rid, PROMPTS[prompt], _greedy(), adapter=adapter)


@pytest.fixture(scope="module")
def alone(base_dir: Path, adapters: dict[str, Path]) -> dict[tuple[str, str], list[int]]:
    """Each (prompt, adapter or "") run alone in a fresh engine without a prefix cache."""
    out = {}
    for prompt in PROMPTS:
        for adapter in ["", *ADAPTERS]:
            engine = _engine(base_dir, enable_prefix_caching=False)
            if adapter:
                engine.load_adapter(adapter, str(adapters[adapter]))
            engine.add_request(_request("r", prompt, adapter))
            out[prompt, adapter] = tokens(drain(engine)["r"])
            engine.close()
    return out


def _peft_greedy(base_dir: Path, adapter_dir: Path, prompt: list[int]) -> list[int]:
    model = peft.PeftModel.from_pretrained(_base_model(base_dir), adapter_dir).merge_and_unload()
    model.eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


# --- (a) the merged model's output --------------------------------------------------------------


@pytest.mark.parametrize("adapter", list(ADAPTERS))
def test_an_adapters_output_is_peft_merged_models(
    base_dir: Path,
    adapters: dict[str, Path],
    alone: dict[tuple[str, str], list[int]],
    adapter: str,
) -> None:
    for prompt in ("p1", "p3"):
        expected = _peft_greedy(base_dir, adapters[adapter], PROMPTS[prompt])
        assert alone[prompt, adapter] == expected
        assert expected != alone[prompt, ""], "the adapter changes nothing: a vacuous test"


# --- (b) mixed batches --------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_batch_mixing_adapters_and_the_base_gives_each_request_its_alone_output(
    base_dir: Path,
    adapters: dict[str, Path],
    alone: dict[tuple[str, str], list[int]],
    overlap: bool,
) -> None:
    # Small prompt budget: prompts prefill in chunks beside decodes, under other adapters.
    engine = _engine(
        base_dir,
        enable_prefix_caching=False,
        max_prefill_tokens=6,
        overlap_on_cpu=overlap,
    )
    for name, path in adapters.items():
        engine.load_adapter(name, str(path))
    cases = {
        "base-1": ("p1", ""),
        "attn-1": ("p1", "attn"),
        "mlp-2": ("p2", "mlp"),
        "base-3": ("p3", ""),
        "all-3": ("p3", "all"),
        "attn-3": ("p3", "attn"),
    }
    first, later = list(cases)[:3], list(cases)[3:]
    for rid in first:
        engine.add_request(_request(rid, *cases[rid]))
    outs: dict[str, list[int]] = {}
    for _ in range(3):  # the others join mid-generation
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    for rid in later:
        engine.add_request(_request(rid, *cases[rid]))
    for rid, got in drain(engine).items():
        outs.setdefault(rid, []).extend(tokens(got))
    if overlap:  # iterations launched ahead carried the adapters' rows
        assert engine.overlap.rows_used > 0
    engine.close()
    assert {rid: outs[rid] for rid in cases} == {rid: alone[case] for rid, case in cases.items()}


def test_without_adapters_in_the_batch_the_forward_is_the_base_models_bit_for_bit(
    base_dir: Path, adapters: dict[str, Path]
) -> None:
    with_lora = _engine(base_dir, enable_prefix_caching=False)
    without = _engine(base_dir, enable_prefix_caching=False, lora=None)
    with_lora.load_adapter("all", str(adapters["all"]))
    with_lora.add_request(_request("warm", "p2", "all"))  # slots filled and used once
    drain(with_lora)
    logits = []
    for engine in (with_lora, without):
        engine.add_request(_request("b", "p1"))
        logits.append(engine._forward(engine._schedule()))
    assert torch.equal(logits[0], logits[1])
    with_lora.close()
    without.close()


# --- (c) the prefix cache -----------------------------------------------------------------------


def test_cached_kv_is_never_reused_across_adapters_or_the_base(
    base_dir: Path, adapters: dict[str, Path], alone: dict[tuple[str, str], list[int]]
) -> None:
    engine = _engine(base_dir)
    for name in ("attn", "mlp"):
        engine.load_adapter(name, str(adapters[name]))
    prompt = PROMPTS["p3"]
    for i, adapter in enumerate(["attn", "mlp", "", "attn", ""]):
        engine.add_request(_request(f"r{i}", "p3", adapter))
        outs = drain(engine)[f"r{i}"]
        assert tokens(outs) == alone["p3", adapter], adapter
        cached = outs[0].num_cached_tokens
        if i < 3:
            assert cached == 0, f"{adapter or 'base'} reused another's KV"
        else:  # the same adapter (or the base) again reuses its own
            assert cached == (len(prompt) // BLOCK) * BLOCK
    # The base model's hashes are those of the shared spec, unchanged; an adapter's differ.
    assert engine.block_hashes(prompt) == chain_hashes(prompt, BLOCK)
    under = engine.block_hashes(prompt, "attn")
    assert under == chain_hashes(prompt, BLOCK, adapter_root("attn"))
    assert not set(under) & set(engine.block_hashes(prompt))
    engine.close()


# --- (d) slots: eviction, pins, the host copies -------------------------------------------------


def test_two_slots_serve_three_adapters_in_turn_and_at_once(
    base_dir: Path, adapters: dict[str, Path], alone: dict[tuple[str, str], list[int]]
) -> None:
    engine = _engine(base_dir, lora=LoraLimits(max_adapters=2, max_host_adapters=1))
    for name, path in adapters.items():
        engine.load_adapter(name, str(path))
    order = ["attn", "mlp", "all", "attn", "all", "mlp"]
    for i, adapter in enumerate(order):  # in turn: each evicts the least recently used
        engine.add_request(_request(f"t{i}", "p1", adapter))
        assert tokens(drain(engine)[f"t{i}"]) == alone["p1", adapter]
        assert adapter in engine.adapters() and len(engine.adapters()) <= 2
    # attn, mlp, all (evicts attn), attn (evicts mlp), all (there), mlp (evicts attn)
    stats = engine.lora_stats
    assert stats is not None and (stats.installs, stats.evictions) == (5, 3)
    assert stats.reads == len(adapters) + 5, "one host copy: every install read the files"
    # At once: the third waits until a slot is no longer used by a running request.
    for adapter in ADAPTERS:
        engine.add_request(_request(f"c-{adapter}", "p2", adapter))
    outs = drain(engine)
    assert {a: tokens(outs[f"c-{a}"]) for a in ADAPTERS} == {a: alone["p2", a] for a in ADAPTERS}
    engine.close()


def test_a_pinned_adapter_keeps_its_slot(base_dir: Path, adapters: dict[str, Path]) -> None:
    engine = _engine(base_dir, lora=LoraLimits(max_adapters=2))
    for name, path in adapters.items():
        engine.load_adapter(name, str(path))
    engine.pin_adapter("attn", True)
    with pytest.raises(ValueError, match="pinned"):
        engine.pin_adapter("mlp", True)  # the last slot stays for the others
    for i, adapter in enumerate(["attn", "mlp", "all", "mlp"]):
        engine.add_request(_request(f"t{i}", "p2", adapter))
        drain(engine)
        assert "attn" in engine.adapters()
    engine.pin_adapter("attn", False)
    engine.add_request(_request("u", "p2", "all"))
    drain(engine)
    assert engine.adapters() == ["all", "mlp"]  # attn, unpinned, was the least recently used
    engine.close()


def test_load_is_idempotent_and_unload_refuses_while_in_use(
    base_dir: Path, adapters: dict[str, Path]
) -> None:
    engine = _engine(base_dir)
    engine.load_adapter("attn", str(adapters["attn"]))
    engine.load_adapter("attn", str(adapters["attn"]))
    assert engine.lora_stats is not None and engine.lora_stats.reads == 1
    with pytest.raises(ValueError, match="other weights"):
        engine.load_adapter("attn", str(adapters["mlp"]))
    engine.add_request(_request("r", "p1", "attn"))
    with pytest.raises(ValueError, match="in use"):
        engine.unload_adapter("attn")
    drain(engine)
    assert engine.adapters() == ["attn"]
    assert engine.unload_adapter("attn") and not engine.unload_adapter("attn")
    assert engine.adapters() == []
    with pytest.raises(ValueError, match="is not loaded"):
        engine.add_request(_request("s", "p1", "attn"))
    engine.close()


# --- (e) what is refused ------------------------------------------------------------------------


def test_unknown_adapters_and_engines_without_lora_are_refused(
    base_dir: Path, adapters: dict[str, Path]
) -> None:
    engine = _engine(base_dir)
    with pytest.raises(ValueError, match="adapter 'nope' is not loaded"):
        engine.add_request(_request("r", "p1", "nope"))
    engine.load_adapter("attn", str(adapters["attn"]))
    # PD moves no adapter's KV, for now: neither out nor in.
    with pytest.raises(ValueError, match="LoRA"):
        engine.add_request(_request("pd", "p1", "attn"), retain_kv=True)
    engine.add_request(_request("base", "p1"), retain_kv=True)
    drain(engine)
    export = engine.export_kv("base", release=True)
    with pytest.raises(ValueError, match="LoRA"):
        engine.import_kv(export, _request("in", "p1", "attn"))
    engine.add_request(_request("running", "p1", "attn"))
    engine.step()
    with pytest.raises(ValueError, match="LoRA"):
        engine.export_kv("running")
    assert engine.capabilities.lora and bind_features(engine).lora is engine
    engine.close()
    with pytest.raises(CapabilityError, match="lora"):  # declared, not implemented
        bind_features(_Minimal(EngineCapabilities(lora=True)))
    plain = _engine(base_dir, lora=None)
    assert not plain.capabilities.lora and bind_features(plain).lora is None
    with pytest.raises(ValueError, match="no LoRA"):
        plain.add_request(_request("r", "p1", "attn"))
    with pytest.raises(CapabilityError):
        plain.load_adapter("attn", str(adapters["attn"]))
    plain.close()


def test_adapters_the_engine_cannot_serve_are_refused_at_load(
    base_dir: Path, tmp_path: Path
) -> None:
    engine = _engine(base_dir, lora=LoraLimits(max_rank=8))
    head = _make_adapter(base_dir, tmp_path / "head", 4, 8, ("q_proj", "lm_head"), False, seed=1)
    with pytest.raises(ValueError, match="lm_head"):
        engine.load_adapter("head", str(head))
    # A regex target: the tensors' names are checked.
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=r".*embed_tokens")
    model = peft.get_peft_model(_base_model(base_dir), config)
    model.save_pretrained(tmp_path / "embed")
    with pytest.raises(ValueError, match="embed_tokens"):
        engine.load_adapter("embed", str(tmp_path / "embed"))
    wide = _make_adapter(base_dir, tmp_path / "wide", 16, 16, ("q_proj",), False, seed=2)
    with pytest.raises(ValueError, match="rank 16"):
        engine.load_adapter("wide", str(wide))
    dora = tmp_path / "dora"
    _make_adapter(base_dir, dora, 4, 8, ("q_proj",), False, seed=3)
    config_path = dora / "adapter_config.json"
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | {"use_dora": True}))
    with pytest.raises(ValueError, match="use_dora"):
        engine.load_adapter("dora", str(dora))
    with pytest.raises(OSError):
        engine.load_adapter("missing", str(tmp_path / "missing"))
    assert engine.adapters() == []
    engine.close()


def test_cuda_graphs_never_replay_a_batch_with_adapters() -> None:
    """The captured forward has no LoRA: such a decode batch runs eagerly."""
    graphs = object.__new__(DecodeGraphs)  # no CUDA here: only the coverage rule is used
    graphs._batches, graphs._widths = [1, 2, 4], [1, 2, 4]
    chunks = [SeqChunk((3,), 5, [0, 1]), SeqChunk((4,), 2, [2])]
    cpu = torch.device("cpu")
    plain = build_batch(chunks, block_size=BLOCK, device=cpu)
    assert plain.lora is None and graphs.covers(plain)
    assert build_batch(chunks, block_size=BLOCK, device=cpu, adapter_slots=[-1, -1]).lora is None
    mixed = build_batch(chunks, block_size=BLOCK, device=cpu, adapter_slots=[-1, 1])
    assert mixed.lora is not None and mixed.lora.slots == (1,)
    assert mixed.lora.token_slots.tolist() == [-1, 1]
    assert not graphs.covers(mixed)
