"""The scaler's PD split on hand-built states: prefill instances sized by the prompt tokens
the job executors' PD rule would send to them, loaded after the model's other instances,
taking their share of the load off the others, yielding their TE to a model short of
whole-request instances, scaled in after the stable window, gone at the keep-alive; none
where the policy allows none."""

from __future__ import annotations

import dataclasses

import pytest

from services.job_executor.traffic import TrafficLedger
from services.scaler.config import scaler_config
from services.scaler.policy import Load, Unload, decide
from services.scaler.state import (
    ModelPolicy,
    ScalerConfig,
    ScalerState,
    observe_capacity,
    observe_traffic,
)
from services.scaler.target import target
from services.views import TEView
from shared.messages.cluster import TEState
from shared.messages.scaling import InstanceCapacity, ModelTraffic
from shared.messages.tasks import TaskMode
from shared.settings import Settings

T0 = 1_000_000.0
# One instance: 1,000 prompt tokens/s and 100 output tokens/s, 8 sequences at once.
CAP = InstanceCapacity(
    prefill_s=1e-3, prefill_attention_s=0.0, decode_s=0.01, decode_context_s=0.0, max_num_seqs=8
)
POLICY = ModelPolicy(max_replicas=6, target_utilization=0.5, keep_alive_s=30)
PD = ScalerConfig(default=dataclasses.replace(POLICY, max_prefill_replicas=2))
NO_PD = ScalerConfig(default=POLICY)


def te(te_id, state=TEState.READY, role=TaskMode.COLOCATED, running=0, last_active=T0, queued=0):
    return TEView(
        te_id=te_id,
        pool_id="p1",
        state=state,
        model="m" if state != TEState.IDLE else None,
        running=running,
        last_active=last_active,
        role=role,
        queued_prompt_tokens=queued,
    )


def idle(te_id):
    return te(te_id, TEState.IDLE)


def prefill(te_id, **kw):
    return te(te_id, role=TaskMode.PREFILL, **kw)


def traffic(state, *, seconds, rps, prompt, pd_share, placed=0.0, start=T0, cfg=PD):
    """``rps`` requests a second of ``prompt`` tokens, ``pd_share`` of them with prompts the
    PD rule sends to a prefill instance (all their tokens uncached), ``placed`` of them
    placed there, reported each 0.5 s."""
    for i in range(round(seconds * 2)):
        n = int(rps * (i + 1) * 0.5) - int(rps * i * 0.5)
        pd = round(n * pd_share)
        t = ModelTraffic(
            model="m",
            arrivals=n,
            prompt_tokens=n * prompt,
            max_output_tokens=n * 16,
            pd_arrivals=pd,
            pd_prompt_tokens=pd * prompt,
            pd_placed_tokens=round(n * placed * prompt),
        )
        state = observe_traffic(state, "je1", [t], now=start + i * 0.5, cfg=cfg)
    return state


def fresh():
    return observe_capacity(ScalerState(), "m", CAP)


def test_prefill_instances_are_sized_by_the_prompts_the_pd_rule_sends_them() -> None:
    # 0.3 req/s of 4,000-token prompts, all PD-bound: 1,200 prompt tokens/s, 1.2 instances
    # of prefill work, 3 at 50%: clamped to max_prefill_replicas (2).
    s = traffic(fresh(), seconds=60, rps=0.3, prompt=4000, pd_share=1.0)
    tes = [te("r1"), idle("a"), idle("b"), idle("c"), idle("d")]
    d = decide(s, tes, models=["m"], now=T0 + 60, cfg=PD)
    t = d.targets["m"]
    assert t.prefill_wanted == 2 and t.prefill_current == 0
    assert t.prefill_load > 1.0
    prefill_loads = [a for a in d.actions if isinstance(a, Load) and a.role == TaskMode.PREFILL]
    assert [a.reason for a in prefill_loads] == ["prefill load", "prefill load"]
    # Sent: the next tick counts them as coming and loads no more.
    d2 = decide(d.state, tes, models=["m"], now=T0 + 60.5, cfg=PD)
    assert not [a for a in d2.actions if isinstance(a, Load) and a.role == TaskMode.PREFILL]
    assert d2.targets["m"].prefill_current == 2


def test_no_prefill_instance_where_the_policy_allows_none_and_an_operators_stays() -> None:
    s = traffic(fresh(), seconds=10, rps=0.3, prompt=4000, pd_share=1.0, cfg=NO_PD)
    tes = [te("r1"), prefill("p"), idle("a"), idle("b")]
    d = decide(s, tes, models=["m"], now=T0 + 10, cfg=NO_PD)
    assert not [a for a in d.actions if getattr(a, "role", None) == TaskMode.PREFILL]
    assert not [a for a in d.actions if isinstance(a, Unload) and a.te_id == "p"]
    assert d.targets["m"].prefill_wanted == d.targets["m"].prefill_current == 1
    # At the keep-alive it goes with the model.
    later = T0 + 10 + 31
    tes = [te("r1", last_active=T0), prefill("p", last_active=T0), idle("a"), idle("b")]
    d = decide(s, tes, models=["m"], now=later, cfg=NO_PD)
    assert {(a.te_id, a.reason) for a in d.actions if isinstance(a, Unload)} == {
        ("r1", "keep-alive expired"),
        ("p", "keep-alive expired"),
    }


def test_prefill_instances_take_their_share_of_the_load_off_the_others() -> None:
    s = traffic(fresh(), seconds=60, rps=0.5, prompt=4000, pd_share=1.0, placed=1.0)
    mem = s.models["m"]
    alone = target("m", mem, [te("r1")], now=T0 + 60, cfg=PD)
    beside = target("m", mem, [te("r1")], prefill=[prefill("p1")], now=T0 + 60, cfg=PD)
    # 2,000 prompt tokens/s: 2 instances of prefill work, of which one prefill instance
    # takes what one instance can.
    assert alone.prefill_load == beside.prefill_load == 2.0
    assert alone.stable_load - beside.stable_load == 1.0
    assert beside.prefill_current == 1 and beside.prefill_wanted == 2
    # What the rule wanted there but kept where it was (the prefill instance's queue was
    # longer) stays the others' load: a quarter placed there is half an instance's worth.
    s = traffic(fresh(), seconds=60, rps=0.5, prompt=4000, pd_share=1.0, placed=0.25)
    mem = s.models["m"]
    quarter = target("m", mem, [te("r1")], prefill=[prefill("p1")], now=T0 + 60, cfg=PD)
    assert quarter.prefill_load == 2.0
    assert alone.stable_load - quarter.stable_load == pytest.approx(0.5, abs=0.02)


def test_the_models_other_instances_get_idle_tes_before_its_prefill_instances() -> None:
    # A burst that wants more of everything, with one idle TE: it goes to a whole-request
    # instance, and no prefill instance is loaded.
    s = traffic(fresh(), seconds=6, rps=2, prompt=3000, pd_share=1.0)
    d = decide(s, [te("r1", running=8), idle("a")], models=["m"], now=T0 + 6, cfg=PD)
    t = d.targets["m"]
    assert t.wanted > t.current and t.prefill_wanted > 0
    assert [(a.te_id, a.role) for a in d.actions if isinstance(a, Load)] == [
        ("a", TaskMode.COLOCATED)
    ]


def test_a_model_short_of_whole_request_instances_takes_a_prefill_instances_te() -> None:
    # Every TE busy; a burst wants more whole-request instances: the prefill instance yields
    # its TE (reserved for the model).
    s = traffic(fresh(), seconds=6, rps=2, prompt=3000, pd_share=1.0)
    tes = [te("r1", running=8), prefill("p1")]
    d = decide(s, tes, models=["m"], now=T0 + 6, cfg=PD)
    assert d.actions == [Unload("p1", "m", "reclaimed for m")]
    assert d.state.reserved == {"p1": "m"}
    assert d.state.models["m"].prefill_yielded_at == T0 + 6
    # An operator's prefill instance (the policy allows the scaler none) stays.
    s_op = traffic(fresh(), seconds=6, rps=2, prompt=3000, pd_share=1.0, cfg=NO_PD)
    assert decide(s_op, tes, models=["m"], now=T0 + 6, cfg=NO_PD).actions == []
    # Drained, the freed TE takes a whole-request instance.
    d = decide(d.state, [te("r1", running=8), idle("p1")], models=["m"], now=T0 + 7, cfg=PD)
    assert [(a.te_id, a.role) for a in d.actions if isinstance(a, Load)] == [
        ("p1", TaskMode.COLOCATED)
    ]
    # Prefill work and idle TEs (four prefill instances' worth, two allowed): none loads
    # within a stable window of a yield, both after it.
    s = traffic(fresh(), seconds=60, rps=0.3, prompt=4000, pd_share=1.0)
    tes = [te("r1"), idle("a"), idle("b"), idle("c"), idle("d")]

    def prefill_loads(yielded_at: float) -> int:
        mem = dataclasses.replace(s.models["m"], prefill_yielded_at=yielded_at)
        state = dataclasses.replace(s, models={"m": mem})
        d = decide(state, tes, models=["m"], now=T0 + 60, cfg=PD)
        return sum(isinstance(a, Load) and a.role == TaskMode.PREFILL for a in d.actions)

    assert prefill_loads(T0 + 30) == 0
    assert prefill_loads(T0 - 1) == 2


def test_prefill_instances_scale_in_after_the_stable_window_when_long_prompts_stop() -> None:
    # A minute of short prompts only (no PD-bound work): the prefill instance is surplus.
    s = traffic(fresh(), seconds=60, rps=1, prompt=200, pd_share=0.0)
    tes = [te("r1"), prefill("p1")]
    now = T0 + 60
    d = decide(s, tes, models=["m"], now=now, cfg=PD)
    assert d.actions == [] and d.state.models["m"].prefill_below_since == now
    s = traffic(d.state, seconds=59, rps=1, prompt=200, pd_share=0.0, start=now)
    d = decide(s, tes, models=["m"], now=now + 59, cfg=PD)
    assert d.actions == []
    s = traffic(d.state, seconds=1, rps=1, prompt=200, pd_share=0.0, start=now + 59)
    d = decide(s, tes, models=["m"], now=now + 60, cfg=PD)
    assert d.actions == [Unload("p1", "m", "prefill load fell")]
    assert d.state.draining == {"p1": "m"}


def test_prompts_queued_at_the_prefill_instances_scale_them_out_before_the_window_sees_it() -> None:
    # Ten seconds of long prompts to a model seen for a minute (one short prompt 50 s
    # before): the stable window (60 s) sees a sixth of their rate, one instance's worth,
    # while 9,000 prompt tokens wait at the one prefill instance: 4.5 s of its work, over
    # backlog_drain_s (2 s): 3 instances, clamped to 2.
    s = traffic(fresh(), seconds=0.5, rps=2, prompt=16, pd_share=0.0, start=T0 - 50)
    s = traffic(s, seconds=10, rps=0.3, prompt=4000, pd_share=1.0, placed=1.0)
    tes = [te("r1"), prefill("p1", queued=9000), idle("a"), idle("b")]
    d = decide(s, tes, models=["m"], now=T0 + 10, cfg=PD)
    assert d.targets["m"].prefill_wanted == 2
    assert [(a.te_id, a.role) for a in d.actions if isinstance(a, Load)] == [
        ("a", TaskMode.PREFILL)
    ]
    no_queue = [te("r1"), prefill("p1"), idle("a"), idle("b")]
    assert decide(s, no_queue, models=["m"], now=T0 + 10, cfg=PD).targets["m"].prefill_wanted == 1


def test_the_job_executors_traffic_report_carries_the_prefill_work() -> None:
    ledger = TrafficLedger()
    ledger.arrived("m", 5000, 64)
    ledger.prefill_wanted("m", 4200)
    ledger.arrived("m", 100, 64)
    (report,) = ledger.report()
    assert (report.arrivals, report.pd_arrivals, report.pd_prompt_tokens) == (2, 1, 4200)
    assert ledger.report() == []  # counts start again


def test_max_prefill_replicas_comes_from_the_settings_per_model() -> None:
    settings = Settings.load(
        {},
        scaler={
            "max_prefill_replicas": 1,
            "model_scaling": {"big": {"max_prefill_replicas": 3}, "small": {"max_replicas": 2}},
        },
    )
    cfg = scaler_config(settings)
    assert cfg.policy("big").max_prefill_replicas == 3
    assert cfg.policy("small").max_prefill_replicas == 1
    assert cfg.policy("other").max_prefill_replicas == 1
    assert scaler_config(Settings.load({})).default.max_prefill_replicas == 0
