"""ProcessEngine: an engine in a child process behaves as it does in-process, and a step that
holds the GIL there no longer stops the parent's threads."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest

from services.task_executor.engines.base import (
    EngineCapabilities,
    EngineOutput,
    EngineRequest,
    EngineStats,
    PrefillBudget,
)
from services.task_executor.engines.process import EngineProcessDied, ProcessEngine
from services.task_executor.engines.torch_engine import TorchEngine
from shared.messages.kv import KvAllCleared
from shared.messages.tasks import TaskMode
from tests.engines import drain, tokens
from tests.unit.test_torch_engine import PROMPTS, _write_tiny_llama, greedy


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _torch(model_dir: Path) -> functools.partial[TorchEngine]:
    return functools.partial(TorchEngine, model_dir, device="cpu", block_size=4, num_kv_blocks=64)


def test_a_torch_engine_in_a_child_process_gives_the_same_outputs(model_dir: Path) -> None:
    local = _torch(model_dir)()
    remote = ProcessEngine(_torch(model_dir), label="test")
    try:
        assert (remote.name, remote.device, remote.max_model_len) == ("torch", "cpu", 128)
        # What the pipe carries: generating and KV events; not the KV hand-over, the host
        # tier or prefill pacing, which the child's torch engine has.
        caps = local.capabilities
        assert caps.kv_events and caps.kv_export and caps.prefix_pinning and caps.prefill_pacing
        assert remote.capabilities == msgspec.structs.replace(
            caps,
            modes=frozenset({TaskMode.COLOCATED}),  # no KV crosses the pipe: no PD role
            kv_export=False,
            kv_import=False,
            prefix_pinning=False,
            weight_source=False,
            prefill_pacing=False,
            kv_resize=False,  # nor does a resize: only what crosses is claimed
        )
        assert remote.block_size == 4 and remote.prefill_budget == local.prefill_budget
        assert not remote.has_work()
        for engine in (local, remote):
            for rid, prompt in PROMPTS.items():
                engine.add_request(EngineRequest(rid, prompt, greedy(9)))
        assert remote.has_work() and remote.stats().waiting == 3  # as of the last reply
        want = {rid: tokens(o) for rid, o in drain(local).items()}
        got = {rid: tokens(o) for rid, o in drain(remote).items()}
        assert got == want
        assert not remote.has_work()
        assert remote.stats().free_kv_blocks == remote.stats().total_kv_blocks == 64
        assert remote.drain_kv_events()  # the prefix cache's events cross the pipe too

        with pytest.raises(ValueError, match="empty"):  # the engine's own error, raised here
            remote.add_request(EngineRequest("e", [], greedy(4)))
        remote.add_request(EngineRequest("a2", PROMPTS["a"], greedy(50)))
        remote.step()
        remote.abort("a2")
        assert remote.step() == [] and not remote.has_work()
    finally:
        remote.close()
        local.close()
    assert not remote.alive()
    # What closing said (the cache cleared) is drained after close, once, as in-process.
    assert isinstance(remote.drain_kv_events()[-1], KvAllCleared)
    assert remote.drain_kv_events() == []
    remote.close()  # twice: a no-op
    with pytest.raises(RuntimeError, match="closed"):
        remote.step()


class GilHoldingEngine:
    """A step that keeps the GIL for a while inside one C call, as GenAI's step() does."""

    name = "gil"
    device = "cpu"
    capabilities = EngineCapabilities()
    max_model_len = 64
    prefill_budget = PrefillBudget(64, chunked=False)

    def __init__(self) -> None:
        self._queued: list[str] = []

    def add_request(self, request: EngineRequest) -> None:
        self._queued.append(request.request_id)

    def abort(self, request_id: str) -> None:
        pass

    def has_work(self) -> bool:
        return bool(self._queued)

    def step(self) -> list[EngineOutput]:
        sum(range(40_000_000))  # no bytecode runs inside: the GIL is never offered
        done, self._queued = self._queued, []
        return [EngineOutput(rid, [1], finished=True, finish_reason="length") for rid in done]

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self._queued), waiting=0, free_kv_blocks=1, total_kv_blocks=1
        )

    def close(self) -> None:
        pass


def _ticks_during_step(engine: object) -> tuple[int, float]:
    """How often another thread of this process ran during one step, and the step's time."""
    ticks, stop = [0], threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.002)

    engine.add_request(EngineRequest("r", [1], greedy(1)))  # type: ignore[attr-defined]
    thread = threading.Thread(target=tick)
    thread.start()
    time.sleep(0.05)
    before, t = ticks[0], time.perf_counter()
    out = engine.step()  # type: ignore[attr-defined]
    took, during = time.perf_counter() - t, ticks[0] - before
    stop.set()
    thread.join()
    assert [o.request_id for o in out] == ["r"]
    return during, took


def test_a_step_holding_the_gil_in_the_child_leaves_the_parent_running() -> None:
    local_ticks, local_s = _ticks_during_step(GilHoldingEngine())
    remote = ProcessEngine(GilHoldingEngine, label="test")
    try:
        remote_ticks, remote_s = _ticks_during_step(remote)
        assert remote.drain_kv_events() == []  # an engine without a prefix index has none
    finally:
        remote.close()
    assert local_s > 0.2 and remote_s > 0.2
    assert local_ticks <= 2  # frozen: what a TE's event loop went through
    assert remote_ticks >= 0.25 * remote_s / 0.002  # ran throughout, give or take the host


def test_a_dead_child_makes_the_next_call_fail_clearly(model_dir: Path) -> None:
    remote = ProcessEngine(_torch(model_dir), label="test")
    assert remote.pid is not None
    os.kill(remote.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while remote.alive():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(EngineProcessDied, match="exited"):
        remote.add_request(EngineRequest("a", PROMPTS["a"], greedy(4)))
    assert not remote.has_work()
    remote.close()


def test_an_engine_that_fails_to_build_raises_in_the_parent(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        ProcessEngine(functools.partial(TorchEngine, tmp_path, device="cpu"), label="test")


def test_a_factory_the_child_cannot_import_fails_clearly(tmp_path: Path) -> None:
    """The parent can pickle the factory, the child cannot load it (a module only the
    parent's path has): the child's ImportError is raised here, and the child is gone."""
    (tmp_path / "only_here.py").write_text("class Engine:\n    pass\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import only_here  # type: ignore[import-not-found]

        with pytest.raises(ModuleNotFoundError, match="only_here"):
            ProcessEngine(only_here.Engine, label="test")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("only_here", None)


def test_the_child_exits_when_its_parent_is_killed(tmp_path: Path) -> None:
    """A TE killed with SIGKILL leaves no engine process behind holding the model."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import time\n"
        "from services.task_executor.engines.process import ProcessEngine\n"
        "from tests.unit.test_process_engine import GilHoldingEngine\n"
        "if __name__ == '__main__':\n"
        "    engine = ProcessEngine(GilHoldingEngine, label='orphan')\n"
        "    print(engine.pid, flush=True)\n"
        "    time.sleep(120)\n"
    )
    root = Path(__file__).resolve().parents[2]
    parent = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 20
    while _alive(child):
        assert time.monotonic() < deadline, "the engine process outlived its parent"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited (its new parent reaps it)
