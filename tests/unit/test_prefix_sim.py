"""The simulator's prefix caches and the routing it runs over them, on hand-built traces."""

from __future__ import annotations

import pytest

from loadgen import transforms
from loadgen.costmodel import EngineProfile
from loadgen.plan import plan
from loadgen.prefix_sim import PrefixLRU, chain_keys, reuse_bound
from loadgen.simulator import SimConfig, simulate
from loadgen.traces import TraceRequest
from services.job_executor.routing import RoutingConfig
from tests.unit.test_loadgen_simulator import profile as simulator_profile


def profile() -> EngineProfile:
    # 1 ms a prompt token and no load time: a cached prefix shows in the TTFT.
    return simulator_profile(
        load_s=0.0, decode_s=(0.01, 0.01), max_prefill_tokens=8192, kv_blocks=4096,
        max_model_len=8192,
    )  # fmt: skip


def req(t: float, n: int, hash_ids: tuple[int, ...], out: int = 2) -> TraceRequest:
    return TraceRequest(arrival_s=t, input_tokens=n, output_tokens=out, hash_ids=hash_ids,
                        block_size=64)  # fmt: skip


class TestPrefixLRU:
    def test_keys_name_the_whole_prefix(self):
        a, b = chain_keys([1, 2, 3]), chain_keys([1, 9, 3])
        assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]  # same id 3, other prefix

    def test_match_counts_leading_blocks_only(self):
        lru = PrefixLRU(capacity_tokens=64 * 10)
        lru.insert(chain_keys([1, 2, 3]), 64)
        assert lru.match(chain_keys([1, 2, 3, 4])) == 3
        assert lru.match(chain_keys([1, 2, 7])) == 2
        assert lru.match(chain_keys([5, 2, 3])) == 0

    def test_least_recently_used_goes_first_and_tails_before_heads(self):
        lru = PrefixLRU(capacity_tokens=64 * 4)
        old, new = chain_keys([1, 2, 3]), chain_keys([1, 5])
        lru.insert(old, 64)
        lru.insert(new, 64)  # 4 distinct blocks: full
        assert len(lru) == 4
        lru.insert(chain_keys([1, 5, 6]), 64)  # one more: the old chain's tail goes
        assert lru.match(old) == 2 and lru.match(new) == 2
        lru.match(old, touch=True)  # the old chain's head is used again
        lru.insert(chain_keys([8]), 64)
        assert lru.match(old) == 2  # [1, 5, 6]'s tail went instead
        assert lru.match(chain_keys([1, 5, 6])) == 2

    def test_a_cache_smaller_than_a_block_holds_nothing(self):
        lru = PrefixLRU(capacity_tokens=10)
        lru.insert(chain_keys([1]), 64)
        assert len(lru) == 0 and lru.match(chain_keys([1])) == 0


def test_reuse_bound_counts_what_any_earlier_prompt_shared() -> None:
    prompts = plan(
        [
            req(0, 256, (1, 2, 3, 4)),  # new: nothing
            req(1, 256, (1, 2, 5, 6)),  # 2 blocks seen
            req(2, 128, (1, 2)),  # both blocks seen, but never the last token
            TraceRequest(arrival_s=3, input_tokens=100, output_tokens=2),  # no ids: nothing
        ],
        model="m",
    )
    assert reuse_bound(prompts) == pytest.approx((128 + 127) / (256 + 256 + 128 + 100))


def test_prompt_scale_shrinks_prompts_and_their_blocks() -> None:
    (r,) = transforms.scale_prompts([req(0, 1000, (1, 2))], 0.25)
    assert (r.input_tokens, r.block_size, r.hash_ids) == (250, 16, (1, 2))
    with pytest.raises(ValueError, match="whole tokens"):
        transforms.scale_prompts([req(0, 1000, (1,))], 0.3)


def _run(policy: str, caching: bool = True):
    reqs = [req(i * 2.0, 1024, tuple(range(100 * i, 100 * i + 16))) for i in range(4)] + [
        req(10 + i * 2.0, 1280, tuple(range(100 * i, 100 * i + 16)) + (999 + i,) * 4)
        for i in range(4)
    ]
    planned = plan(reqs, model="m")
    cfg = SimConfig(
        devices=2,
        min_replicas=2,
        network_s=0.0,
        routing=RoutingConfig(policy=policy),  # type: ignore[arg-type]
        prefix_caching=caching,
    )
    return simulate(planned, {"m": profile()}, cfg)


def test_combined_routing_sends_second_turns_where_their_prefix_is() -> None:
    results, stats = _run("combined")
    assert all(r.ok for r in results)
    # Every second turn found its first turn's 1,024 tokens on the instance it went to.
    assert stats.matched_tokens == stats.oracle_tokens == 4 * 1024
    assert stats.cached_tokens == 4 * 1024
    assert stats.prompt_tokens == 4 * 1024 + 4 * 1280
    # ... and prefilled only the rest: 256 tokens at 1 ms, then the first token.
    for r in results[4:]:
        assert r.ttft_s == pytest.approx(0.256, abs=0.02)


def test_round_robin_misses_and_no_caching_never_hits() -> None:
    _, rr = _run("round-robin")
    assert rr.matched_tokens < rr.oracle_tokens  # half of the second turns go elsewhere
    assert rr.cached_tokens == rr.matched_tokens
    _, off = _run("combined", caching=False)
    assert off.cached_tokens == off.matched_tokens == off.oracle_tokens == 0
