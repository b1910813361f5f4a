"""LoRA adapters across the pipe of an engine in a child process (``ProcessEngine``): loaded,
unloaded and pinned by name in the child's engine, its errors raised here, the adapters it
holds mirrored without a round trip; and the vLLM engine's choice of vLLM's LoRA rank."""

from __future__ import annotations

import functools

import pytest

from services.task_executor.engines.base import (
    EngineCapabilities,
    EngineOutput,
    EngineRequest,
    EngineStats,
    PrefillBudget,
)
from services.task_executor.engines.capabilities import CapabilityError, bind_features
from services.task_executor.engines.process import ProcessEngine
from services.task_executor.engines.vllm_engine import vllm_lora_rank
from shared.messages.api import SamplingParams
from shared.messages.tasks import TaskMode
from tests.engines import drain, tokens


class LoraEngine:
    """Echoes each request's adapter (its length as the one token), and serves adapters by
    name as the protocol says."""

    name = "fake-lora"
    device = "cpu"
    max_model_len = 64
    prefill_budget = PrefillBudget(64, chunked=False)

    def __init__(self, lora: bool = True) -> None:
        self.capabilities = EngineCapabilities(modes=frozenset({TaskMode.COLOCATED}), lora=lora)
        self._adapters: dict[str, str] = {}
        self._pinned: set[str] = set()
        self._queued: list[EngineRequest] = []

    def add_request(self, request: EngineRequest) -> None:
        if request.adapter and request.adapter not in self._adapters:
            raise ValueError(f"adapter {request.adapter!r} is not loaded")
        self._queued.append(request)

    def abort(self, request_id: str) -> None:
        self._queued = [r for r in self._queued if r.request_id != request_id]

    def has_work(self) -> bool:
        return bool(self._queued)

    def step(self) -> list[EngineOutput]:
        done, self._queued = self._queued, []
        return [
            EngineOutput(r.request_id, [len(r.adapter)], finished=True, finish_reason="length")
            for r in done
        ]

    def stats(self) -> EngineStats:
        return EngineStats(
            running=0, waiting=len(self._queued), free_kv_blocks=0, total_kv_blocks=0
        )

    def close(self) -> None:
        pass

    def load_adapter(self, name: str, path: str) -> None:
        if not path.startswith("/adapters/"):
            raise FileNotFoundError(f"no peft adapter in {path}")
        self._adapters[name] = path

    def unload_adapter(self, name: str) -> bool:
        if any(r.adapter == name for r in self._queued):
            raise ValueError(f"adapter {name!r} is in use by queued or running requests")
        self._pinned.discard(name)
        return self._adapters.pop(name, None) is not None

    def pin_adapter(self, name: str, pinned: bool) -> None:
        if name not in self._adapters:
            raise ValueError(f"adapter {name!r} is not loaded")
        (self._pinned.add if pinned else self._pinned.discard)(name)

    def adapters(self) -> list[str]:
        return [f"{n}*" if n in self._pinned else n for n in self._adapters]


def _request(rid: str, adapter: str = "") -> EngineRequest:
    return EngineRequest(rid, [1, 2], SamplingParams(max_tokens=1), adapter=adapter)


def test_adapters_are_served_across_the_pipe() -> None:
    engine = ProcessEngine(LoraEngine, label="test")
    try:
        assert engine.capabilities.lora and bind_features(engine).lora is engine
        assert engine.adapters() == []
        engine.load_adapter("abc", "/adapters/abc")
        engine.load_adapter("xy", "/adapters/xy")
        assert engine.adapters() == ["abc", "xy"]  # from the last reply
        engine.pin_adapter("abc", True)
        assert engine.adapters() == ["abc*", "xy"]
        with pytest.raises(FileNotFoundError, match="no peft adapter"):
            engine.load_adapter("bad", "/elsewhere")
        with pytest.raises(ValueError, match="'nope' is not loaded"):
            engine.add_request(_request("n", "nope"))
        engine.add_request(_request("a", "abc"))
        engine.add_request(_request("b"))
        with pytest.raises(ValueError, match="in use"):
            engine.unload_adapter("abc")
        assert {rid: tokens(o) for rid, o in drain(engine).items()} == {"a": [3], "b": [0]}
        assert engine.unload_adapter("abc") is True
        assert engine.unload_adapter("abc") is False
        assert engine.adapters() == ["xy"]
    finally:
        engine.close()
    assert engine.adapters() == []  # the closing reply: nothing held


def test_an_engine_without_lora_is_not_asked_across_the_pipe() -> None:
    engine = ProcessEngine(functools.partial(LoraEngine, lora=False), label="test")
    try:
        assert not engine.capabilities.lora and bind_features(engine).lora is None
        with pytest.raises(CapabilityError, match="no LoRA"):
            engine.load_adapter("abc", "/adapters/abc")
        assert engine.adapters() == []
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("max_rank", "rank"), [(1, 1), (2, 8), (8, 8), (9, 16), (64, 64), (65, 128), (300, 320)]
)
def test_vllm_serves_the_smallest_of_its_ranks_that_holds_max_rank(
    max_rank: int, rank: int
) -> None:
    assert vllm_lora_rank(max_rank) == rank


def test_a_rank_past_vllms_largest_is_refused() -> None:
    with pytest.raises(ValueError, match="up to 512"):
        vllm_lora_rank(513)
    assert vllm_lora_rank(40, allowed=(16, 32, 64)) == 64
