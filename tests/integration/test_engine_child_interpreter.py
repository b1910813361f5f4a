"""An engine whose package cannot share the TE's environment (vLLM's CPU build pins its own
torch) runs in a child process under another venv's interpreter: a real venv is built here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.task_executor.engines.process import ProcessEngine

LIGHT_ENGINE = """
import sys
from services.task_executor.engines.base import EngineCapabilities, PrefillBudget

HEAVY = ("torch", "transformers", "pydantic", "pydantic_settings", "nats", "redis", "pytest")


class Engine:
    capabilities = EngineCapabilities()
    max_model_len = 1
    prefill_budget = PrefillBudget(1, chunked=False)

    def __init__(self):
        self.device = sys.executable  # which interpreter runs it
        self.name = ",".join(m for m in HEAVY if m in sys.modules)  # what it has imported

    def close(self):
        pass
"""


def test_the_child_runs_under_the_interpreter_named_and_imports_little(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine from another venv (vLLM's CPU build has its own): the child is that venv's
    python with the repository on its path, and imports the protocol's types, not the TE's
    packages."""
    venv = tmp_path / "other-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    # The bare venv sees the parent's packages (msgspec is all the child needs of them).
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "parent.pth").write_text("\n".join(p for p in sys.path if "site-packages" in p))
    (tmp_path / "light_engine.py").write_text(LIGHT_ENGINE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    import importlib

    monkeypatch.syspath_prepend(str(tmp_path))
    light = importlib.import_module("light_engine")
    remote = ProcessEngine(light.Engine, label="test", python=str(venv / "bin" / "python"))
    try:
        assert Path(remote.device).parent == venv / "bin"
        assert remote.name == ""  # none of the heavy packages
        assert remote.pid != os.getpid()
    finally:
        remote.close()
        sys.modules.pop("light_engine", None)
    assert not remote.alive()
