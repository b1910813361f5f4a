"""A request as the torch engine holds it (``Seq``: its tokens, blocks, progress, sampling
state) and the scheduler's view of one (``SeqView``, ``scheduler.py``), running or waiting."""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from services.task_executor.engines.torch_engine.kv_stream import KvSink
from services.task_executor.engines.torch_engine.model import SeqChunk
from services.task_executor.engines.torch_engine.prefix_cache import PrefixCache
from services.task_executor.engines.torch_engine.scheduler import Pacing, SeqView, tpot_slack
from shared.messages.api import SamplingParams


@dataclasses.dataclass(slots=True, eq=False)
class Seq:
    request_id: str
    prompt_len: int
    token_ids: list[int]  # prompt, then the tokens generated so far
    sampling: SamplingParams
    generator: torch.Generator
    blocks: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # leading tokens whose K/V is in the cache
    num_scheduled: int = 0  # tokens it computes in the iteration under way
    block_hashes: list[int] = dataclasses.field(default_factory=list)  # of full blocks
    num_committed: int = 0  # leading blocks already offered to the prefix cache's index
    num_cached_tokens: int | None = None  # served from the cache at the first admission
    reported_cached: bool = False  # the first output (which carries num_cached_tokens) is out
    retain_kv: bool = False  # keep the KV after finishing, for export_kv
    imported_kv: torch.Tensor | None = None  # [layers, 2, tokens, kv_heads, hd], until admitted
    imported_from: int = 0  # the first token imported_kv covers (the rest is cached here)
    kv_sink: KvSink | None = None  # its prompt's KV streams there as it is computed (PD)
    kv_sent: int = 0  # leading tokens whose KV (every layer) went to kv_sink
    # Sampling draws taken for the next tokens but not yet spent (a launch ahead takes its draw
    # early; if its token is thrown away, the recomputation reuses it).
    uniforms: list[torch.Tensor] = dataclasses.field(default_factory=list)
    first_token_at: float | None = None  # monotonic seconds its first output token came out
    due: float = math.inf  # monotonic seconds its first token is due (its TTFT target)
    arrival: float | None = None  # when it reached its frontend (EngineRequest.arrival)
    adapter: str = ""  # the LoRA adapter it runs under ("": the base model)
    adapter_slot: int = -1  # that adapter's device slot while it runs (lora.py)
    hash_root: int = 0  # the root of its block hashes (block_hash.adapter_root)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def samples(self) -> bool:
        """Whether the iteration under way produces its next token (it does unless it computes
        a chunk of a prompt that goes on)."""
        return self.num_computed + self.num_scheduled == len(self.token_ids)

    def chunk(self) -> SeqChunk:
        """What it computes in the iteration under way."""
        end = self.num_computed + self.num_scheduled
        return SeqChunk(self.token_ids[self.num_computed : end], self.num_computed, self.blocks)

    def reusable_hashes(self, block_size: int) -> list[int]:
        """Hashes of the blocks it may take from the cache while waiting: all its full
        blocks, or, imported, those its KV covers (the rest comes from the import)."""
        if self.imported_kv is not None:
            covered = self.imported_from + self.imported_kv.shape[2]
            return self.block_hashes[: covered // block_size]
        return self.block_hashes

    def ttft_left(self, now: float | None = None) -> float:
        """Seconds until its first token is due (from ``now``, default the monotonic clock's
        now): -inf once it has produced tokens (preempted, its prompt recomputed: before any
        new prompt), inf without a deadline."""
        if self.first_token_at is not None:
            return -math.inf
        if self.due == math.inf:
            return math.inf
        return self.due - (time.monotonic() if now is None else now)


def running_view(seq: Seq, pacing: Pacing | None, ahead: int = 0) -> SeqView:
    """The scheduler's view of a running request (``ahead``: as it will be after that many
    more tokens, for a look-ahead)."""
    slack = headroom = None
    now = time.monotonic()
    if pacing is not None and seq.first_token_at is not None:
        slack = tpot_slack(pacing.tpot_s, seq.num_output + ahead, now - seq.first_token_at)
    if pacing is not None and seq.due != math.inf:
        headroom = seq.due + pacing.tpot_s * (seq.num_output + ahead) - now
    n = len(seq.token_ids) + ahead
    return SeqView(
        seq.request_id,
        n,
        len(seq.blocks),
        n - 1 if ahead else seq.num_computed,
        tpot_slack_s=slack,
        ttft_left_s=seq.ttft_left(),
        headroom_s=headroom,
    )


def waiting_view(
    seq: Seq, prefix_cache: PrefixCache, block_size: int, now: float | None = None
) -> SeqView:
    """The scheduler's view of a waiting request: what of it the prefix cache (or its
    imported KV) already holds."""
    found, in_use = prefix_cache.probe(seq.reusable_hashes(block_size))
    n = len(seq.token_ids)
    left = seq.ttft_left(now)
    if seq.imported_kv is not None:
        cached_kv = seq.imported_from + seq.imported_kv.shape[2]
        return SeqView(seq.request_id, n, in_use, num_cached_tokens=cached_kv, ttft_left_s=left)
    cached = found * block_size
    # A fully cached sequence still computes its last token, into a copy of the last block.
    copy = int(cached >= n)
    return SeqView(
        seq.request_id, n, in_use - copy, num_cached_tokens=min(cached, n - 1), ttft_left_s=left
    )
