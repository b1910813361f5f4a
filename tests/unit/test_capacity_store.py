"""A TE's measured capacities on disk: keyed by what the figures depend on."""

import json

import pytest

from services.task_executor.capacity import CapacityStore
from shared.messages.scaling import InstanceCapacity

CAP = InstanceCapacity(
    prefill_s=1e-3, prefill_attention_s=2e-7, decode_s=0.01, decode_context_s=1e-6, max_num_seqs=8
)


def _model(path, **config):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"hidden_size": 128, **config}))
    return path


def test_round_trip_and_what_the_key_depends_on(tmp_path):
    store = CapacityStore(tmp_path / "cache")
    a = _model(tmp_path / "a")
    b = _model(tmp_path / "b")  # another checkpoint of the same architecture
    c = _model(tmp_path / "c", hidden_size=256)
    (b / "model.safetensors").write_bytes(b"other weights")
    key = store.key(a, engine="torch", device="cpu", dtype="auto")
    assert store.get(key) is None
    store.put(key, CAP)
    assert store.get(key) == CAP
    assert store.key(b, engine="torch", device="cpu", dtype="auto") == key
    assert store.key(c, engine="torch", device="cpu", dtype="auto") != key
    assert store.key(a, engine="openvino", device="cpu", dtype="auto") != key
    assert store.key(a, engine="torch", device="cpu", dtype="bfloat16") != key


def test_an_unreadable_entry_is_no_entry(tmp_path):
    store = CapacityStore(tmp_path)
    (tmp_path / "k.json").write_text("{not json")
    assert store.get("k") is None
    store.put("k", CAP)
    assert store.get("k") == CAP
    assert [p.name for p in tmp_path.iterdir()] == ["k.json"]  # no temporary file left


def test_the_probe_times_a_full_batch_whose_prompts_join_over_many_iterations(tmp_path):
    """32 prompts of 128 tokens under a 64-token prefill budget join over 64 iterations:
    the decode probe still times steps of all 32 together (and leaves the engine empty)."""
    from services.task_executor.capacity import measure_capacity
    from services.task_executor.engines.torch_engine import TorchEngine
    from tests.unit.test_torch_engine import VOCAB, _write_tiny_llama

    model = _write_tiny_llama(tmp_path / "m", max_position_embeddings=256)
    engine = TorchEngine(model, device="cpu", max_prefill_tokens=64, num_kv_blocks=2048)
    try:
        cap = measure_capacity(engine, vocab=VOCAB, max_num_seqs=32)
        assert cap.decode_step_s > 0 and cap.decode_s == pytest.approx(cap.decode_step_s / 32)
        assert cap.prefill_s > 0 and not engine.has_work()
    finally:
        engine.close()


def test_a_profile_made_offline_is_stored_with_the_model_and_found_by_a_load(tmp_path):
    from services.task_executor.capacity import MODEL_STORE, find_or_measure, profile_model
    from services.task_executor.engines.torch_engine import TorchEngine
    from shared.settings import Settings
    from tests.unit.test_torch_engine import _write_tiny_llama

    model = _write_tiny_llama(tmp_path / "tiny")
    settings = Settings.load(
        engine="torch", device="cpu", capacity_cache=str(tmp_path / "host"), host_cache={"bytes": 0}
    )
    capacity, where = profile_model(model, settings)
    assert where == "measured" and capacity is not None and capacity.prefill_s > 0
    assert list((model / MODEL_STORE).glob("*.json"))
    # Another host's TE (an empty host store) finds it with the model and measures nothing.
    other = settings.with_values(capacity_cache=str(tmp_path / "other-host"))
    engine = TorchEngine(model, device="cpu")
    assert find_or_measure(engine, model, other, measure=False) == (capacity, "model")
    assert list((tmp_path / "other-host").glob("*.json"))  # and keeps a copy on its host
    assert profile_model(model, settings)[1] == "model"
