"""Which engine a TE builds."""

import importlib.util

from services.task_executor.engines import factory
from services.task_executor.engines.factory import choose_engine
from shared.settings import Settings


def test_model_override_beats_the_global_choice():
    s = Settings(engine="torch", model_engines={"demo": "openvino"})
    assert choose_engine(s, "demo") == "openvino"
    assert choose_engine(s, "other") == "torch"


def test_model_engines_from_the_environment(monkeypatch):
    monkeypatch.setenv("MESHSERVE_MODEL_ENGINES", '{"demo": "vllm"}')
    assert choose_engine(Settings.load(), "demo") == "vllm"


def test_auto_picks_vllm_only_with_cuda_and_vllm(monkeypatch):
    has_vllm = importlib.util.find_spec("vllm") is not None
    monkeypatch.setattr(factory, "cuda_available", lambda: True)
    assert choose_engine(Settings()) == ("vllm" if has_vllm else "torch")
    monkeypatch.setattr(factory, "cuda_available", lambda: False)
    assert choose_engine(Settings()) == "torch"
