"""scripts/bench_kernels.py runs end to end on a small budget and writes what it printed."""

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_kernels


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: no kernel to time")
def test_bench_kernels_times_both_paths_and_writes_json(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_kernels, "ATTENTION_CASES", ((1, 40), (3, 100)))
    monkeypatch.setattr(bench_kernels, "PACK_BATCHES", (1, 8))
    monkeypatch.setattr(bench_kernels, "LAYERS", 1)
    out = tmp_path / "kernels.json"
    assert bench_kernels.main(["--reps", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    attention = result["decode_attention"]
    assert {(r["dtype"], r["batch"]) for r in attention} == {
        (d, b) for d in ("bfloat16", "float32") for b in (1, 3)
    }
    for r in attention:
        assert r["torch_us"] > 0 and r["kernel_us"] > 0
        assert r["max_abs_diff"] < (1e-5 if r["dtype"] == "float32" else 2e-2)
    packing = result["packing"]
    assert {r["batch"] for r in packing} == {1, 8} and all(r["hint_speedup"] > 0 for r in packing)
