"""The Engine protocol every engine implements, and the plain data it exchanges.

An engine is synchronous and single-threaded: the TE shell calls ``add_request`` and
``abort`` between iterations and ``step`` in a worker thread, one call at a time. Each
``step`` runs one iteration of continuous batching (new requests join at iteration
boundaries, finished ones leave) and returns the tokens it produced.

What an engine can do beyond generating is declared in ``capabilities`` and, flag by flag,
backed by the methods of a sub-protocol (``capabilities.py``), checked when a model loads.
The data types are msgspec Structs: an engine in a child process (``process.py``) exchanges
exactly these over its pipe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import msgspec

from shared.messages.api import SamplingParams
from shared.messages.cluster import EngineCapabilities

__all__ = [
    "Engine",
    "EngineCapabilities",
    "EngineOutput",
    "EngineRequest",
    "EngineStats",
    "PrefillBudget",
    "check_prompt",
]


class EngineRequest(msgspec.Struct):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    # The LoRA adapter it runs under ("": the base model); only an engine that declares
    # ``lora`` serves one, and only once the adapter is loaded (``LoraServing``).
    adapter: str = ""
    # When the request reached its frontend, in monotonic seconds (the host's clock): its
    # TTFT target counts from then, the time it waited for a route or a load included
    # (None: from when the engine got it).
    arrival: float | None = None


class EngineOutput(msgspec.Struct):
    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" (EOS or a stop token), "length", "abort"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


class EngineStats(msgspec.Struct):
    running: int
    waiting: int
    free_kv_blocks: int
    total_kv_blocks: int
    kv_block_size: int = 0  # tokens one KV block holds (0: not said, so no KV room is reported)
    prefix_cache_queries: int = 0  # cumulative prompt tokens looked up in the prefix cache
    prefix_cache_hit_tokens: int = 0  # cumulative prompt tokens found there (not recomputed)


IDLE_STATS = EngineStats(running=0, waiting=0, free_kv_blocks=0, total_kv_blocks=0)


class PrefillBudget(msgspec.Struct, frozen=True):
    """How an engine schedules prompts: at most ``tokens`` prompt tokens an iteration, and,
    when ``chunked``, a longer prompt split over several iterations beside running decodes
    (what the profiler records and the simulator schedules with). ``paced_tokens``: once
    paced (``prefill_pacing``), the budget of an iteration with nothing decoding, and less
    while some decode; 0: never paced."""

    tokens: int
    chunked: bool
    paced_tokens: int = 0


@dataclasses.dataclass(slots=True)
class LoadReport:
    """What one load took: its phases, and what it took from the host weight cache and put
    there (``weight_cache``; zero without one)."""

    hits: int = 0
    hit_bytes: int = 0
    misses: int = 0
    stored_bytes: int = 0  # copied into the cache by this load
    uncached_bytes: int = 0  # built but not stored (no room)
    evicted_bytes: int = 0
    fetched: int = 0  # entries taken from another host's cache over TCP (a fork)
    fetched_bytes: int = 0
    phases: dict[str, float] = dataclasses.field(default_factory=dict)  # seconds

    def add_phase(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + seconds

    def merge(self, other: LoadReport) -> None:
        self.hits += other.hits
        self.hit_bytes += other.hit_bytes
        self.misses += other.misses
        self.stored_bytes += other.stored_bytes
        self.uncached_bytes += other.uncached_bytes
        self.evicted_bytes += other.evicted_bytes
        self.fetched += other.fetched
        self.fetched_bytes += other.fetched_bytes
        for name, seconds in other.phases.items():
            self.add_phase(name, seconds)


class Engine(Protocol):
    name: str  # "torch", "openvino", "vllm"
    device: str  # "cpu", "cuda:0"
    capabilities: EngineCapabilities
    max_model_len: int
    prefill_budget: PrefillBudget

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; it joins the batch at the next iteration. Raises ValueError
        for a request the engine can never serve (prompt too long, empty prompt)."""

    def abort(self, request_id: str) -> None:
        """Drop a request; its blocks are freed. Unknown ids are ignored."""

    def has_work(self) -> bool: ...

    def step(self) -> Sequence[EngineOutput]:
        """Run one iteration; return one output per request that produced tokens or
        finished in it."""

    def stats(self) -> EngineStats: ...

    def close(self) -> None:
        """Free the model and the KV cache."""


def check_prompt(token_ids: Sequence[int], *, max_model_len: int, vocab_size: int | None) -> None:
    """What every engine refuses before it queues a prompt (ValueError: the TE answers the
    client with it): an empty prompt, one that leaves no room for an output token, ids
    outside the vocabulary (``vocab_size`` None: the engine checks them itself)."""
    n = len(token_ids)
    if n == 0:
        raise ValueError("the prompt is empty")
    if n >= max_model_len:
        raise ValueError(
            f"the prompt has {n} tokens; this model serves at most {max_model_len - 1} prompt tokens"
        )
    if vocab_size is not None and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
