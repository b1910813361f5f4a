"""A local cluster for the fuzz tests: the e2e `Cluster` on the session's NATS and Redis,
with a small body limit so that oversized bodies are cheap to send."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import Cluster, e2e_models_dir  # noqa: F401
from tests.infra import nats_url, redis_url  # noqa: F401

MAX_BODY = 8 * 1024**2


@pytest.fixture(scope="module")
def fuzz_cluster(
    e2e_models_dir: Path,  # noqa: F811
    nats_url: str,  # noqa: F811
    redis_url: str,  # noqa: F811
) -> Iterator[Cluster]:
    # A long keep-alive: the model stays loaded, so the process set does not change while
    # the tests compare it.
    c = Cluster(
        e2e_models_dir, nats_url, redis_url, keep_alive="600", max_body_bytes=str(MAX_BODY)
    ).start()
    yield c
    c.stop()


@pytest.fixture
def fuzz_examples(request: pytest.FixtureRequest) -> int:
    """Examples per operation and generation mode (`--fuzz-examples`, `scripts/fuzz`)."""
    return int(request.config.getoption("--fuzz-examples"))
