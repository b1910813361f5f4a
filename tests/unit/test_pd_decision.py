"""The per-request PD decision (``services/job_executor/disaggregation.py``): after routing
picks the decode instance, the prompt goes to a prefill instance only when the part that
instance lacks is long and mostly uncached, and the least busy prefill instance has no more
queued than the decode instance (nor past the queue limit)."""

from __future__ import annotations

import dataclasses

from services.job_executor.disaggregation import (
    PdConfig,
    PdDecision,
    decide,
    prefill_instances,
)
from services.views import TEView
from shared.messages.cluster import JobShare, TEState
from shared.messages.tasks import TaskMode

DECODE = TEView("d", "p", TEState.READY, model="m", kv_import=True)
P1 = TEView("p1", "p", TEState.READY, model="m", role=TaskMode.PREFILL, kv_address="h:1")
P2 = dataclasses.replace(P1, te_id="p2", kv_address="h:2", queued_prompt_tokens=5000)


def _decision(config: PdConfig, prompt: int, cached: int = 0, **kw: object) -> PdDecision:
    args: dict[str, object] = {
        "decode": DECODE,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "max_tokens": 64,
        "prefill_tes": [P1, P2],
        "unreported": {},
    } | kw
    return decide(config, **args)  # type: ignore[arg-type]


def _decide(config: PdConfig, prompt: int, cached: int = 0, **kw: object) -> str | None:
    return _decision(config, prompt, cached, **kw).prefill_te


def test_auto_disaggregates_long_uncached_prompts_only() -> None:
    auto = PdConfig(mode="auto", min_uncached_tokens=2048, min_uncached_ratio=0.7)
    assert _decide(auto, 4096) == "p1"  # the least busy prefill instance
    assert _decide(auto, 1000) is None  # short
    assert _decide(auto, 4096, cached=3000) is None  # mostly cached on the decode instance
    assert _decide(auto, 8192, cached=2048) == "p1"  # 6144 uncached, 75%
    assert _decide(auto, 8192, cached=3000) is None  # 63% uncached


def test_a_backed_up_prefill_fleet_means_local_prefill() -> None:
    auto = PdConfig(mode="auto", max_prefill_queue_tokens=4000)
    busy = {"p1": JobShare(prefill_tokens=4500)}
    # p1 has 4500 unreported, p2 5000 reported: the least busy is past the threshold.
    assert _decide(auto, 4096, unreported=busy) is None
    assert _decide(auto, 4096) == "p1"
    # Under the threshold, but more queued there than on the decode instance: the prompt
    # would start later on the prefill instance than where it is.
    roomy = PdConfig(mode="auto")
    some = {"p1": JobShare(prefill_tokens=3000)}
    got = _decision(roomy, 4096, prefill_tes=[P1], unreported=some)
    assert (got.prefill_te, got.reason, got.wanted) == (None, "prefill queue longer", True)
    queued = dataclasses.replace(DECODE, queued_prompt_tokens=3000)
    assert _decide(roomy, 4096, unreported=some, decode=queued) == "p1"  # no longer there
    assert _decide(PdConfig(mode="always"), 4096, unreported=some) == "p1"


def test_a_prefill_instance_without_kv_room_is_passed_over() -> None:
    # It holds each prompt's KV until the decode instance pulls it: a prompt that does not
    # fit there would wait for the earlier ones' pulls.
    auto = PdConfig(mode="auto")
    full = dataclasses.replace(P1, kv_free_tokens=3000)
    roomy = dataclasses.replace(P2, kv_free_tokens=40000, queued_prompt_tokens=0)
    assert _decide(auto, 4096, prefill_tes=[full, roomy]) == "p2"
    assert _decide(auto, 2500, prefill_tes=[full, roomy]) == "p1"  # fits: the usual choice
    got = _decision(auto, 4096, prefill_tes=[full])
    assert (got.prefill_te, got.reason, got.wanted) == (None, "prefill KV full", True)


def test_always_never_and_what_cannot_disaggregate() -> None:
    always, never = PdConfig(mode="always"), PdConfig(mode="never")
    assert _decide(always, 10) == "p1"
    assert _decide(never, 100_000) is None
    assert _decide(always, 10, max_tokens=1) is None  # nothing to decode
    assert _decide(always, 10, prefill_tes=[]) is None
    no_import = dataclasses.replace(DECODE, kv_import=False)
    assert _decide(always, 10, decode=no_import) is None


def test_prefill_instances_are_the_ready_prefill_role_ones_with_a_kv_server() -> None:
    loading = dataclasses.replace(P1, te_id="p3", state=TEState.LOADING)
    silent = dataclasses.replace(P1, te_id="p4", kv_address="")
    other = dataclasses.replace(P1, te_id="p5", model="x")
    got = prefill_instances("m", [DECODE, P1, P2, loading, silent, other])
    assert [te.te_id for te in got] == ["p1", "p2"]


def test_wanted_is_the_rule_without_the_prefill_fleet() -> None:
    """What the job executor reports as prefill work for the scaler (``PdDecision.wanted``):
    the requests ``decide`` would send to a prefill instance were one ready and not backed
    up."""
    auto = PdConfig(mode="auto")

    def wants(config: PdConfig, prompt: int, cached: int = 0, **kw: object) -> bool:
        return _decision(config, prompt, cached, **({"prefill_tes": []} | kw)).wanted

    for prompt, cached in [(4096, 0), (1000, 0), (4096, 3000), (8192, 2048), (8192, 3000)]:
        assert wants(auto, prompt, cached) == (_decide(auto, prompt, cached) is not None)
        assert _decide(auto, prompt, cached, prefill_tes=[]) is None
    # A backed-up prefill fleet keeps the prompt local, yet it is prefill work that wants
    # more prefill instances.
    full = PdConfig(mode="auto", max_prefill_queue_tokens=4000)
    busy = {"p1": JobShare(prefill_tokens=4500)}
    assert _decide(full, 4096, unreported=busy) is None
    assert wants(full, 4096) and wants(full, 4096, prefill_tes=[P1], unreported=busy)
    assert wants(PdConfig(mode="always"), 10) and not wants(PdConfig(mode="never"), 100_000)
    assert not wants(auto, 4096, max_tokens=1)
    assert not wants(auto, 4096, decode=dataclasses.replace(DECODE, kv_import=False))
