"""Fixtures shared by every test suite."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model (trained as `scripts/make-demo-model` builds it), generated once per
    session: 20-30 s on 2 cores."""
    # Imported here: torch is heavy, and most suites never ask for a model.
    from shared.modelgen import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("models") / "demo")
