"""The host weight cache: tensors stored once by content, mapped by later loads with the same
greedy outputs, shared between models, evicted by cost within the budget, never in use."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.task_executor.engines.base import EngineRequest, LoadReport
from services.task_executor.engines.torch_engine import TorchEngine, linear
from services.task_executor.weight_cache import fingerprint, tensor_file
from services.task_executor.weight_cache.eviction import (
    EntryView,
    EvictionConfig,
    choose_victims,
    eviction_cost,
)
from services.task_executor.weight_cache.store import HostWeightCache
from shared.settings import Settings
from tests.unit.test_torch_engine import PROMPTS, _write_tiny_llama, greedy
from tests.unit.test_torch_engine_async import drain

LAYERS = 2
# Engine tensors of the tiny Llama: per layer two norms, qkv, o, gate_up, down; then embed,
# the final norm and the (tied) packed LM head where matrices are packed.
PER_LAYER = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_tiny_llama(tmp_path_factory.mktemp("ckpt") / "base")


def _variant(base: Path, out: Path) -> Path:
    """``base`` with one matrix changed (layer 1's up projection): a fine-tune's shape."""
    tensors = load_file(str(base / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"] * 2
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text((base / "config.json").read_text())
    return out


def _load(model_dir: Path, cache: HostWeightCache | None, dtype: str = "bfloat16", **kw: object):
    report = LoadReport()
    engine = TorchEngine(
        model_dir,
        device="cpu",
        dtype=dtype,
        block_size=4,
        num_kv_blocks=64,
        weight_cache=cache,
        load_report=report,
        **kw,  # type: ignore[arg-type]
    )
    if cache is not None:
        assert not engine.has_work()  # as a TE asks once loaded: the store may go
        assert cache.wait_stored(60)
    return engine, report


def _outputs(engine: TorchEngine) -> dict[str, list[int]]:
    for rid, prompt in PROMPTS.items():
        engine.add_request(EngineRequest(rid, prompt, greedy(12)))
    return {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in drain(engine).items()}


def _tensor_count(dtype: str = "bfloat16") -> int:
    packed = linear.can_pack(getattr(torch, dtype), torch.device("cpu"))
    return LAYERS * PER_LAYER + 2 + (1 if packed else 0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_second_load_maps_every_tensor_and_generates_the_same(
    model_dir: Path, tmp_path: Path, dtype: str
) -> None:
    from_disk, _ = _load(model_dir, None, dtype)
    expected = _outputs(from_disk)
    cache = HostWeightCache(tmp_path / "cache", 1 << 30)

    first, report = _load(model_dir, cache, dtype)
    n = _tensor_count(dtype)
    # The checkpoint's five RMSNorm weights are all ones: one entry, stored once.
    assert report.hits + report.misses == n and report.hits == 2 * LAYERS
    assert report.misses == len(list(cache.tensors_dir.iterdir()))
    assert report.stored_bytes == cache.used_bytes() > 0
    own = first.weights.layers[0].down
    assert _outputs(first) == expected
    # Once stored, the builder's own copies gave way to the cache's pages between two steps.
    assert first.weights.layers[0].down is not own
    assert _outputs(first) == expected
    first.close()

    second, report = _load(model_dir, cache, dtype)
    assert (report.hits, report.misses, report.stored_bytes) == (n, 0, 0)
    assert report.hit_bytes >= cache.used_bytes()  # the shared norm counts once a use
    assert {"fingerprint", "map", "weights", "engine_init"} <= report.phases.keys()
    assert "build" not in report.phases
    assert _outputs(second) == expected
    # Mapped, not copied: the engine's matrices live in the cache's files.
    files = {p.stat().st_ino for p in cache.tensors_dir.iterdir()}
    mapped = {os.stat(f"/proc/self/fd/{fd}").st_ino for fd in _open_fds()}
    assert files <= mapped


def _open_fds() -> list[str]:
    return [fd for fd in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{fd}")]


def test_a_model_sharing_tensors_stores_only_those_it_does_not_share(
    model_dir: Path, tmp_path: Path
) -> None:
    cache = HostWeightCache(tmp_path / "cache", 1 << 30)
    base, _ = _load(model_dir, cache)
    before = cache.used_bytes()
    tuned_dir = _variant(model_dir, tmp_path / "tuned")
    tuned, report = _load(tuned_dir, cache)
    # Only layer 1's gate_up is made from a changed tensor.
    gate_up = tuned.weights.layers[1].gate_up
    assert (report.hits, report.misses) == (_tensor_count() - 1, 1)
    assert report.stored_bytes == tensor_file.HEADER_BYTES + tensor_file.nbytes(gate_up)
    assert cache.used_bytes() == before + report.stored_bytes
    assert _outputs(tuned) != _outputs(base)


def test_fingerprints_follow_content_not_names_and_are_memoised(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tensors = load_file(str(model_dir / "model.safetensors"))
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    save_file({f"x.{k}": v for k, v in tensors.items()}, str(renamed / "model.safetensors"))
    a = fingerprint.checkpoint_fingerprints(model_dir, tmp_path / "memo")
    b = fingerprint.checkpoint_fingerprints(renamed, None)
    assert {b[f"x.{k}"] for k in a} == set(a.values()) and len(set(a.values())) > 1

    def no_hashing(path: Path) -> dict[str, str]:
        raise AssertionError("hashed again")

    monkeypatch.setattr(fingerprint, "shard_fingerprints", no_hashing)
    assert fingerprint.checkpoint_fingerprints(model_dir, tmp_path / "memo") == a


def test_tensor_files_map_plain_and_packed_weights(tmp_path: Path) -> None:
    w = torch.randn(64, 32, dtype=torch.bfloat16)
    plain = tmp_path / "plain"
    tensor_file.write(plain, w)
    fd = os.open(plain, os.O_RDONLY)
    t, _mm = tensor_file.map_tensor(fd)
    assert torch.equal(t, w)
    if linear.can_pack(torch.bfloat16, torch.device("cpu")):
        packed = tmp_path / "packed"
        tensor_file.write(packed, linear.pack(w))
        fd2 = os.open(packed, os.O_RDONLY)
        p, _mm2 = tensor_file.map_tensor(fd2)
        x = torch.randn(3, 32, dtype=torch.bfloat16)
        assert p.is_mkldnn
        assert torch.equal(linear.linear(x, p), linear.linear(x, linear.pack(w)))
    with plain.open("r+b") as f:
        f.truncate(tensor_file.HEADER_BYTES + 10)
    with pytest.raises(tensor_file.TensorFileError, match="truncated"):
        tensor_file.map_tensor(os.open(plain, os.O_RDONLY))


# --- eviction ------------------------------------------------------------------------------

CFG = EvictionConfig(load_bandwidth=1e9, horizon_s=600)
NOW = 10_000.0


def _entry(key: str, size: int, *, uses: int = 1, idle: float = 0.0, in_use: bool = False):
    return EntryView(key, size, NOW - 3600, NOW - idle, uses, in_use)


def test_eviction_takes_the_cheapest_entries_first() -> None:
    hot = _entry("hot", 100, uses=50)
    cold = _entry("cold", 100, uses=1, idle=3000)
    small = _entry("small", 10, uses=50)
    assert eviction_cost(cold, NOW, CFG) < eviction_cost(hot, NOW, CFG)
    assert eviction_cost(small, NOW, CFG) < eviction_cost(hot, NOW, CFG)
    entries = [hot, cold, small]
    assert choose_victims(entries, 0, 210, NOW, CFG) == []
    assert choose_victims(entries, 50, 210, NOW, CFG) == ["cold"]
    order = sorted(entries, key=lambda e: eviction_cost(e, NOW, CFG))
    assert choose_victims(entries, 210, 210, NOW, CFG) == [e.key for e in order]


def test_eviction_never_takes_an_entry_in_use() -> None:
    entries = [_entry("busy", 100, idle=5000, in_use=True), _entry("idle", 100, uses=99)]
    assert choose_victims(entries, 100, 200, NOW, CFG) == ["idle"]
    assert choose_victims(entries, 150, 200, NOW, CFG) is None
    assert choose_victims(entries, 300, 200, NOW, CFG) is None


def test_the_store_keeps_its_budget_and_never_evicts_a_loaded_model(
    model_dir: Path, tmp_path: Path
) -> None:
    probe = HostWeightCache(tmp_path / "probe", 1 << 30)
    engine, _ = _load(model_dir, probe)
    one_model = probe.used_bytes()
    del engine
    gc.collect()
    # Room for one model and a half: the second model's unshared tensors cannot all fit while
    # the first is loaded; once it is gone, they can.
    cache = HostWeightCache(tmp_path / "cache", one_model * 3 // 2)
    first, _ = _load(model_dir, cache)
    other = tmp_path / "other"
    other.mkdir()
    tensors = load_file(str(model_dir / "model.safetensors"))
    save_file({k: v + 1 for k, v in tensors.items()}, str(other / "model.safetensors"))
    (other / "config.json").write_text((model_dir / "config.json").read_text())
    second, report = _load(other, cache)
    assert report.uncached_bytes > 0 and report.evicted_bytes == 0
    assert cache.used_bytes() <= cache.budget_bytes
    assert _outputs(second) == _outputs(_load(other, None)[0])  # private copies serve too
    first.close()
    del first, second
    gc.collect()
    _third, report = _load(other, cache)
    assert report.evicted_bytes > 0 and report.uncached_bytes == 0
    assert cache.used_bytes() <= cache.budget_bytes
    residency = cache.residencies()
    assert residency["other"].resident_bytes == residency["other"].total_bytes > 0
    assert residency["base"].resident_bytes < residency["base"].total_bytes  # evicted
    index = json.loads((tmp_path / "cache" / "index.json").read_text())
    assert {"base", "other"} <= index["models"].keys()


def test_the_cache_is_off_at_zero_bytes_and_sized_from_the_host_by_default(tmp_path: Path) -> None:
    assert HostWeightCache.from_settings(Settings(host_cache={"bytes": 0})) is None
    cache = HostWeightCache.from_settings(Settings(host_cache={"dir": tmp_path / "c"}))
    assert cache is not None and 0 < cache.budget_bytes


def test_two_loads_of_one_model_at_once_store_each_entry_once(
    model_dir: Path, tmp_path: Path
) -> None:
    import threading

    expected = _outputs(_load(model_dir, None)[0])
    cache = HostWeightCache(tmp_path / "cache", 1 << 30)
    engines: list[TorchEngine] = []

    def load() -> None:
        engines.append(_load(model_dir, cache)[0])

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(engines) == 2
    assert [_outputs(e) for e in engines] == [expected, expected]
    files = list(cache.tensors_dir.iterdir())
    assert files and not [f for f in files if f.name.endswith(".tmp")]
    third, report = _load(model_dir, cache)
    assert report.misses == 0 and report.hits == _tensor_count()
    assert _outputs(third) == expected


def test_files_half_written_by_a_dead_process_are_removed(tmp_path: Path) -> None:
    tensors = tmp_path / "cache" / "tensors"
    tensors.mkdir(parents=True)
    dead = tensors / ".abc.999999999.tmp"  # no such pid
    alive = tensors / f".def.{os.getpid()}.tmp"
    dead.write_bytes(b"x")
    alive.write_bytes(b"x")
    HostWeightCache(tmp_path / "cache", 1 << 20)
    assert not dead.exists() and alive.exists()


def test_a_preload_stores_the_weights_a_later_load_maps(model_dir: Path, tmp_path: Path) -> None:
    from services.task_executor.engines.torch_engine.build import preload_weights

    cache = HostWeightCache(tmp_path / "cache", 1 << 30)
    report = preload_weights(model_dir, cache, model_name="tiny", device="cpu", dtype="bfloat16")
    assert report.misses > 0 and cache.used_bytes() == report.stored_bytes
    assert cache.residencies()["tiny"].resident_bytes == cache.used_bytes()
    gc.collect()
    engine, again = _load(model_dir, cache)
    assert again.misses == 0 and again.hits == _tensor_count()
    assert _outputs(engine) == _outputs(_load(model_dir, None)[0])


def test_an_engine_that_cannot_swap_keeps_its_own_weights_and_still_stores(
    model_dir: Path, tmp_path: Path
) -> None:
    cache = HostWeightCache(tmp_path / "cache", 1 << 30)
    # Forwards on a worker thread (as on CUDA): no swap between steps.
    engine, report = _load(model_dir, cache, overlap_on_cpu=True)
    assert engine._weights_stored is None and report.stored_bytes == cache.used_bytes() > 0
    own = engine.weights.layers[0].down
    assert _outputs(engine) == _outputs(_load(model_dir, None)[0])
    assert engine.weights.layers[0].down is own


def test_a_first_load_stores_its_weights_only_while_the_engine_is_idle(
    model_dir: Path, tmp_path: Path
) -> None:
    """The store after a first load never shares the cores with requests: it writes while
    the engine has none, holds no lock of the cache's while it waits, and finishes in the
    first pause."""
    cache = HostWeightCache(tmp_path / "cache", 1 << 30)
    engine = TorchEngine(
        model_dir,
        device="cpu",
        dtype="bfloat16",
        block_size=4,
        num_kv_blocks=64,
        weight_cache=cache,
    )
    # Requests before the engine was ever idle (a cold start's first): the store waits.
    for rid, prompt in PROMPTS.items():
        engine.add_request(EngineRequest(rid, prompt, greedy(200)))
    assert not cache.wait_stored(0.5)
    assert not any(cache.tensors_dir.iterdir())
    with cache.locked():  # free for other TEs' loads meanwhile
        pass
    while engine.has_work():  # True: the engine was never idle, the store never wrote
        assert not any(cache.tensors_dir.iterdir()) and not cache.wait_stored(0)
        engine.step()
    assert cache.wait_stored(60) and cache.used_bytes() > 0  # in the first pause
    assert _outputs(engine) == _outputs(_load(model_dir, None)[0])
