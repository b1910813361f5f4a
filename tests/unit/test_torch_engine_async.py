"""Async scheduling in the torch engine (the next decode iteration launched while the host
finishes the current one) changes nothing a TE would notice: every step returns the same outputs
as with it off, over a workload that exercises what can invalidate a launch ahead — requests
joining mid-run, stop tokens (found one step late), max_tokens, aborts of running and waiting
requests, preemption of a full cache, shared prefixes, seeded sampling with and without top_p.
Both launchers run on CPU here: the forward thread (CPU's, with ``overlap_on_cpu``) and inline
launches (CUDA's, where kernels are asynchronous; on CPU they run at once)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from services.task_executor.engines.base import EngineRequest
from services.task_executor.engines.torch_engine import TorchEngine, overlap
from services.task_executor.engines.torch_engine import engine as engine_module
from shared.messages.api import SamplingParams
from tests.engines import TEST_DEVICE, drain, tokens
from tests.unit.test_torch_engine import VOCAB, _write_tiny_llama, greedy

STOPS = list(range(3, VOCAB, 9))  # about one token in nine ends a request that stops on them


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(params=["thread", "inline"])
def launcher(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "inline":  # CUDA's launcher, whose launches are synchronous on CPU
        monkeypatch.setattr(
            engine_module, "make_launcher", lambda *_, **__: overlap.InlineLauncher()
        )
    return request.param


def _engine(model_dir: Path, async_scheduling: bool, **kwargs: object) -> TorchEngine:
    kwargs = {"device": TEST_DEVICE, "block_size": 4, "num_kv_blocks": 64} | kwargs
    return TorchEngine(
        model_dir,
        async_scheduling=async_scheduling,
        overlap_on_cpu=True,
        **kwargs,  # type: ignore[arg-type]
    )


def _params(i: int, gen: torch.Generator) -> SamplingParams:
    n = int(torch.randint(1, 24, (1,), generator=gen))
    kind = i % 5
    if kind == 0:
        return greedy(n)
    if kind == 1:
        return SamplingParams(max_tokens=24, temperature=0, stop_token_ids=STOPS)
    if kind == 2:
        return SamplingParams(max_tokens=n, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
    if kind == 3:
        return SamplingParams(max_tokens=24, temperature=1.0, seed=100 + i, stop_token_ids=STOPS)
    return SamplingParams(max_tokens=n, temperature=1.3, top_p=0.5, seed=200 + i)


def _workload(seed: int, n: int) -> dict[int, list[EngineRequest]]:
    """Requests by the step before which they are added; prompts share prefixes."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, VOCAB, (9,), generator=gen).tolist()
    plan: dict[int, list[EngineRequest]] = {}
    for i in range(n):
        own = torch.randint(
            0, VOCAB, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen
        )
        prompt = (shared[: i % 10] if i % 3 else []) + own.tolist()
        at = int(torch.randint(0, 3 * n, (1,), generator=gen))
        plan.setdefault(at, []).append(EngineRequest(f"r{i}", prompt, _params(i, gen)))
    return plan


def _run(
    model_dir: Path, async_scheduling: bool, plan: dict[int, list[EngineRequest]], **kwargs: Any
) -> tuple[list[Any], TorchEngine]:
    """Every step's outputs and queue lengths; aborts at fixed steps (the oldest running request,
    then the newest waiting one)."""
    engine = _engine(model_dir, async_scheduling, **kwargs)
    trace: list[Any] = []
    for step in range(1000):
        for req in plan.get(step, []):
            engine.add_request(req)
        if step % 11 == 5 and engine._running:
            engine.abort(engine._running[0].request_id)
        if step % 13 == 7 and engine._waiting:
            engine.abort(engine._waiting[-1].request_id)
        if not engine.has_work() and step > max(plan):
            break
        outs = engine.step()
        stats = engine.stats()
        trace.append(
            (
                [
                    (o.request_id, o.new_token_ids, o.finish_reason, o.num_cached_tokens)
                    for o in outs
                ],
                stats.running,
                stats.waiting,
            )
        )
    assert not engine.has_work()
    stats = engine.stats()
    assert stats.free_kv_blocks == stats.total_kv_blocks  # nothing leaked, ahead or not
    return trace, engine


@pytest.mark.parametrize(
    ("seed", "kwargs"),
    [
        (0, {}),
        (1, {"max_num_seqs": 4}),  # a queue waits for free sequence slots
        (2, {"num_kv_blocks": 18}),  # a full cache: preemption and recomputation
        (3, {"enable_prefix_caching": False}),
    ],
)
def test_every_step_returns_what_it_returns_without_async_scheduling(
    model_dir: Path, launcher: str, seed: int, kwargs: dict[str, Any]
) -> None:
    plan = _workload(seed, 24)
    sync, off = _run(model_dir, False, plan, **kwargs)
    overlapped, on = _run(model_dir, True, plan, **kwargs)
    assert overlapped == sync
    assert off.overlap.launched == 0
    # The workload did exercise it: launches ahead whose rows were used, and some thrown away
    # (stop tokens, aborts).
    assert on.overlap.launched > len(sync) // 3
    assert on.overlap.rows_used > 0 and on.overlap.rows_wasted > 0
    reasons = {o[2] for step in sync for o in step[0]}
    assert {"stop", "length"} <= reasons


def test_kv_export_mid_decode_matches_the_synchronous_engine(
    model_dir: Path, launcher: str
) -> None:
    # export_kv while the next iteration is launched (on CPU: maybe still running) sees the
    # state step() returned, and the KV bytes of the synchronous engine.
    params = SamplingParams(max_tokens=20, temperature=0.7, seed=5, ignore_eos=True)
    prompt = [5, 17, 42, 8, 61, 3, 29, 11, 2]
    exports = []
    for on in (False, True):
        engine = _engine(model_dir, on)
        engine.add_request(EngineRequest("r", prompt, params))
        engine.add_request(EngineRequest("other", prompt[:4], greedy(20)))
        for _ in range(6):
            engine.step()
        assert not on or (engine._stepper is not None and engine._stepper.ahead is not None)
        exports.append(engine.export_kv("r"))
        engine.abort("r")
        rest = tokens(drain(engine)["other"])
        exports.append(rest)
    (sync_export, sync_rest), (async_export, async_rest) = exports[:2], exports[2:]
    assert async_export.token_ids == sync_export.token_ids
    assert async_export.num_computed_tokens == sync_export.num_computed_tokens == len(prompt) + 5
    assert torch.equal(async_export.kv, sync_export.kv)
    assert async_rest == sync_rest


def test_a_failing_forward_surfaces_from_step_and_the_engine_recovers(
    model_dir: Path, launcher: str
) -> None:
    expected = tokens(drain(_seeded(model_dir, False))["b"])
    engine = _seeded(model_dir, True)
    forward, calls = engine.runner.forward, []

    def flaky(*args: Any) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 4:  # a launch ahead, on CPU in the worker thread
            raise RuntimeError("device fault")
        return forward(*args)

    engine.runner.forward = flaky  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="device fault"):
        for _ in range(10):
            engine.step()
    engine.abort("a")  # what the TE does with the requests of a failed iteration
    engine.abort("b")
    assert not engine.has_work()
    assert engine.stats().free_kv_blocks == engine.stats().total_kv_blocks
    engine.add_request(EngineRequest("b", [11, 2, 9], _seeded_params()))
    assert tokens(drain(engine)["b"]) == expected


def _seeded_params() -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)


def _seeded(model_dir: Path, on: bool) -> TorchEngine:
    engine = _engine(model_dir, on)
    engine.add_request(EngineRequest("a", [5, 17, 42], greedy(8)))
    engine.add_request(EngineRequest("b", [11, 2, 9], _seeded_params()))
    return engine


def test_close_waits_for_a_launch_ahead(model_dir: Path, launcher: str) -> None:
    engine = _engine(model_dir, True)
    assert engine._stepper is not None
    launch_ahead = engine._stepper.launcher.launch_ahead
    launched: list[float] = []
    ended: list[float] = []

    def slow_ahead(run: Callable[[], torch.Tensor]) -> overlap.Launch:
        def slow() -> torch.Tensor:
            time.sleep(0.3)  # still running when close is called
            out = run()
            ended.append(time.monotonic())
            return out

        launched.append(time.monotonic())
        return launch_ahead(slow)

    engine._stepper.launcher.launch_ahead = slow_ahead  # type: ignore[method-assign]
    engine.add_request(EngineRequest("a", [5, 17, 42], greedy(30)))
    for _ in range(3):
        engine.step()
    assert engine._stepper.ahead is not None and launched
    engine.close()
    closed = time.monotonic()
    # Every iteration launched had ended when close returned (the KV cache it writes is freed).
    assert len(ended) == len(launched) and max(ended) <= closed
    with pytest.raises(RuntimeError, match="closed"):
        engine.step()


def test_cpu_runs_synchronously_unless_asked(model_dir: Path) -> None:
    # The forward thread buys nothing measurable on CPU (see overlap.make_launcher): by default
    # async_scheduling only changes CUDA engines.
    engine = TorchEngine(model_dir, device="cpu", block_size=4, num_kv_blocks=64)
    engine.add_request(EngineRequest("a", [5, 17, 42], greedy(8)))
    drain(engine)
    assert engine.overlap.launched == 0
