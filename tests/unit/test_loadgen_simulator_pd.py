"""PD disaggregation in the simulator: the scaler's prefill instances (from the JE's prefill
work reports), the JE's per-request decision, the prompt on the prefill TE, its KV over the
link, the decode TE continuing; hand-checkable times, and the TPOT it buys."""

from __future__ import annotations

import dataclasses

import pytest

from loadgen.plan import plan
from loadgen.simulator import SimConfig, simulate
from loadgen.stats import percentile
from loadgen.traces import TraceRequest
from services.job_executor.disaggregation import PdConfig
from tests.unit.test_loadgen_simulator import profile

KV = 1000  # bytes per token


def requests(*reqs: tuple[float, int, int]) -> list[TraceRequest]:
    return [TraceRequest(arrival_s=t, input_tokens=i, output_tokens=o) for t, i, o in reqs]


def test_a_long_prompt_prefills_on_a_prefill_instance_and_decodes_from_its_kv() -> None:
    prof = profile(kv_bytes_per_token=KV, max_prefill_tokens=4096)
    cfg = SimConfig(
        devices=4,
        network_s=0.0,
        max_prefill_replicas=1,
        kv_bandwidth=5e5,  # 3,000 tokens of KV: 6 s, past the 3 s prefill
        pd=PdConfig(mode="auto", min_uncached_tokens=2048),
    )
    # The first long prompt finds no prefill instance: it runs whole, and its prefill work
    # makes the scaler load one; the next long prompt, once it is up, is disaggregated; a
    # short one is not.
    planned = plan(requests((0.0, 3000, 4), (20.0, 3000, 4), (30.0, 100, 4)), model="m")
    results, stats = simulate(planned, {"m": prof}, cfg)
    first, second, short = results
    assert all(r.ok and r.completion_tokens == 4 for r in results)
    assert stats.prefill_loads == 1 and stats.disaggregated == 1
    assert first.disaggregated is None and second.disaggregated is True
    assert short.disaggregated is False  # decided, where a prefill instance was up
    assert stats.pd_reasons == {"long uncached prompt": 1, "short uncached prompt": 1}
    assert stats.kv_bytes == 3000 * KV
    # Its first token: the KV lands 6 s after the prefill started (the link, not the
    # 3 s prefill, is the bottleneck), then one decode step computes the token after the
    # prefill's; both reach the client together.
    assert second.ttft_s == pytest.approx(6.0 + prof.decode_step_s(1))
    assert second.gaps_s[0] == 0.0 and len(second.gaps_s) == 3
    assert first.ttft_s == pytest.approx(2.0 + 3.0)  # loaded, prefilled whole


def test_no_prefill_instance_without_max_prefill_replicas() -> None:
    prof = profile(kv_bytes_per_token=KV, max_prefill_tokens=4096)
    planned = plan(requests((0.0, 3000, 4), (20.0, 3000, 4)), model="m")
    results, stats = simulate(planned, {"m": prof}, SimConfig(devices=4, network_s=0.0))
    assert stats.prefill_loads == stats.disaggregated == stats.kv_bytes == 0
    assert stats.pd_reasons == {}
    assert all(r.disaggregated is None for r in results)


def test_an_engine_that_moves_no_kv_is_never_disaggregated() -> None:
    prof = profile(max_prefill_tokens=4096)  # kv_bytes_per_token 0: no kv_import
    cfg = SimConfig(devices=4, network_s=0.0, max_prefill_replicas=1)
    planned = plan(requests((0.0, 3000, 4), (20.0, 3000, 4)), model="m")
    _, stats = simulate(planned, {"m": prof}, cfg)
    assert stats.prefill_loads == stats.disaggregated == 0


def test_long_prompts_on_prefill_instances_stop_stalling_decodes() -> None:
    """Chat requests decoding beside a 6,000-token prompt every 3 s (1.2 s to prefill), on
    two devices: colocated (two instances), each long prefill stalls the decodes batched
    with it; with one instance and one prefill instance, the decodes only continue from
    imported KV."""
    prof = profile(
        kv_bytes_per_token=KV,
        prefill_s=0.0002,
        max_prefill_tokens=8192,
        max_num_seqs=32,
        kv_blocks=4000,
    )
    reqs = [(i * 0.5, 100, 40) for i in range(240)]
    reqs += [(1.0 + 3.0 * i, 6000, 8) for i in range(40)]
    planned = plan(requests(*sorted(reqs)), model="m")
    base = SimConfig(devices=2, network_s=0.0005, min_replicas=1, kv_bandwidth=1.25e9)
    tpot = {}
    for name, cfg in {
        "colocated": dataclasses.replace(base, max_replicas=2),
        "pd": dataclasses.replace(base, max_replicas=1, max_prefill_replicas=1),
    }.items():
        results, stats = simulate(planned, {"m": prof}, cfg)
        assert all(r.ok for r in results), name
        chat = [r.tpot_s for r in results if r.input_tokens == 100 and r.tpot_s is not None]
        tpot[name] = percentile(chat, 90)
        if name == "pd":
            assert stats.disaggregated >= 20
    assert tpot["pd"] < 0.5 * tpot["colocated"], tpot


def test_transfers_share_the_prefill_instances_link() -> None:
    """Two long prompts at once on one prefill instance: their KV leaves over its one link,
    the second after the first (each alone would land 6 s after its prefill started)."""
    prof = profile(kv_bytes_per_token=KV, max_prefill_tokens=8192, max_num_seqs=8)
    cfg = SimConfig(
        devices=4,
        network_s=0.0,
        max_prefill_replicas=1,
        kv_bandwidth=5e5,  # 3,000 tokens of KV: 6 s
        pd=PdConfig(mode="always"),
    )
    planned = plan(requests((0.0, 3000, 4), (20.0, 3000, 4), (20.0, 3000, 4)), model="m")
    results, stats = simulate(planned, {"m": prof}, cfg)
    assert all(r.ok for r in results) and stats.disaggregated == 2
    a, b = sorted(r.ttft_s or 0 for r in results[1:])
    assert a == pytest.approx(6.0 + prof.decode_step_s(1), abs=0.05)
    assert b == pytest.approx(12.0 + prof.decode_step_s(1), abs=0.05)
