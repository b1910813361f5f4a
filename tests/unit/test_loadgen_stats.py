from loadgen.cli import report
from loadgen.client import Record
from loadgen.stats import percentile


def test_percentile_interpolates_like_numpy():
    xs = [1.0, 2.0, 3.0, 4.0]
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile([5.0], 99) == 5.0


def test_tpot_excludes_the_first_token():
    r = Record(sent_at=0, ttft_s=0.5, e2e_s=1.5, completion_tokens=11)
    assert abs(r.tpot_s - 0.1) < 1e-12


def test_report_counts_failures_and_throughput():
    ok = Record(sent_at=0, ttft_s=0.1, e2e_s=1.0, completion_tokens=10, status=200)
    bad = Record(sent_at=0, status=503, error="unavailable")
    out = report([ok, bad], wall_s=2.0)
    assert out["failed"] == 1 and out["requests"] == 2
    assert out["throughput_tok_s"] == 5.0 and out["ttft_ms"]["p50"] == 100.0
