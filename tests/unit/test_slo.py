"""SLO arithmetic and the summary numbers, against hand-computed examples."""

from __future__ import annotations

import pytest

from loadgen.report import metrics, run_span_s, summarize, table, timeline
from loadgen.results import Result
from shared.slo import SLO, attainment, goodput_rps, parse_slo


def res(
    i: int,
    *,
    sent: float = 0.0,
    ttft: float | None = 0.1,
    e2e: float | None = 1.0,
    out: int = 10,
    inp: int = 100,
    model: str = "m",
    error: str | None = None,
) -> Result:
    return Result(
        index=i,
        model=model,
        scheduled_s=sent,
        sent_s=sent,
        input_tokens=inp,
        output_tokens=out,
        prompt_tokens=inp,
        completion_tokens=out,
        ttft_s=ttft,
        e2e_s=e2e,
        gaps_s=[] if ttft is None else [(e2e - ttft) / max(1, out - 1)] * (out - 1),
        status=200 if error is None else 503,
        error=error,
    )


def test_default_is_llm_mesh() -> None:
    slo = SLO()
    assert slo.ttft_limit_s(100) == 2.0  # max(2, 100/512)
    assert slo.ttft_limit_s(1024) == 2.0  # 1024/512 = 2
    assert slo.ttft_limit_s(2048) == 4.0  # long prompts get prefill time
    assert slo.tpot_s == 0.25
    assert slo.describe() == "TTFT <= max(2 s, input_tokens/512 s), TPOT <= 0.25 s"


@pytest.mark.parametrize(
    ("ok", "inp", "ttft", "tpot", "met"),
    [
        (True, 100, 1.9, 0.2, True),
        (True, 100, 2.1, 0.2, False),  # TTFT over the 2 s floor
        (True, 2048, 3.9, 0.2, True),  # 2048/512 = 4 s allowed
        (True, 2048, 4.1, 0.2, False),
        (True, 100, 0.5, 0.25, True),  # limits are inclusive
        (True, 100, 0.5, 0.26, False),  # TPOT over
        (True, 100, 0.5, None, True),  # one output token: no TPOT, judged on TTFT
        (False, 100, 0.1, 0.01, False),  # a failed request misses whatever its timings
        (True, 100, None, None, False),  # no first token: a miss
    ],
)
def test_met(ok, inp, ttft, tpot, met) -> None:
    assert SLO().met(ok=ok, input_tokens=inp, ttft_s=ttft, tpot_s=tpot) is met


def test_parse_slo() -> None:
    assert parse_slo("ttft=1s,tpot=100ms") == SLO(ttft_s=1.0, tpot_s=0.1)
    assert parse_slo("ttft_per_token=1/1024").ttft_per_input_token_s == 1 / 1024
    assert parse_slo("ttft=500ms", SLO(tpot_s=0.05)) == SLO(ttft_s=0.5, tpot_s=0.05)
    with pytest.raises(ValueError, match="bad SLO term"):
        parse_slo("latency=3")


def test_attainment_and_goodput() -> None:
    assert attainment([True, False, True, True]) == 0.75
    assert attainment([]) is None
    assert goodput_rps([True, False, True], 4.0) == 0.5
    assert goodput_rps([True], 0.0) == 0.0


def test_summary_hand_computed() -> None:
    # Four requests over 0..10 s:
    #   0: sent 0, TTFT 0.5, E2E 2.5, 5 tokens   → TPOT (2.5-0.5)/4 = 0.5: misses TPOT
    #   1: sent 1, TTFT 0.2, E2E 1.1, 10 tokens  → TPOT 0.1: meets
    #   2: sent 2, failed (503)                   → counts as a miss
    #   3: sent 4, TTFT 3.0 (input 2048 → 4 s ok), E2E 6.0, 13 tokens → TPOT 0.25: meets
    rs = [
        res(0, sent=0, ttft=0.5, e2e=2.5, out=5),
        res(1, sent=1, ttft=0.2, e2e=1.1, out=10),
        res(2, sent=2, ttft=None, e2e=None, error="unavailable"),
        res(3, sent=4, ttft=3.0, e2e=6.0, out=13, inp=2048),
    ]
    assert run_span_s(rs) == 10.0  # first send 0 → last end 4 + 6
    s = summarize(rs, SLO())
    assert s["requests"] == 4 and s["failed"] == 1
    assert s["slo_met"] == 2 and s["slo_attainment"] == 0.5
    assert s["goodput_rps"] == 0.2  # 2 requests met / 10 s
    assert s["throughput_tok_s"] == 2.8  # (5 + 10 + 13) tokens / 10 s
    assert s["request_rate_rps"] == 0.3
    assert s["ttft_ms"]["p50"] == 500.0  # of 0.2, 0.5, 3.0
    assert s["tpot_ms"]["p50"] == 250.0  # of 0.1, 0.25, 0.5
    assert s["e2e_ms"]["p90"] == pytest.approx(5.3 * 1000)  # 2.5 + 0.8 * (6.0 - 2.5)
    assert s["errors"] == ["unavailable"]
    assert s["duration_s"] == 10.0


def test_per_model_and_json_safe_empty() -> None:
    rs = [res(0, model="a"), res(1, model="b", ttft=None, e2e=None, error="x")]
    s = summarize(rs, SLO())
    assert s["per_model"]["a"]["slo_attainment"] == 1.0
    assert s["per_model"]["b"]["slo_attainment"] == 0.0
    assert s["per_model"]["b"]["ttft_ms"] == {"p50": None, "p90": None, "p99": None, "mean": None}
    assert metrics([], SLO(), 1.0)["slo_attainment"] is None
    assert "per_trace_model" not in s
    for r, tm in zip(rs, ("x", "y"), strict=True):
        r.trace_model = tm
    assert set(summarize(rs, SLO())["per_trace_model"]) == {"x", "y"}


def test_timeline_bins() -> None:
    rs = [res(i, sent=float(i), ttft=0.1, e2e=0.5, out=5) for i in range(10)]
    tl = timeline(rs, SLO(), bins=5)
    assert len(tl["t_s"]) == 5 and tl["width_s"][0] == pytest.approx(9.5 / 5)  # to the last end
    assert tl["send_width_s"][0] == pytest.approx(9 / 5)  # to the last send
    assert [tl["sent_rps"][i] * tl["send_width_s"][i] for i in range(5)] == pytest.approx([2] * 5)
    total_tokens = sum(tl["output_tok_s"][i] * tl["width_s"][i] for i in range(5))
    assert total_tokens == pytest.approx(50)
    assert tl["slo_attainment"] == [1.0] * 5


def test_table_side_by_side() -> None:
    a = summarize([res(0)], SLO())
    b = summarize([res(0, ttft=0.3, e2e=2.0)], SLO())
    text = table({"meshserve": a, "vllm": b})
    lines = text.splitlines()
    assert "meshserve" in lines[0] and "vllm" in lines[0]
    ttft = next(line for line in lines if line.startswith("ttft p50"))
    assert ttft.split()[-2:] == ["100.0", "300.0"]


def test_pd_split_where_the_server_said() -> None:
    rs = [res(0), res(1, ttft=0.5), res(2, ttft=0.2)]
    assert "pd" not in summarize(rs, SLO())  # the server said nothing
    rs[0].disaggregated, rs[1].disaggregated, rs[2].disaggregated = False, True, True
    pd = summarize(rs, SLO())["pd"]
    assert pd["disaggregated"]["requests"] == 2 and pd["colocated"]["requests"] == 1
    assert pd["disaggregated"]["ttft_ms"]["p50"] == pytest.approx(350.0)
