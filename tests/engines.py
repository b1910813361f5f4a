"""Driving an engine in tests: step it until its requests are done, collect what it said; the
device the torch engine's tests run on."""

from __future__ import annotations

import os

from services.task_executor.engines.base import Engine, EngineOutput

# The torch engine's suites (test_torch_engine, test_prefix_cache, test_kv_transfer,
# test_torch_engine_async) run on this device: "cpu" unless MESHSERVE_TEST_DEVICE names
# another ("cuda" on a GPU host). test_torch_engine_cuda runs on CUDA wherever there is one.
TEST_DEVICE = os.environ.get("MESHSERVE_TEST_DEVICE", "cpu")


def drain(engine: Engine, max_steps: int = 1000) -> dict[str, list[EngineOutput]]:
    """Each request's outputs, in order, once the engine has no work left."""
    outs: dict[str, list[EngineOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return outs
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    raise AssertionError("the engine did not finish its requests")


def tokens(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]
