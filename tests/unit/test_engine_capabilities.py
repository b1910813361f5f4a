"""Engine capabilities: declared as data, checked against the engine's methods when a model
loads, and never claimed beyond what the engine (or the pipe to its process) can do."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from safetensors.torch import load_file

from services.task_executor.engines.base import (
    EngineCapabilities,
    EngineOutput,
    EngineRequest,
    EngineStats,
    PrefillBudget,
)
from services.task_executor.engines.capabilities import (
    CapabilityError,
    bind_features,
    check_role,
)
from services.task_executor.engines.factory import create_engine
from services.task_executor.engines.torch_engine import TorchEngine
from shared.messages.cluster import TEHeartbeat, TEState
from shared.messages.kv import KvEvent
from shared.messages.tasks import TaskMode
from shared.settings import Settings
from tests.engines import drain, tokens
from tests.unit.test_torch_engine import PROMPTS, _write_tiny_llama, greedy


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


class _Minimal:
    """Generates, and declares what the test says; implements no sub-protocol."""

    name = "minimal"
    device = "cpu"
    max_model_len = 16
    prefill_budget = PrefillBudget(16, chunked=False)

    def __init__(self, capabilities: EngineCapabilities) -> None:
        self.capabilities = capabilities

    def add_request(self, request: EngineRequest) -> None:
        pass

    def abort(self, request_id: str) -> None:
        pass

    def has_work(self) -> bool:
        return False

    def step(self) -> list[EngineOutput]:
        return []

    def stats(self) -> EngineStats:
        return EngineStats(running=0, waiting=0, free_kv_blocks=0, total_kv_blocks=0)

    def close(self) -> None:
        pass


class _WithEvents(_Minimal):
    block_size = 8

    def drain_kv_events(self) -> list[KvEvent]:
        return []


@pytest.mark.parametrize(
    "flag", ["kv_events", "kv_export", "kv_import", "prefix_pinning", "host_kv_tier"]
)
def test_a_declared_capability_without_its_methods_fails_the_load(flag: str) -> None:
    caps = EngineCapabilities(prefix_cache=True, **{flag: True})
    with pytest.raises(CapabilityError, match=flag):
        bind_features(_Minimal(caps))


def test_methods_without_the_declaration_are_not_used() -> None:
    """An engine may implement more than it offers (prefix caching switched off): only the
    declaration counts."""
    features = bind_features(_WithEvents(EngineCapabilities(prefix_cache=True)))
    assert features.kv_events is None
    engine = _WithEvents(EngineCapabilities(prefix_cache=True, kv_events=True))
    assert bind_features(engine).kv_events is engine


def test_kv_events_need_a_prefix_cache() -> None:
    with pytest.raises(CapabilityError, match="prefix_cache"):
        bind_features(_WithEvents(EngineCapabilities(kv_events=True)))


def test_prefill_and_decode_modes_need_kv_export_and_import() -> None:
    with pytest.raises(CapabilityError, match="prefill without kv_export"):
        bind_features(_Minimal(EngineCapabilities(modes=frozenset(TaskMode))))
    with pytest.raises(CapabilityError, match="decode without kv_import"):
        bind_features(
            _Minimal(EngineCapabilities(modes=frozenset({TaskMode.COLOCATED, TaskMode.DECODE})))
        )


def test_a_role_the_engine_cannot_serve_fails_the_load(model_dir: Path) -> None:
    colocated_only = _Minimal(EngineCapabilities())
    check_role(colocated_only, TaskMode.COLOCATED)
    for role in (TaskMode.PREFILL, TaskMode.DECODE):
        with pytest.raises(CapabilityError, match=f"cannot serve as a {role} instance"):
            check_role(colocated_only, role)
    torch_engine = TorchEngine(model_dir, device="cpu", num_kv_blocks=32)
    try:
        for role in TaskMode:
            check_role(torch_engine, role)
    finally:
        torch_engine.close()


def test_the_torch_engine_declares_what_its_settings_give(model_dir: Path) -> None:
    full = TorchEngine(model_dir, device="cpu", num_kv_blocks=32, num_host_kv_blocks=8)
    plain = TorchEngine(model_dir, device="cpu", num_kv_blocks=32, enable_prefix_caching=False)
    try:
        features = bind_features(full)
        assert full.capabilities.host_kv_tier and features.host_kv_tier is full
        assert features.kv_events is full and features.kv_export is full
        assert features.kv_import is full and features.prefix_pinning is full
        # Without a prefix cache it neither caches, nor pins, nor has events to publish; it
        # still hands KV over.
        caps = plain.capabilities
        assert not (caps.prefix_cache or caps.kv_events or caps.prefix_pinning)
        assert not caps.host_kv_tier and caps.kv_export and caps.kv_import
        assert bind_features(plain).kv_events is None
    finally:
        full.close()
        plain.close()


def test_capabilities_travel_in_the_heartbeat(model_dir: Path) -> None:
    engine = TorchEngine(model_dir, device="cpu", num_kv_blocks=32)
    try:
        hb = TEHeartbeat(
            te_id="te",
            pool_id="p",
            host="h",
            pid=1,
            state=TEState.READY,
            started_at=0.0,
            engine_capabilities=engine.capabilities,
        )
        back = msgspec.msgpack.decode(msgspec.msgpack.encode(hb), type=TEHeartbeat)
        assert back.engine_capabilities == engine.capabilities
    finally:
        engine.close()


class _DictTensors:
    """Weights held in memory, as a host cache would hand them over."""

    def __init__(self, tensors: dict) -> None:
        self._t = tensors
        self.reads: list[str] = []

    def names(self):  # type: ignore[no-untyped-def]
        return self._t.keys()

    def __contains__(self, name: object) -> bool:
        return name in self._t

    def get(self, name: str):  # type: ignore[no-untyped-def]
        self.reads.append(name)
        return self._t[name]


def test_the_torch_engine_builds_from_tensors_handed_over(model_dir: Path, tmp_path: Path) -> None:
    """Only the config is read from the directory: the weights come from the source."""
    source = _DictTensors(load_file(model_dir / "model.safetensors"))
    cfg_only = tmp_path / "cfg-only"
    cfg_only.mkdir()
    (cfg_only / "config.json").write_text((model_dir / "config.json").read_text())
    # The fingerprint of the weights still comes from the checkpoint's files; the engine is
    # built from the tensors the source hands over.
    (cfg_only / "model.safetensors").write_bytes((model_dir / "model.safetensors").read_bytes())
    handed = TorchEngine(cfg_only, device="cpu", num_kv_blocks=32, tensors=source)
    read = TorchEngine(model_dir, device="cpu", num_kv_blocks=32)
    try:
        assert source.reads and handed.capabilities.weight_source
        got = {}
        for engine in (handed, read):
            for rid, prompt in PROMPTS.items():
                engine.add_request(EngineRequest(rid, prompt, greedy(6)))
            got[engine is handed] = {rid: tokens(o) for rid, o in drain(engine).items()}
        assert got[True] == got[False]
    finally:
        handed.close()
        read.close()


def test_an_engine_in_a_child_process_takes_no_tensors(model_dir: Path) -> None:
    settings = Settings(engine="openvino")
    with pytest.raises(CapabilityError, match="openvino"):
        create_engine("m", model_dir, settings, tensors=_DictTensors({}))
