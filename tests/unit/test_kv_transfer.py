"""KV export and import between torch engine instances (the base of PD disaggregation): a request
prefilled on one instance continues on another exactly as if it had never moved."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from services.task_executor.engines.base import EngineRequest
from services.task_executor.engines.torch_engine.kv_transfer import KvExport
from shared.messages.api import SamplingParams
from tests.engines import drain, tokens
from tests.unit.test_torch_engine import _engine, _write_tiny_llama, greedy

PROMPT = [5, 17, 42, 8, 61, 3, 29, 11, 2, 7, 70, 33, 12, 90]  # 14 tokens: 3 full blocks of 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _uninterrupted(model_dir: Path, params: SamplingParams) -> list[int]:
    engine = _engine(model_dir)
    engine.add_request(EngineRequest("r", PROMPT, params))
    return tokens(drain(engine)["r"])


def _prefill_and_export(model_dir: Path, params: SamplingParams) -> tuple[list[int], KvExport]:
    prefill = _engine(model_dir)
    one = msgspec.structs.replace(params, max_tokens=1)
    prefill.add_request(EngineRequest("r", PROMPT, one), retain_kv=True)
    out = tokens(drain(prefill)["r"])
    assert prefill.stats().free_kv_blocks < prefill.stats().total_kv_blocks  # retained
    export = prefill.export_kv("r", release=True)
    assert prefill.stats().free_kv_blocks == prefill.stats().total_kv_blocks
    return out, export


@pytest.mark.parametrize("block_size", [4, 8])
def test_export_after_prefill_continues_identically_on_another_engine(
    model_dir: Path, block_size: int
) -> None:
    params = greedy(10)
    first, export = _prefill_and_export(model_dir, params)
    assert export.num_computed_tokens == len(PROMPT)
    assert export.token_ids == [*PROMPT, *first]
    assert tuple(export.kv.shape) == (2, 2, 4, 4, 2, 8)  # layers, K/V, blocks, block, heads, hd
    assert export.kv.device.type == "cpu"

    # Over the wire, into an engine with another block size.
    decode = _engine(model_dir, block_size=block_size)
    decode.import_kv(KvExport.from_bytes(export.to_bytes()), EngineRequest("r", PROMPT, params))
    scheduled = decode._schedule()
    # Nothing of the prompt is recomputed: the first iteration is a one-token decode.
    assert [len(r.token_ids) - r.num_computed for r in scheduled] == [1]
    outs = decode._advance(scheduled, decode._forward(scheduled)) + drain(decode)["r"]
    assert first + tokens(outs) == _uninterrupted(model_dir, params)
    assert outs[-1].finish_reason == "length" and len(outs) == 9  # one token came from prefill
    assert decode.stats().free_kv_blocks == decode.stats().total_kv_blocks


def test_import_reuses_blocks_the_target_already_caches(model_dir: Path) -> None:
    first, export = _prefill_and_export(model_dir, greedy(6))
    decode = _engine(model_dir)
    decode.add_request(EngineRequest("warm", PROMPT[:8], greedy(1)))
    drain(decode)
    decode.drain_kv_events()
    decode.import_kv(export, EngineRequest("r", PROMPT, greedy(6)))
    outs = drain(decode)["r"]
    assert first + tokens(outs) == _uninterrupted(model_dir, greedy(6))
    # Two blocks were cached already; only the third came from the import.
    stored = [h for e in decode.drain_kv_events() for h in getattr(e, "block_hashes", [])]
    prompt_hashes = decode.block_hashes(PROMPT)
    assert prompt_hashes[2] in stored and not set(prompt_hashes[:2]) & set(stored)


def test_a_running_seeded_request_moves_mid_decode(model_dir: Path) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    expected = _uninterrupted(model_dir, params)

    source = _engine(model_dir)
    source.add_request(EngineRequest("r", PROMPT, params))
    produced = [t for _ in range(5) for o in source.step() for t in o.new_token_ids]
    export = source.export_kv("r")
    source.abort("r")
    assert export.num_computed_tokens == len(PROMPT) + 4  # the 5th token is the next input

    target = _engine(model_dir)
    target.import_kv(export, EngineRequest("r", PROMPT, params))
    assert produced + tokens(drain(target)["r"]) == expected


def test_export_round_trips_through_bytes() -> None:
    gen = torch.Generator().manual_seed(0)
    for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        kv = torch.randn(3, 2, 2, 4, 2, 8, generator=gen).to(dtype)
        kv[:, :, 1, 2:] = 0
        export = KvExport(
            token_ids=[1, 2, 3, 4, 5, 6, 7],
            num_prompt_tokens=5,
            num_computed_tokens=6,
            block_size=4,
            num_layers=3,
            num_kv_heads=2,
            head_dim=8,
            dtype=name,
            model_fingerprint="abc",
            kv=kv,
        )
        back = KvExport.from_bytes(export.to_bytes())
        assert torch.equal(back.kv, kv) and back.kv.dtype == dtype
        for field in ("token_ids", "num_prompt_tokens", "num_computed_tokens", "block_size"):
            assert getattr(back, field) == getattr(export, field)
        assert back.model_fingerprint == "abc" and back.dtype == name
    with pytest.raises(ValueError):
        KvExport.from_bytes(b"\x00" * 16)


def test_import_is_refused_for_another_model_or_another_prompt(
    model_dir: Path, tmp_path: Path
) -> None:
    _, export = _prefill_and_export(model_dir, greedy(4))
    other = _engine(_write_tiny_llama(tmp_path / "other", rope_theta=20000.0))
    with pytest.raises(ValueError, match="different model"):
        other.import_kv(export, EngineRequest("r", PROMPT, greedy(4)))

    same = _engine(model_dir)
    with pytest.raises(ValueError, match="prompt"):
        same.import_kv(export, EngineRequest("r", PROMPT[:-1], greedy(4)))
    with pytest.raises(ValueError, match="max_tokens"):
        same.import_kv(export, EngineRequest("r", PROMPT, greedy(1)))
    assert not same.has_work()


def test_retained_kv_is_freed_by_abort_and_unknown_requests_are_refused(model_dir: Path) -> None:
    engine = _engine(model_dir)
    engine.add_request(EngineRequest("r", PROMPT, greedy(1)), retain_kv=True)
    drain(engine)
    assert not engine.has_work()
    engine.export_kv("r")  # without release: still there
    engine.export_kv("r")
    engine.abort("r")
    assert engine.stats().free_kv_blocks == engine.stats().total_kv_blocks
    with pytest.raises(KeyError):
        engine.export_kv("r")
    engine.add_request(EngineRequest("w", PROMPT, greedy(3)))
    with pytest.raises(ValueError, match="no KV"):
        engine.export_kv("w")  # still waiting


class _Collect:
    """A KV sink that keeps what it gets, noting whether it came during a forward."""

    def __init__(self, num_layers: int) -> None:
        self.k: dict[tuple[int, int], torch.Tensor] = {}
        self.v: dict[tuple[int, int], torch.Tensor] = {}
        self.calls: list[tuple[int, int, int]] = []

    def layer(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.calls.append((layer, start, k.shape[0]))
        for i in range(k.shape[0]):
            self.k[layer, start + i], self.v[layer, start + i] = k[i].clone(), v[i].clone()

    def token_kv(self, num_layers: int, first: int, n: int) -> torch.Tensor:
        return torch.stack(
            [
                torch.stack(
                    (
                        torch.stack([self.k[layer, t] for t in range(first, n)]),
                        torch.stack([self.v[layer, t] for t in range(first, n)]),
                    )
                )
                for layer in range(num_layers)
            ]
        )


@pytest.mark.parametrize("warm_prefix", [0, 8])
def test_prompt_kv_streams_to_a_sink_layer_by_layer_as_it_is_computed(
    model_dir: Path, warm_prefix: int
) -> None:
    """Chunked prefill (4 tokens an iteration): every layer of each chunk reaches the sink
    during the forward; a prefix served from the cache is sent from the cache."""
    engine = _engine(model_dir, max_prefill_tokens=4)
    if warm_prefix:
        engine.add_request(EngineRequest("warm", PROMPT[:warm_prefix], greedy(1)))
        drain(engine)
    sink = _Collect(2)
    engine.add_request(EngineRequest("r", PROMPT, greedy(1)), retain_kv=True, kv_sink=sink)
    first = tokens(drain(engine)["r"])
    export = engine.export_kv("r", release=True)
    assert torch.equal(sink.token_kv(2, 0, len(PROMPT)), export.token_kv())
    # Layer by layer, chunk by chunk: the forwards' calls cover one layer and one chunk each.
    computed = [c for c in sink.calls if c[1] >= warm_prefix]
    assert {(layer, start) for layer, start, _ in computed} == {
        (layer, s) for layer in range(2) for s in range(warm_prefix, len(PROMPT), 4)
    }
    assert first == _uninterrupted(model_dir, greedy(1))


def test_only_the_blocks_the_decode_side_lacks_are_imported(model_dir: Path) -> None:
    params = greedy(6)
    decode = _engine(model_dir)
    decode.add_request(EngineRequest("warm", PROMPT[:9], greedy(1)))
    drain(decode)
    held = decode.held_prefix_tokens(PROMPT)
    assert held == 8  # two full blocks of 4

    prefill = _engine(model_dir)
    prefill.add_request(EngineRequest("r", PROMPT, greedy(1)), retain_kv=True)
    first = tokens(drain(prefill)["r"])
    export = prefill.export_kv("r", release=True, first_token=held)
    assert export.first_token == 8 and export.token_kv().shape[2] == len(PROMPT) - 8
    back = KvExport.from_bytes(export.to_bytes())
    assert back.first_token == 8

    decode.import_kv(back, EngineRequest("r", PROMPT, params))
    assert first + tokens(drain(decode)["r"]) == _uninterrupted(model_dir, params)

    # Where the held blocks are gone by the time the import is admitted, the request
    # computes its prompt itself: the same tokens.
    cold = _engine(model_dir)
    cold.import_kv(back, EngineRequest("r", PROMPT, params))
    assert first + tokens(drain(cold)["r"]) == _uninterrupted(model_dir, params)
