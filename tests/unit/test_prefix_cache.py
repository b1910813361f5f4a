"""Prefix caching in the torch engine: what a TE and a router would notice — reused blocks (seen
in the KV events and the stats alike), unchanged outputs, LRU eviction, copy-on-write, pins,
the host tier, stable hashes, and no leaked blocks."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import pytest
import torch

from services.task_executor.engines.base import EngineOutput, EngineRequest
from services.task_executor.engines.torch_engine import TorchEngine
from services.task_executor.engines.torch_engine.kv_cache import PagedKVCache
from services.task_executor.engines.torch_engine.prefix_cache import PrefixCache, chain_hashes
from services.task_executor.engines.torch_engine.scheduler import (
    SchedulerConfig,
    SeqView,
    schedule,
)
from shared.messages.kv import (
    DEVICE,
    HOST,
    KvAllCleared,
    KvBlocksRemoved,
    KvBlocksStored,
    KvEvent,
)
from tests.engines import TEST_DEVICE, drain, tokens
from tests.unit.test_torch_engine import _write_tiny_llama, greedy


def stored(hashes: list[int], parent: int | None, counts: list[int], tier: str) -> KvEvent:
    return KvBlocksStored(
        block_hashes=hashes, parent_block_hash=parent, token_counts=counts, tier=tier
    )


def removed(hashes: list[int], tier: str) -> KvEvent:
    return KvBlocksRemoved(block_hashes=hashes, tier=tier)


BS = 4
PREFIX = [5, 17, 42, 8, 61, 3, 29, 11, 2, 7, 70, 33]  # three full blocks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _engine(model_dir: Path, **kwargs: object) -> TorchEngine:
    kwargs = {"device": TEST_DEVICE, "block_size": BS, "num_kv_blocks": 64} | kwargs
    return TorchEngine(model_dir, **kwargs)  # type: ignore[arg-type]


def _step(engine: TorchEngine, outs: dict[str, list[EngineOutput]]) -> None:
    for o in engine.step():
        outs.setdefault(o.request_id, []).append(o)


def _finish(engine: TorchEngine, outs: dict[str, list[EngineOutput]]) -> dict[str, list[int]]:
    for rid, more in drain(engine).items():
        outs.setdefault(rid, []).extend(more)
    return {rid: tokens(o) for rid, o in outs.items()}


def _run_alone(model_dir: Path, prompt: list[int], max_tokens: int) -> list[int]:
    engine = _engine(model_dir, enable_prefix_caching=False)
    engine.add_request(EngineRequest("x", prompt, greedy(max_tokens)))
    return tokens(drain(engine)["x"])


def _stored(events: list[KvEvent], tier: str = DEVICE) -> list[int]:
    return [
        h
        for e in events
        if isinstance(e, KvBlocksStored) and e.tier == tier
        for h in e.block_hashes
    ]


def _removed(events: list[KvEvent], tier: str = DEVICE) -> list[int]:
    return [
        h
        for e in events
        if isinstance(e, KvBlocksRemoved) and e.tier == tier
        for h in e.block_hashes
    ]


def _assert_nothing_held(engine: TorchEngine) -> None:
    pc = engine.prefix_cache
    assert [pc.ref_count(b) for b in range(pc.num_blocks)] == [0] * pc.num_blocks
    stats = engine.stats()
    assert stats.free_kv_blocks == stats.total_kv_blocks


# --- reuse ---------------------------------------------------------------------------------


def test_second_request_reuses_exactly_the_shared_prefix_blocks(model_dir: Path) -> None:
    a, b = [*PREFIX, 12, 90], [*PREFIX, 45, 1, 18]
    engine = _engine(model_dir)
    engine.add_request(EngineRequest("a", a, greedy(8)))
    outs: dict[str, list[EngineOutput]] = {}
    _step(engine, outs)
    first = engine.drain_kv_events()
    prefix_hashes = engine.block_hashes(PREFIX)
    assert first == [stored(prefix_hashes, None, [BS] * 3, DEVICE)]

    engine.add_request(EngineRequest("b", b, greedy(8)))
    _step(engine, outs)
    held_a, held_b = engine._requests["a"].blocks, engine._requests["b"].blocks
    assert held_b[:3] == held_a[:3] and held_b[3] != held_a[3]
    tokens = _finish(engine, outs)
    later = engine.drain_kv_events()

    # The events: b stored nothing of the prefix again, and its own blocks chain onto it.
    assert not set(_stored(later)) & set(prefix_hashes)
    b_stored = [
        e for e in later if e.block_hashes[0] == engine.block_hashes([*b, tokens["b"][0]])[3]
    ]
    assert len(b_stored) == 1 and b_stored[0].parent_block_hash == prefix_hashes[-1]
    # The stats agree with the events: three blocks' worth of b's prompt was served.
    stats = engine.stats()
    assert stats.prefix_cache_queries == len(a) + len(b)
    assert (
        stats.prefix_cache_hit_tokens
        == 3 * BS
        == len(set(_stored(first)) & set(engine.block_hashes(b))) * BS
    )
    assert [outs["a"][0].num_cached_tokens, outs["b"][0].num_cached_tokens] == [0, 3 * BS]
    assert all(o.num_cached_tokens == 0 for o in outs["b"][1:])

    assert tokens == {"a": _run_alone(model_dir, a, 8), "b": _run_alone(model_dir, b, 8)}
    _assert_nothing_held(engine)


def test_a_prompt_chunked_after_its_cached_prefix_computes_only_the_rest(model_dir: Path) -> None:
    """Under a 4-token budget a 21-token prompt whose first 12 tokens are cached runs 9 tokens
    in chunks of 4, 4 and 1, and generates what it generates alone."""
    a, b = [*PREFIX, 12, 90], [*PREFIX, 45, 1, 18, 64, 23, 9, 50, 51, 52]
    engine = _engine(model_dir, max_prefill_tokens=4)
    engine.add_request(EngineRequest("a", a, greedy(2)))
    outs: dict[str, list[EngineOutput]] = {}
    _finish(engine, outs)
    engine.add_request(EngineRequest("b", b, greedy(4)))
    assert engine.step() == [] and engine._requests["b"].num_computed == 16
    assert engine.step() == [] and engine._requests["b"].num_computed == 20
    _step(engine, outs)
    assert outs["b"][0].num_cached_tokens == 12
    assert _finish(engine, outs)["b"] == _run_alone(model_dir, b, 4)
    _assert_nothing_held(engine)


def test_disabled_caching_shares_nothing_and_reports_nothing(model_dir: Path) -> None:
    engine = _engine(model_dir, enable_prefix_caching=False)
    assert not engine.capabilities.prefix_cache
    for rid in ("a", "b"):
        engine.add_request(EngineRequest(rid, PREFIX, greedy(3)))
        drain(engine)
    stats = engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hit_tokens) == (0, 0)
    assert engine.drain_kv_events() == []


# --- eviction ------------------------------------------------------------------------------


def test_cached_blocks_are_evicted_least_recently_used_first(model_dir: Path) -> None:
    # 12 blocks. x, y, z each leave two cached blocks (9-token prompts: two full blocks);
    # x is then used again, so y is the least recently used, then z, then x.
    engine = _engine(model_dir, num_kv_blocks=12)
    prompts = {
        "x": [1, 2, 3, 4, 5, 6, 7, 8, 9],
        "y": [11, 12, 13, 14, 15, 16, 17, 18, 19],
        "z": [21, 22, 23, 24, 25, 26, 27, 28, 29],
    }
    for rid in ("x", "y", "z", "x"):
        engine.add_request(EngineRequest(rid, prompts[rid], greedy(1)))
        drain(engine)
    assert engine.stats().prefix_cache_hit_tokens == 2 * BS  # x, the second time
    engine.drain_kv_events()
    hashes = {rid: engine.block_hashes(p) for rid, p in prompts.items()}

    # 9 blocks wanted, 6 never used: three cached blocks go, a sequence's tail before its head.
    engine.add_request(EngineRequest("w", list(range(40, 73)), greedy(1)))
    drain(engine)
    y0, y1 = hashes["y"]
    z1 = hashes["z"][1]
    assert _removed(engine.drain_kv_events()) == [y1, y0, z1]

    # What is left still serves: all of x, z's first block, nothing of y.
    found = {rid: engine.prefix_cache.probe(h)[0] for rid, h in hashes.items()}
    assert found == {"x": 2, "y": 0, "z": 1}
    engine.add_request(EngineRequest("z2", prompts["z"], greedy(1)))
    assert drain(engine)["z2"][0].num_cached_tokens == BS
    _assert_nothing_held(engine)


# --- copy-on-write -------------------------------------------------------------------------


def test_a_shared_block_is_copied_before_it_is_written(model_dir: Path) -> None:
    engine = _engine(model_dir)
    engine.add_request(EngineRequest("a", PREFIX, greedy(6)))
    outs: dict[str, list[EngineOutput]] = {}
    _step(engine, outs)
    _step(engine, outs)
    blocks_a = list(engine._requests["a"].blocks[:3])
    kv_a = [(k[blocks_a].clone(), v[blocks_a].clone()) for k, v in engine.cache.layers()]

    # b's whole prompt is cached; its last token is recomputed (for its logits), which writes
    # into the last shared block: b gets a copy.
    engine.add_request(EngineRequest("b", PREFIX, greedy(6)))
    _step(engine, outs)
    blocks_b = engine._requests["b"].blocks
    assert blocks_b[:2] == blocks_a[:2] and blocks_b[2] != blocks_a[2]
    assert [engine.prefix_cache.ref_count(b) for b in blocks_a] == [2, 2, 1]
    for (k0, v0), (k, v) in zip(kv_a, engine.cache.layers(), strict=True):
        assert torch.equal(k[blocks_a], k0) and torch.equal(v[blocks_a], v0)
        # The copy keeps the three tokens before the rewritten one.
        assert torch.equal(k[blocks_b[2], :3], k0[2, :3])
    assert outs["b"][0].num_cached_tokens == len(PREFIX) - 1

    alone = _run_alone(model_dir, PREFIX, 6)
    assert _finish(engine, outs) == {"a": alone, "b": alone}
    _assert_nothing_held(engine)


# --- pins ----------------------------------------------------------------------------------


def test_a_pinned_prefix_survives_memory_pressure_and_is_found_by_its_id(model_dir: Path) -> None:
    context = [*PREFIX[:10]]  # two full blocks and a partial one
    engine = _engine(model_dir, num_kv_blocks=10)
    engine.add_request(EngineRequest("ctx", context, greedy(1)))
    drain(engine)
    assert engine.pin_prefix("ctx-1", context) == 2 * BS
    assert engine.pinned_prefix("ctx-1") == (context, 2 * BS)
    assert engine.pinned_prefix("other") is None
    assert engine.stats().free_kv_blocks == 8

    # The rest of the cache, twice over: everything unpinned is evicted, the pin is not.
    engine.drain_kv_events()
    for i in range(2):
        engine.add_request(EngineRequest(f"fill{i}", list(range(i * 40, i * 40 + 29)), greedy(1)))
        drain(engine)
    removed = _removed(engine.drain_kv_events())
    assert removed and not set(removed) & set(engine.block_hashes(context))

    match = engine.prefix_cache.match_cache_id("ctx-1")
    assert match is not None and match.token_ids == tuple(context) and match.num_tokens == 2 * BS
    engine.prefix_cache.free(match.blocks)

    question = [*context, 80, 81, 82]
    engine.add_request(EngineRequest("q", question, greedy(4)))
    outs = drain(engine)["q"]
    assert outs[0].num_cached_tokens == 2 * BS
    assert tokens(outs) == _run_alone(model_dir, question, 4)

    assert engine.unpin_prefix("ctx-1") and not engine.unpin_prefix("ctx-1")
    assert engine.pinned_prefix("ctx-1") is None
    _assert_nothing_held(engine)


# --- host tier -----------------------------------------------------------------------------


def test_blocks_offloaded_to_the_host_tier_come_back_with_identical_outputs(
    model_dir: Path,
) -> None:
    prompt = [*PREFIX, 50]  # three full blocks and one token
    alone = _run_alone(model_dir, prompt, 4)
    engine = _engine(model_dir, num_kv_blocks=10, num_host_kv_blocks=8)
    engine.add_request(EngineRequest("p", prompt, greedy(4)))
    assert tokens(drain(engine)["p"]) == alone
    hashes = engine.block_hashes(PREFIX)
    engine.drain_kv_events()

    assert engine.offload_kv(hashes) == 3
    assert engine.offload_kv(hashes) == 0  # already there
    assert engine.drain_kv_events() == [stored(hashes, None, [BS] * 3, HOST)]

    # A request that needs the whole device evicts them there.
    engine.add_request(EngineRequest("w", list(range(40, 77)), greedy(1)))
    drain(engine)
    events = engine.drain_kv_events()
    assert set(hashes) <= set(_removed(events, DEVICE))
    assert not set(hashes) & set(_stored(events, HOST))  # no second copy
    assert all(engine.prefix_cache.cached_block(h) is None for h in hashes)

    # A match finds them only on the host and populates them back.
    engine.add_request(EngineRequest("p2", prompt, greedy(4)))
    outs = drain(engine)["p2"]
    assert outs[0].num_cached_tokens == 3 * BS
    assert tokens(outs) == alone
    assert _stored(engine.drain_kv_events(), DEVICE)[:3] == hashes

    # populate on its own, after another eviction.
    engine.add_request(EngineRequest("w2", list(range(40, 77)), greedy(1)))
    drain(engine)
    assert engine.prefix_cache.cached_block(hashes[0]) is None
    assert engine.populate_kv(hashes) == 3
    assert all(engine.prefix_cache.cached_block(h) is not None for h in hashes)
    _assert_nothing_held(engine)

    engine.close()
    assert KvAllCleared(tier=HOST) in engine.drain_kv_events()


def test_the_host_tier_has_its_own_capacity_and_lru_order() -> None:
    kv = PagedKVCache(
        num_layers=1,
        num_blocks=8,
        block_size=2,
        num_kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    pc = PrefixCache(kv, num_host_blocks=2)
    tokens = [1, 2, 3, 4, 5, 6]
    hashes = chain_hashes(tokens, 2)
    blocks = pc.allocate(3)
    for i, b in enumerate(blocks):
        kv.k[0][b] = float(i + 1)
    assert pc.commit(blocks, hashes, num_computed_tokens=6, num_committed=0) == 3
    pc.free(blocks)
    pc.drain_events()

    assert pc.offload(hashes[:2]) == 2
    pc.offload(hashes[:1])  # touched: hashes[1] is now the host's least recently used
    assert pc.offload(hashes[2:]) == 1
    assert pc.drain_events() == [
        stored(hashes[:2], None, [2, 2], HOST),
        removed([hashes[1]], HOST),
        stored(hashes[2:], hashes[1], [2], HOST),
    ]
    # Evicting all three from the device writes back only the one the host lacks, which in
    # turn evicts the host's least recently used.
    taken = pc.allocate(8)
    assert pc.drain_events() == [
        removed([hashes[0]], HOST),
        stored([hashes[1]], hashes[0], [2], HOST),
        removed([hashes[2], hashes[1], hashes[0]], DEVICE),
    ]
    assert [pc.cached_block(h) for h in hashes] == [None] * 3
    pc.free(taken)
    assert pc.populate(hashes) == 2  # the first is gone from both tiers
    assert [float(kv.k[0][pc.cached_block(h)][0, 0, 0]) for h in hashes[1:]] == [2.0, 3.0]


# --- hashes --------------------------------------------------------------------------------


def test_chained_block_hashes_are_a_fixed_spec() -> None:
    tokens = list(range(100, 110))
    # Computed once with the spec; they must never change (routers index them).
    assert chain_hashes(tokens, 4) == [8211499403980216429, 11882373147257216364]
    assert chain_hashes([0], 1) == [2283521107298152996]

    # The spec, spelled out: blake2b-64 of the parent (little-endian u64, 0 at the start)
    # and the block's token ids (little-endian i32).
    def h(parent: int, block: list[int]) -> int:
        data = parent.to_bytes(8, "little") + struct.pack(f"<{len(block)}i", *block)
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")

    h0 = h(0, tokens[:4])
    assert chain_hashes(tokens, 4) == [h0, h(h0, tokens[4:8])]
    # A block's hash names its whole prefix: the same block after another one differs.
    assert chain_hashes(tokens[4:8], 4) != chain_hashes(tokens, 4)[1:]


# --- no leaks ------------------------------------------------------------------------------


def test_blocks_all_come_back_after_finishing_aborting_and_preempting(model_dir: Path) -> None:
    # A cache too small for all of them at once, prompts that share blocks: requests are
    # preempted while they share blocks, some are aborted while running or waiting.
    prompts = {
        "a": [*PREFIX, 1],
        "b": [*PREFIX, 2, 3],
        "c": [*PREFIX[:8], 4],
        "d": list(PREFIX),
        "e": [*PREFIX, 5],
    }
    engine = _engine(model_dir, num_kv_blocks=14)
    for rid in ("a", "b"):
        engine.add_request(EngineRequest(rid, prompts[rid], greedy(14)))
    outs: dict[str, list[EngineOutput]] = {}
    _step(engine, outs)
    for rid in ("c", "d", "e"):
        engine.add_request(EngineRequest(rid, prompts[rid], greedy(14)))
    _step(engine, outs)
    saw_preemption = False
    for i in range(200):
        if not engine.has_work():
            break
        if i == 3:
            engine.abort("e")  # waiting or running, whichever
        _step(engine, outs)
        saw_preemption |= engine.stats().waiting > 0 and "d" in outs
    assert saw_preemption
    for rid in ("a", "b", "c", "d"):
        assert tokens(outs[rid]) == _run_alone(model_dir, prompts[rid], 14), rid
    _assert_nothing_held(engine)

    engine.add_request(EngineRequest("f", prompts["a"], greedy(30)))
    engine.step()
    engine.abort("f")
    _assert_nothing_held(engine)


def test_scheduler_counts_cached_tokens_out_of_the_budget_and_shared_blocks_as_kept() -> None:
    cfg = SchedulerConfig(block_size=4, max_num_seqs=8, max_prefill_tokens=16)
    # 40 tokens, 36 of them cached in blocks already in use: 4 tokens of budget, 1 block.
    waiting = [SeqView("w1", 10, 0), SeqView("w2", 40, 9, num_cached_tokens=36)]
    assert schedule([], waiting, free_blocks=4, config=cfg).prefill == ("w1", "w2")

    # Preempting a request frees only the blocks nobody else holds.
    running = [SeqView("old", 9, 2), SeqView("new", 13, 3, num_shared_blocks=2)]
    d = schedule(running, [], free_blocks=0, config=cfg)
    assert d.preempt == ("new",) and d.running == ("old",)
    running = [SeqView("old", 9, 2), SeqView("new", 13, 3, num_shared_blocks=3)]
    assert schedule(running, [], free_blocks=0, config=cfg).preempt == ("new", "old")
