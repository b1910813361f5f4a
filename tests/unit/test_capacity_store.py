"""A model's performance model on disk (``services/task_executor/capacity.py``): keyed by
what the figures depend on, measured on the engine, stored with the model by
``meshserve profile`` and found by a load elsewhere; the scaler's capacity read off it."""

import json

import msgspec
import pytest

from services.task_executor.capacity import ProfileStore, profile_key
from shared.perf_model import PerfModel

PERF = PerfModel(
    prefill_lengths=[16, 32],
    prefill_s=[0.01, 0.02],
    decode_batches=[1, 2],
    decode_contexts=[16, 32],
    decode_s=[[0.01, 0.011], [0.012, 0.013]],
    max_num_seqs=2,
    grid="full",
)


def _model(path, **config):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"hidden_size": 128, **config}))
    return path


def test_round_trip_and_what_the_key_depends_on(tmp_path):
    store = ProfileStore(tmp_path / "cache")
    a = _model(tmp_path / "a")
    b = _model(tmp_path / "b")  # another checkpoint of the same architecture
    c = _model(tmp_path / "c", hidden_size=256)
    (b / "model.safetensors").write_bytes(b"other weights")
    key = profile_key(a, engine="torch", device="cpu", dtype="auto")
    assert store.get(key) is None
    store.put(key, PERF)
    assert store.get(key) == PERF
    assert profile_key(b, engine="torch", device="cpu", dtype="auto") == key
    assert profile_key(c, engine="torch", device="cpu", dtype="auto") != key
    assert profile_key(a, engine="openvino", device="cpu", dtype="auto") != key
    assert profile_key(a, engine="torch", device="cpu", dtype="bfloat16") != key


def test_an_unreadable_entry_is_no_entry(tmp_path):
    store = ProfileStore(tmp_path)
    (tmp_path / "k.json").write_text("{not json")
    assert store.get("k") is None
    bad = msgspec.json.encode(PERF).replace(
        b'"prefill_lengths":[16,32]', b'"prefill_lengths":[32,16]'
    )
    (tmp_path / "j.json").write_bytes(bad)  # a grid out of order
    assert store.get("j") is None
    store.put("k", PERF)
    assert store.get("k") == PERF
    assert sorted(p.name for p in tmp_path.iterdir()) == ["j.json", "k.json"]  # no temporary file


def test_the_grid_is_measured_on_the_engine_and_leaves_it_empty(tmp_path):
    """Decode points of up to 32 sequences whose prompts join over many iterations (a
    64-token prefill budget); the capacity read off the grid."""
    from services.task_executor.engines.torch_engine import TorchEngine
    from services.task_executor.perf_profile import COARSE, measure_perf_model
    from tests.unit.test_torch_engine import VOCAB, _write_tiny_llama

    model = _write_tiny_llama(tmp_path / "m", max_position_embeddings=1024)
    engine = TorchEngine(model, device="cpu", max_prefill_tokens=64, num_kv_blocks=2048)
    try:
        perf = measure_perf_model(engine, vocab=VOCAB, max_num_seqs=32, grid=COARSE)
        assert not engine.has_work()
    finally:
        engine.close()
    assert perf.grid == "coarse" and perf.decode_batches == [1, 32]
    assert perf.prefill_lengths == [16, 512] and perf.decode_contexts == [128, 512]
    assert all(t > 0 for row in perf.decode_s for t in row)
    # 32 × 512 tokens is past the corners' budget: carried on, and said so.
    assert perf.extrapolated == [[False, False], [False, True]]
    cap = perf.capacity()
    assert cap.decode_step_s > 0 and cap.decode_s == pytest.approx(cap.decode_step_s / 32)
    assert cap.prefill_s > 0 and cap.max_num_seqs == 32


def test_a_profile_made_offline_is_stored_with_the_model_and_found_by_a_load(tmp_path):
    from services.task_executor.capacity import MODEL_STORE, find_or_measure, profile_model
    from services.task_executor.engines.torch_engine import TorchEngine
    from shared.settings import Settings
    from tests.unit.test_torch_engine import _write_tiny_llama

    model = _write_tiny_llama(tmp_path / "tiny")
    settings = Settings.load(
        engine="torch", device="cpu", capacity_cache=str(tmp_path / "host"), host_cache={"bytes": 0}
    )
    # A load that finds nothing measures the corners, stored in both places.
    engine = TorchEngine(model, device="cpu")
    try:
        coarse, where = find_or_measure(engine, model, settings)
    finally:
        engine.close()
    assert where == "measured" and coarse is not None and coarse.prefill_s > 0
    # `meshserve profile` measures the full grid over them.
    perf, where = profile_model(model, settings)
    assert (where, perf.grid) == ("measured", "full") and len(perf.decode_batches) > 2
    assert [p.name for p in (model / MODEL_STORE).glob("*.json")]
    # Another host's TE (an empty host store) finds it with the model, measures nothing,
    # and keeps a copy on its host.
    other = settings.with_values(capacity_cache=str(tmp_path / "other-host"))
    engine = TorchEngine(model, device="cpu")
    try:
        assert find_or_measure(engine, model, other, measure=False) == (perf.capacity(), "model")
    finally:
        engine.close()
    assert list((tmp_path / "other-host" / "perf").glob("*.json"))
    assert profile_model(model, settings) == (perf, "model")
