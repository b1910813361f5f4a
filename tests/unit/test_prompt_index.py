"""The job executor's prompt index replica, the block hash it keys on, and the routing
policies: on hand-built states."""

from __future__ import annotations

import random
import shutil
import struct

import pytest

from services.job_executor.prompt_index import ModelIndex, PromptIndex
from services.job_executor.routing import Candidate, Route, RoutingConfig, route
from shared import block_hash
from shared.block_hash import chain_hashes, hash_block_tokens
from shared.messages.kv import HOST, KvAllCleared, KvBlocksRemoved, KvBlocksStored, KvEventBatch
from shared.native import Toolchain

BS = 4


def batch(te: str, seq: int, *events: object) -> KvEventBatch:
    return KvEventBatch(te_id=te, model="m", seq=seq, block_size=BS, events=list(events))  # type: ignore[arg-type]


def hashes(tokens: list[int]) -> list[int]:
    return chain_hashes(tokens, BS)


PROMPT = list(range(40))  # 10 blocks
H = hashes(PROMPT)


class TestBlockHash:
    def test_fast_chain_equals_the_spec_block_by_block(self):
        rng = random.Random(0)
        tokens = [rng.randrange(200_000) for _ in range(1000)]
        parent, want = None, []
        for s in range(0, 1000 - 15, 16):
            parent = hash_block_tokens(parent, tokens[s : s + 16])
            want.append(parent)
        assert chain_hashes(tokens, 16) == want  # 62 full blocks; the 8-token tail has none

    @pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
    def test_the_c_chain_equals_the_python_one(self, tmp_path, monkeypatch):
        monkeypatch.setattr(block_hash, "_native", [])
        rng = random.Random(1)
        cases = []
        for block in (1, 4, 16, 29, 30, 31, 32, 64, 100, 512):  # 30: one full 128-byte block
            tokens = [rng.randrange(-(2**31), 2**31) for _ in range(block * 7 + 3)]
            cases.append((tokens, block, rng.getrandbits(64)))
        want = [chain_hashes(t, b, root) for t, b, root in cases]
        tokens = cases[2][0]
        whole = chain_hashes(tokens, 16)
        assert block_hash.use_native(Toolchain(cache_dir=tmp_path)) and block_hash.native_in_use()
        assert [chain_hashes(t, b, root) for t, b, root in cases] == want
        grown = chain_hashes(tokens[:50], 16)  # 3 blocks: Python's; the next 4 in C
        block_hash.extend_chain(grown, tokens, 16)
        assert grown == whole
        assert chain_hashes(tuple(tokens), 16) == whole  # not a list: through an int32 array
        with pytest.raises((OverflowError, struct.error)):  # Python's own error for a bad id
            chain_hashes([*tokens[:5], 2**40, *tokens[5:100]], 16)

    def test_without_a_compiler_python_hashes(self, monkeypatch):
        monkeypatch.setattr(block_hash, "_native", [])
        assert not block_hash.use_native(Toolchain(cc="no-such-compiler"))
        assert chain_hashes(PROMPT, BS) == H

    def test_a_block_names_every_token_before_it(self):
        a, b = hashes([1, 2, 3, 4, 5, 6, 7, 8]), hashes([9, 2, 3, 4, 5, 6, 7, 8])
        assert a[1] != b[1]  # same second block, different first: different chains

    def test_a_variant_root_shares_no_key_with_the_base(self):
        base = chain_hashes(PROMPT, BS)
        adapter = chain_hashes(PROMPT, BS, root=0xADA)
        assert not set(base) & set(adapter)


class TestIndex:
    def test_match_counts_leading_blocks_per_te(self):
        ix = ModelIndex(BS)
        ix.apply(batch("a", 0, KvBlocksStored(block_hashes=H[:6])))
        ix.apply(batch("b", 0, KvBlocksStored(block_hashes=H[:2])))
        ix.apply(batch("c", 0, KvBlocksStored(block_hashes=H[3:8])))  # no leading block
        assert ix.match(H, ["a", "b", "c", "d"]) == {"a": 6, "b": 2, "c": 0}

    def test_a_hole_in_the_chain_ends_the_match(self):
        ix = ModelIndex(BS)
        ix.apply(batch("a", 0, KvBlocksStored(block_hashes=H)))
        ix.apply(batch("a", 1, KvBlocksRemoved(block_hashes=[H[4]])))
        assert ix.match(H, ["a"]) == {"a": 4}

    def test_host_tier_blocks_count_until_both_tiers_lose_them(self):
        ix = ModelIndex(BS)
        ix.apply(batch("a", 0, KvBlocksStored(block_hashes=H[:4])))
        ix.apply(batch("a", 1, KvBlocksStored(block_hashes=H[:4], tier=HOST)))
        ix.apply(batch("a", 2, KvBlocksRemoved(block_hashes=H[:4])))
        assert ix.match(H, ["a"]) == {"a": 4}
        ix.apply(batch("a", 3, KvAllCleared(tier=HOST)))
        assert ix.match(H, ["a"]) == {"a": 0}
        assert len(ix) == 0

    def test_events_in_order_apply_and_repeats_are_ignored(self):
        ix = ModelIndex(BS)
        assert not ix.apply(batch("a", 0, KvBlocksStored(block_hashes=H[:2]))).gap
        assert ix.apply(batch("a", 0, KvBlocksStored(block_hashes=H[:9]))).stale
        assert ix.match(H, ["a"]) == {"a": 2}

    def test_a_gap_asks_for_a_resync_and_changes_nothing(self):
        ix = ModelIndex(BS)
        ix.apply(batch("a", 0, KvBlocksStored(block_hashes=H[:2])))
        applied = ix.apply(batch("a", 2, KvBlocksStored(block_hashes=H[:9])))
        assert applied.gap
        assert ix.match(H, ["a"]) == {"a": 2}
        ix.load("a", 2, {"device": H[:5]})  # the store's copy, as of seq 2
        assert ix.match(H, ["a"]) == {"a": 5}
        assert ix.apply(batch("a", 2, KvBlocksStored(block_hashes=H))).stale
        assert not ix.apply(batch("a", 3, KvBlocksStored(block_hashes=H[5:7]))).gap
        assert ix.match(H, ["a"]) == {"a": 7}

    def test_a_te_first_heard_mid_sequence_is_a_gap(self):
        assert ModelIndex(BS).apply(batch("a", 57, KvBlocksStored(block_hashes=H))).gap

    def test_a_dropped_te_is_gone_and_its_bit_reused(self):
        ix = ModelIndex(BS)
        ix.apply(batch("a", 0, KvBlocksStored(block_hashes=H)))
        ix.apply(batch("b", 0, KvBlocksStored(block_hashes=H[:3])))
        ix.drop("a")
        assert ix.match(H, ["a", "b"]) == {"b": 3}
        ix.apply(batch("c", 0, KvBlocksStored(block_hashes=H[:1])))  # takes a's bit
        assert ix.match(H, ["b", "c"]) == {"b": 3, "c": 1}
        assert len(ix) == 3

    def test_speculative_entries_expire_and_yield_to_real_events(self):
        ix = ModelIndex(BS)
        ix.speculate("v", H[:5], now=100.0, ttl_s=10.0)
        assert ix.match(H, ["v"]) == {"v": 5}
        ix.expire(105.0)
        assert ix.match(H, ["v"]) == {"v": 5}
        ix.expire(111.0)
        assert ix.match(H, ["v"]) == {"v": 0}
        ix.speculate("v", H[:5], now=200.0, ttl_s=10.0)
        ix.apply(batch("v", 0, KvBlocksStored(block_hashes=H[:2])))  # it speaks for itself
        assert ix.match(H, ["v"]) == {"v": 2}

    def test_models_are_separate_and_retain_drops_tes_that_left(self):
        px = PromptIndex()
        px.of("m", BS).apply(batch("a", 0, KvBlocksStored(block_hashes=H)))
        other = px.of("n", BS)
        other.apply(
            KvEventBatch(
                te_id="b", model="n", seq=0, block_size=BS, events=[KvBlocksStored(block_hashes=H)]
            )
        )
        assert other.match(H, ["a"]) == {}  # a holds it for m, not for n
        assert px.retain({"m": {"a"}}) == [("n", "b")]
        assert px.of("m", BS).match(H, ["a"]) == {"a": 10}

    def test_match_at_scale_is_one_pass_over_the_prompt(self):
        """100 TEs, 2,048-block prompt: the walk stops where the last TE drops out."""
        ix = ModelIndex(16)
        prompt = chain_hashes(list(range(32768)), 16)
        for i in range(100):
            ix.apply(
                KvEventBatch(
                    te_id=f"t{i}",
                    model="m",
                    seq=0,
                    block_size=16,
                    events=[KvBlocksStored(block_hashes=prompt[: i * 20])],
                )
            )
        got = ix.match(prompt, [f"t{i}" for i in range(100)])
        assert got == {f"t{i}": i * 20 for i in range(100)}


class TestRouting:
    def c(self, te: str, load: int = 0, cached: int = 0) -> Candidate:
        return Candidate(te, load, cached)

    def test_balanced_loads_go_where_the_prefix_is(self):
        r = route(
            [self.c("a", 100), self.c("b", 0, cached=800), self.c("c", 50)],
            1000,
            RoutingConfig(),
            0,
        )
        assert (r.te_id, r.branch) == ("b", "locality")

    def test_equal_prefixes_go_to_the_least_loaded_holder(self):
        cands = [self.c("a", 300, 800), self.c("b", 100, 800), self.c("c", 0)]
        assert route(cands, 1000, RoutingConfig(), 0).te_id == "b"

    def test_an_overloaded_holder_loses_to_cost(self):
        cands = [self.c("a", 5000, cached=800), self.c("b", 0), self.c("c", 100)]
        r = route(cands, 1000, RoutingConfig(balance_tokens=2048), 0)
        assert (r.te_id, r.branch) == ("b", "load")

    def test_imbalanced_loads_still_value_a_long_prefix(self):
        # cost a: 100 + 2900 = 3000; b: 4000 + 0 = 4000; c: 4000 + 3000 = 7000
        cands = [self.c("a", 2900, cached=3900), self.c("b", 0), self.c("c", 3000)]
        r = route(cands, 4000, RoutingConfig(balance_tokens=0), 0)
        assert (r.te_id, r.branch) == ("a", "locality")

    def test_a_holder_a_little_dearer_than_the_cheapest_still_wins(self):
        # cost a: 1000 - 600 + 2500 = 2900; b: 1000 + 0 = 1000. a is near within 600 + 2048.
        cands = [self.c("a", 2500, cached=600), self.c("b", 0)]
        assert route(cands, 1000, RoutingConfig(balance_tokens=2048), 0).te_id == "a"
        assert route(cands, 1000, RoutingConfig(balance_tokens=1000), 0).te_id == "b"

    def test_a_holder_far_behind_loses_even_a_long_prefix(self):
        # a holds 7,000 of 8,000 tokens but is 20,000 tokens behind: cost 21,000, more than
        # the cheapest's 8,000 + the allowance 1,000 + what it holds 7,000
        cands = [self.c("a", 20000, cached=7000), self.c("b", 0)]
        r = route(cands, 8000, RoutingConfig(balance_tokens=1000), 0)
        assert (r.te_id, r.branch) == ("b", "load")
        cands = [self.c("a", 15000, cached=7000), self.c("b", 0)]  # 16,000: near
        assert route(cands, 8000, RoutingConfig(balance_tokens=1000), 0).te_id == "a"

    def test_misses_spread_instead_of_piling_on_one_te(self):
        cands = [self.c("a"), self.c("b"), self.c("c")]
        chosen = {route(cands, 500, RoutingConfig(), spread).te_id for spread in range(30)}
        assert chosen == {"a", "b", "c"}

    def test_least_loaded_ignores_the_cache(self):
        cands = [self.c("a", 10, cached=900), self.c("b", 5)]
        r = route(cands, 1000, RoutingConfig(policy="least-loaded"), 0)
        assert (r.te_id, r.branch) == ("b", "least-loaded")

    def test_round_robin_cycles_in_name_order(self):
        cands = [self.c("b", cached=900), self.c("a"), self.c("c")]
        cfg = RoutingConfig(policy="round-robin")
        assert [route(cands, 10, cfg, n).te_id for n in range(4)] == ["a", "b", "c", "a"]

    def test_packed_fills_the_fullest_batch_with_a_free_slot(self):
        packed = RoutingConfig(policy="packed")

        def c(te: str, sequences: int, slots: int = 4, load: int = 0, cached: int = 0):
            return Candidate(te, load, cached, sequences=sequences, slots=slots)

        # b holds the most and has a slot: it takes the request, whatever the loads say.
        cands = [c("a", 1), c("b", 3, load=900), c("c", 0)]
        assert route(cands, 100, packed, 0) == Route("b", "packed")
        # b full: the next fullest; among equals the longer prefix, then the lesser load.
        cands = [c("a", 2, load=50), c("b", 4), c("c", 2, cached=64, load=80), c("d", 2)]
        assert route(cands, 100, packed, 0).te_id == "c"
        cands = [c("a", 2, load=50), c("b", 4), c("d", 2, load=10)]
        assert route(cands, 100, packed, 0).te_id == "d"
        # Every batch full: the least loaded.
        cands = [c("a", 4, load=50), c("b", 4, load=10)]
        assert route(cands, 100, packed, 0).te_id == "b"
        # A limit not known yet: never full.
        assert route([c("a", 9, slots=0), c("b", 3)], 100, packed, 0).te_id == "a"

    def test_no_candidate_is_an_error(self):
        with pytest.raises(ValueError):
            route([], 10, RoutingConfig(), 0)
