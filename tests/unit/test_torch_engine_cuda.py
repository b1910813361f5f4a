"""The torch engine on a CUDA device, against itself on CPU: the same greedy tokens, decode
steps replayed from CUDA graphs, async scheduling that launches ahead and changes nothing,
the prefix cache and its host tier, and KV
moving between a GPU engine and a CPU engine (prefill on one, decode on the other) without a
token changing. Skips where there is no CUDA device; ``MESHSERVE_TEST_DEVICE=cuda`` runs the
whole torch engine suite on one as well (tests/engines.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from services.task_executor.engines.base import EngineRequest
from services.task_executor.engines.torch_engine import TorchEngine
from services.task_executor.engines.torch_engine.kv_transfer import KvExport
from shared.messages.api import SamplingParams
from tests.engines import drain, tokens
from tests.unit.test_torch_engine import VOCAB, _write_tiny_llama, greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

BS = 4
PREFIX = [5, 17, 42, 8, 61, 3, 29, 11, 2, 7, 70, 33]  # three full blocks
PROMPTS = {
    "a": [*PREFIX, 12, 90],
    "b": [11, 2, 64, 23, 9],
    "c": [7, 70, 33, 12, 90, 45, 1, 18, 64, 23, 9, 31, 4, 77, 6, 50, 21],
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(autouse=True)
def exact_float32() -> Iterator[None]:
    """float32 matmuls in float32 (not TF32), so CUDA and CPU agree to rounding."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _engine(model_dir: Path, device: str, **kwargs: object) -> TorchEngine:
    kwargs = {"dtype": "float32", "block_size": BS, "num_kv_blocks": 64} | kwargs
    return TorchEngine(model_dir, device=device, **kwargs)  # type: ignore[arg-type]


def _run(engine: TorchEngine, params: dict[str, SamplingParams]) -> dict[str, list[int]]:
    for rid, p in params.items():
        engine.add_request(EngineRequest(rid, PROMPTS[rid], p))
    return {rid: tokens(outs) for rid, outs in drain(engine).items()}


def test_greedy_tokens_on_cuda_equal_those_on_cpu(model_dir: Path) -> None:
    params = {rid: greedy(16) for rid in PROMPTS}
    gpu = _engine(model_dir, "cuda")
    assert gpu.device.startswith("cuda") and gpu.cache.k[0].is_cuda
    assert _run(gpu, params) == _run(_engine(model_dir, "cpu"), params)


def test_auto_picks_cuda_and_the_checkpoints_dtype_and_bfloat16_runs(model_dir: Path) -> None:
    engine = TorchEngine(model_dir, block_size=BS, num_kv_blocks=64)
    # On a GPU "auto" is the checkpoint's torch_dtype (this tiny one is saved in float32).
    assert engine.device.startswith("cuda") and engine.dtype == torch.float32
    bf16 = _engine(model_dir, "cuda", dtype="bfloat16")
    assert bf16.cache.k[0].dtype == torch.bfloat16
    out = _run(bf16, {"b": greedy(8)})["b"]
    assert len(out) == 8 and all(0 <= t < VOCAB for t in out)


def test_decode_steps_replay_cuda_graphs_with_the_eager_tokens(model_dir: Path) -> None:
    """Batches of 1 to 3 (padded to buckets 1, 2 and 4) whose block tables grow across width
    buckets as they decode; requests join while others decode."""
    stops = list(range(3, VOCAB, 9))

    def run(engine: TorchEngine) -> dict[str, list[int]]:
        engine.add_request(EngineRequest("c", PROMPTS["c"], greedy(30)))
        outs: dict[str, list[int]] = {}
        for step in range(200):
            if step == 3:
                engine.add_request(EngineRequest("b", PROMPTS["b"], greedy(20)))
            if step == 6:
                stop = SamplingParams(max_tokens=25, temperature=0, stop_token_ids=stops)
                engine.add_request(EngineRequest("a", PROMPTS["a"], stop))
            for o in engine.step():
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if step > 6 and not engine.has_work():
                return outs
        raise AssertionError("the engine did not finish")

    graphs = _engine(model_dir, "cuda", num_kv_blocks=40)
    eager = _engine(model_dir, "cuda", num_kv_blocks=40, cuda_graphs=False)
    assert eager.runner.graphs is None and graphs.runner.graphs is not None
    assert run(graphs) == run(eager)
    assert graphs.runner.graphs.replays > 20 and graphs.runner.graphs.captured >= 3


def test_async_scheduling_launches_ahead_on_cuda_and_changes_nothing(model_dir: Path) -> None:
    stops = list(range(3, VOCAB, 9))
    params = {
        "a": greedy(24),
        "b": SamplingParams(max_tokens=24, temperature=0, stop_token_ids=stops),
        "c": SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
    }
    on = _engine(model_dir, "cuda", async_scheduling=True)
    off = _engine(model_dir, "cuda", async_scheduling=False)
    assert _run(on, params) == _run(off, params)
    assert on.overlap.launched > 0 and on.overlap.rows_used > 0
    assert off.overlap.launched == 0


def test_a_shared_prefix_is_served_from_the_cache_on_cuda(model_dir: Path) -> None:
    engine = _engine(model_dir, "cuda")
    alone = _run(_engine(model_dir, "cuda", enable_prefix_caching=False), {"a": greedy(8)})
    assert _run(engine, {"a": greedy(8)}) == alone
    engine.add_request(EngineRequest("again", PROMPTS["a"], greedy(8)))
    outs = drain(engine)["again"]
    assert outs[0].num_cached_tokens == 3 * BS
    assert tokens(outs) == alone["a"]


def test_the_host_tier_takes_cuda_blocks_and_gives_them_back(model_dir: Path) -> None:
    engine = _engine(model_dir, "cuda", num_kv_blocks=10, num_host_kv_blocks=8)
    alone = _run(engine, {"a": greedy(4)})["a"]
    hashes = engine.block_hashes(PREFIX)
    assert engine.offload_kv(hashes) == 3
    engine.add_request(EngineRequest("w", list(range(40, 77)), greedy(1)))
    drain(engine)  # needs the whole device: the prefix is evicted from it
    assert all(engine.prefix_cache.cached_block(h) is None for h in hashes)
    engine.add_request(EngineRequest("a2", PROMPTS["a"], greedy(4)))
    outs = drain(engine)["a2"]
    assert outs[0].num_cached_tokens == 3 * BS and tokens(outs) == alone


@pytest.mark.parametrize(("source", "target"), [("cuda", "cpu"), ("cpu", "cuda")])
def test_kv_moves_between_a_gpu_and_a_cpu_engine(model_dir: Path, source: str, target: str) -> None:
    """Prefill on one device, decode on the other: the disaggregated run's tokens are the
    uninterrupted run's."""
    params = greedy(12)
    uninterrupted = _run(_engine(model_dir, target), {"c": params})["c"]

    prefill = _engine(model_dir, source)
    one = msgspec.structs.replace(params, max_tokens=1)
    prefill.add_request(EngineRequest("c", PROMPTS["c"], one), retain_kv=True)
    first = tokens(drain(prefill)["c"])
    export = prefill.export_kv("c", release=True)
    assert export.kv.device.type == "cpu" and export.num_computed_tokens == len(PROMPTS["c"])

    decode = _engine(model_dir, target, block_size=8)
    decode.import_kv(
        KvExport.from_bytes(export.to_bytes()), EngineRequest("c", PROMPTS["c"], params)
    )
    rest = tokens(drain(decode)["c"])
    assert first + rest == uninterrupted
    assert decode.stats().free_kv_blocks == decode.stats().total_kv_blocks
