"""Planning (model names, clipping to the context) and trace reshaping."""

from __future__ import annotations

import pytest

from loadgen.plan import PlanError, fit, parse_models_map, plan, served_model
from loadgen.traces import TraceRequest
from loadgen.transforms import limit, scale_rate, scale_time


def trace(n: int, gap: float = 1.0, **kw) -> list[TraceRequest]:
    return [
        TraceRequest(arrival_s=i * gap, input_tokens=100 + i, output_tokens=10, **kw)
        for i in range(n)
    ]


def test_fit_clips_prompt_then_output() -> None:
    assert fit(100, 50, max_context=1024) == (100, 50, False, False)
    assert fit(5000, 50, max_context=1024) == (1023, 1, True, True)  # tail cut, 1 left
    assert fit(1000, 50, max_context=1024) == (1000, 24, False, True)  # output fits the rest
    assert fit(100, 50, max_context=None, max_output_tokens=16) == (100, 16, False, True)
    assert fit(0, 0, max_context=None) == (1, 1, False, False)  # empty rows still send
    with pytest.raises(PlanError):
        fit(10, 10, max_context=1)


def test_models_map_and_default() -> None:
    m = parse_models_map("ChatGPT=demo, GPT-4=demo2")
    assert m == {"ChatGPT": "demo", "GPT-4": "demo2"}
    assert served_model("GPT-4", None, m) == "demo2"
    assert served_model("Claude", "fallback", m) == "fallback"
    assert served_model("Claude", None, {"*": "any"}) == "any"
    assert served_model("x", None, {}) == "x"
    assert served_model(None, "demo", {}) == "demo"
    with pytest.raises(PlanError, match="--model"):
        served_model(None, None, {})
    with pytest.raises(PlanError, match="models-map"):
        parse_models_map("nonsense")


def test_plan_counts_clipped_and_keeps_trace_lengths() -> None:
    reqs = [TraceRequest(0, 5000, 100, model="a"), TraceRequest(1, 10, 5, model="b")]
    p = plan(
        reqs,
        models_map={"a": "big", "b": "small"},
        max_context={"big": 8192, "small": 1024},
        max_output_tokens=50,
    )
    assert [(x.model, x.input_tokens, x.output_tokens, x.clipped_prompt) for x in p] == [
        ("big", 5000, 50, False),
        ("small", 10, 5, False),
    ]
    p = plan(reqs, model="small", max_context={"small": 1024})
    assert (p[0].input_tokens, p[0].trace_input_tokens, p[0].clipped_prompt) == (1023, 5000, True)
    assert p[0].key != p[1].key


def test_time_scale() -> None:
    assert [r.arrival_s for r in scale_time(trace(3), 0.1)] == pytest.approx([0, 0.1, 0.2])
    with pytest.raises(ValueError):
        scale_time(trace(3), 0)


def test_rate_scale_thins_deterministically() -> None:
    reqs = trace(2000)
    a = scale_rate(reqs, 0.25, seed=1)
    assert a == scale_rate(reqs, 0.25, seed=1) and a != scale_rate(reqs, 0.25, seed=2)
    assert 400 < len(a) < 600
    assert set(a) <= set(reqs)  # arrivals untouched: a thinned process


def test_rate_scale_replicates_with_renamed_blocks() -> None:
    reqs = trace(1000, hash_ids=(1, 2), block_size=16)
    b = scale_rate(reqs, 2.5, seed=0)
    assert 2400 < len(b) < 2600
    assert [r.arrival_s for r in b] == sorted(r.arrival_s for r in b)
    assert b[-1].arrival_s <= reqs[-1].arrival_s + 1.0  # jitter at most one mean gap
    # Copies share prefixes among themselves as the originals did, never across replicas.
    ids = {r.hash_ids for r in b}
    assert ids == {(3, 6), (4, 7), (5, 8)}  # h * 3 + replica


def test_limit() -> None:
    reqs = trace(10)
    assert len(limit(reqs, duration_s=4.5)) == 5
    assert len(limit(reqs, max_requests=3)) == 3
    assert len(limit(reqs, duration_s=4.5, max_requests=8)) == 5
