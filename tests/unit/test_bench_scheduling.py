"""scripts/bench_scheduling.py runs end to end on the demo model and writes what it printed."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_scheduling


def test_bench_scheduling_replays_both_scenarios_under_each_setting(tmp_path, demo_model_dir):
    out = tmp_path / "scheduling.json"
    argv = [
        "--model",
        str(demo_model_dir),
        "--requests",
        "3",
        "--concurrency",
        "2",
        "--prompt",
        "40",
        "--output",
        "4",
        "--long-prompt",
        "120",
        "--reps",
        "1",
        "--settings",
        "whole:64,chunked:16",
        "--out",
        str(out),
    ]
    assert bench_scheduling.main(argv) == 0
    medians = json.loads(out.read_text())["medians"]
    assert set(medians) == {"closed", "long"}
    for scenario in medians.values():
        assert set(scenario) == {"whole:64", "chunked:16"}
    for row in medians["closed"].values():
        assert row["aggregate_tok_s"] > 0 and row["ttft_p90_s"] >= row["ttft_p50_s"] > 0
    for row in medians["long"].values():
        assert row["long_ttft_s"] > 0 and row["decode_stall_max_s"] > 0
