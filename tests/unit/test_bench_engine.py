"""The pure parts of scripts/bench_engine.py: the summary table and the goals it checks."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_engine
from bench_common import bound_tok_s, median, prompts_for

TORCH = [
    {"model": "m", "engine": "torch", "dtype": "bfloat16", "batch": 1, "engine_tok_s": 30.0,
     "hf_tok_s": 15.0, "bound_tok_s": 50.0, "pct_bound": 60.0},
    {"model": "m", "engine": "torch", "dtype": "bfloat16", "batch": 8, "engine_tok_s": 150.0,
     "hf_tok_s": 80.0, "bound_tok_s": 400.0, "pct_bound": 37.5},
]  # fmt: skip
OV = [
    {"model": "m", "engine": "openvino", "weight_format": "int8", "point": "decode b1",
     "batch": 1, "engine_tok_s": 80.0, "direct_tok_s": 82.0, "pct_bound": 72.0},
    {"model": "m", "engine": "openvino", "weight_format": "int8", "point": "prefill 512",
     "batch": 1, "engine_tok_s": 900.0, "direct_tok_s": float("nan"), "pct_bound": None},
]  # fmt: skip
API = [
    {"model": "m", "engine": "openvino", "weight_format": "int8", "point": "decode b1",
     "api_vs_direct": 0.93},
]  # fmt: skip
PREFIX = [
    {"model": "m", "engine": "torch", "dtype": "bfloat16", "prefill_tok_s": 700.0,
     "ttft_ratio": 0.05},
]  # fmt: skip


def test_summary_has_one_row_per_engine_and_variant():
    summary = bench_engine.summary_rows(TORCH, OV, PREFIX)
    by = {(s["engine"], s["variant"]): s for s in summary}
    assert set(by) == {("torch", "bfloat16"), ("openvino", "int8")}
    t, o = by["torch", "bfloat16"], by["openvino", "int8"]
    assert t["decode_tok_s"] == {1: 30.0, 8: 150.0} and t["pct_bound_b1"] == 60.0
    assert t["ref_b1_tok_s"] == 15.0 and t["prefill_tok_s"] == 700.0
    assert t["ttft_cached_over_uncached"] == 0.05
    assert o["decode_tok_s"] == {1: 80.0} and o["ref_b1_tok_s"] == 82.0
    # no prefix-cache row for OpenVINO: its prefill comes from its own table
    assert o["prefill_tok_s"] == 900.0 and o["ttft_cached_over_uncached"] is None


def test_goals_name_value_target_and_verdict():
    got = {(g["goal"], g["engine"]): g for g in bench_engine.goals(TORCH, OV, API, PREFIX)}
    assert got["torch_engine_vs_hf_batch1", "torch"]["value"] == 2.0
    assert got["torch_engine_vs_hf_batch1", "torch"]["met"]
    assert got["torch_batch8_vs_batch1", "torch"]["value"] == 5.0
    frac = got["openvino_batch1_fraction_of_bound", "openvino"]
    assert abs(frac["value"] - 0.72) < 1e-12 and frac["met"] and frac["target"] == ">= 0.7"
    api = got["openvino_api_vs_genai_direct", "openvino"]
    assert api["point"] == "decode b1" and not api["met"]
    assert got["ttft_cached_prefix_over_uncached", "torch"]["met"]


def test_common_helpers():
    assert bound_tok_s(8, 50.0, 10**9) == 400.0
    assert median([]) != median([])  # NaN
    a, b = prompts_for(2, 16, 151_936, seed=3), prompts_for(2, 16, 151_936, seed=3)
    assert a == b and a[0] != a[1] and all(8 <= t < 4000 for p in a for t in p)
