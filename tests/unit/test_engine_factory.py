"""Which engine a TE builds."""

import importlib.util
import subprocess
import sys
from pathlib import Path

from services.task_executor.engines import factory
from services.task_executor.engines.factory import choose_engine
from shared.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


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


def test_prewarm_imports_the_engine_before_any_load():
    """A pre-warmed TE has paid for torch and the engine's modules before a model arrives."""
    code = (
        "import sys\n"
        "from services.task_executor.engines.factory import prewarm\n"
        "from shared.settings import Settings\n"
        "assert 'torch' not in sys.modules\n"
        "prewarm(Settings(engine='torch', cpu_kernels=False))\n"
        "assert 'services.task_executor.engines.torch_engine.engine' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)
