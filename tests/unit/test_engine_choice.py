"""MESHSERVE_ENGINE=auto: the engine measured fastest for the device and the precision asked
for, unless the deployment needs what only another has; the reason travels with the choice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.task_executor.engines import factory
from services.task_executor.engines.choice import OFFERS, HostView, Wanted, choose
from shared.messages.cluster import EngineCapabilities
from shared.settings import Settings
from tests.unit.test_torch_engine import _write_tiny_llama

ALL = frozenset({"torch", "openvino", "vllm"})
CPU = HostView(device="cpu", installed=ALL)
GPU = HostView(device="cuda", installed=ALL)


def test_cpu_at_the_checkpoints_precision_gets_the_torch_engine() -> None:
    choice = choose(CPU, Wanted("auto"))
    assert choice.engine == "torch" and "checkpoint's precision" in choice.reason


def test_compressed_weights_on_a_cpu_go_to_openvino_when_it_is_installed() -> None:
    assert choose(CPU, Wanted("auto", weight_format="int8")).engine == "openvino"
    assert choose(CPU, Wanted("auto", weight_format="int4")).engine == "openvino"
    without = choose(HostView("cpu", frozenset({"torch"})), Wanted("auto", weight_format="int8"))
    assert without.engine == "torch" and "not installed" in without.reason


def test_a_gpu_gets_vllm_where_installed_else_torch() -> None:
    assert choose(GPU, Wanted("auto")).engine == "vllm"
    assert choose(HostView("cuda", frozenset({"torch"})), Wanted("auto")).engine == "torch"


@pytest.mark.parametrize("needs", [{"kv_export", "kv_import"}, {"kv_events"}])
def test_a_needed_capability_only_torch_has_beats_speed(needs: set[str]) -> None:
    for host, weights in ((GPU, "auto"), (CPU, "int8")):
        choice = choose(host, Wanted("auto", weight_format=weights, needs=frozenset(needs)))  # type: ignore[arg-type]
        assert choice.engine == "torch" and "needs" in choice.reason


def test_a_named_engine_is_kept_and_says_what_it_lacks() -> None:
    choice = choose(CPU, Wanted("vllm", pinned_by="MESHSERVE_ENGINE"))
    assert choice == choose(CPU, Wanted("vllm", pinned_by="MESHSERVE_ENGINE"))
    assert choice.engine == "vllm" and "MESHSERVE_ENGINE" in choice.reason
    lacking = choose(CPU, Wanted("openvino", "MESHSERVE_ENGINE", needs=frozenset({"kv_events"})))
    assert lacking.engine == "openvino" and "lacks kv_events" in lacking.reason


def test_no_engine_declares_more_than_the_choice_knows_it_offers(tmp_path: Path) -> None:
    """OFFERS is what auto relies on before a load; every engine's declaration stays inside it."""
    from services.task_executor.engines.torch_engine import TorchEngine

    engine = TorchEngine(
        _write_tiny_llama(tmp_path / "m"), device="cpu", num_host_kv_blocks=4, num_kv_blocks=32
    )
    flags = [f for f in EngineCapabilities.__struct_fields__ if f != "modes"]
    declared = {f for f in flags if getattr(engine.capabilities, f)}
    engine.close()
    assert declared <= OFFERS["torch"], declared - OFFERS["torch"]
    assert set(OFFERS["torch"]) <= set(flags)  # every name in the table is a real flag
    for name in ("openvino", "vllm"):
        assert OFFERS[name] <= set(flags)


def test_the_settings_and_the_model_config_reach_the_choice(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(factory, "cuda_available", lambda: False)
    model = _write_tiny_llama(tmp_path / "m")
    assert factory.engine_choice(Settings(), "m", model).engine == "torch"
    # int8 asked in the settings, or by the model's own quantization config
    assert factory.engine_choice(Settings(weight_format="int8"), "m", model).engine == "openvino"
    quantized = _write_tiny_llama(tmp_path / "q")
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (quantized / "config.json").write_text(json.dumps(config))
    assert factory.engine_choice(Settings(), "q", quantized).engine == "openvino"
    # what the deployment needs, from the environment
    monkeypatch.setenv("MESHSERVE_ENGINE_NEEDS", '["kv_events"]')
    monkeypatch.setenv("MESHSERVE_WEIGHT_FORMAT", "int8")
    assert factory.engine_choice(Settings.load(), "m", model).engine == "torch"
    # the OpenVINO IR follows the weight format asked for
    assert factory.openvino_engine_args(Settings(weight_format="int4"))["weight_format"] == "int4"
    assert factory.openvino_engine_args(Settings())["weight_format"] == "int8"
