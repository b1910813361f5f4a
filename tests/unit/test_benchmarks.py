"""The benchmarks run: each as its users run it (``python -m bench.<name>``, in a process of
its own; no test imports them), the cheap ones end to end on a tiny budget."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_torch_engine import _write_tiny_llama

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _bench(*args: str, timeout: float = 120) -> str:
    out = subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.parametrize(
    "name",
    [
        "engine",
        "gpu",
        "kernels",
        "scheduling",
        "vs_vllm",
        "scaling",
        "routing",
        "coldstart",
        "concurrency",
        "sharing_fleet",
    ],
)
def test_every_bench_starts(name: str) -> None:
    assert "usage:" in _bench(f"bench.{name}", "--help")


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: no kernel to time")
def test_bench_kernels_times_both_paths_and_writes_what_it_printed(tmp_path: Path) -> None:
    out = tmp_path / "kernels.json"
    printed = _bench(
        "bench.kernels", "--reps", "2", "--cases", "1x40,3x100", "--pack-batches", "1,8",
        "--layers", "1", "--out", str(out),
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["host"]["cpus"] >= 1 and "cpu_flags" in result["host"]
    attention = result["decode_attention"]
    assert {(r["dtype"], r["batch"]) for r in attention} == {
        (d, b) for d in ("bfloat16", "float32") for b in (1, 3)
    }
    for r in attention:
        assert r["torch_us"] > 0 and r["kernel_us"] > 0
        assert r["max_abs_diff"] < (1e-5 if r["dtype"] == "float32" else 2e-2)
    assert {r["batch"] for r in result["packing"]} == {1, 8}
    assert "kernel µs" in printed and "hint 8 ÷ 1" in printed


def test_bench_scheduling_replays_both_scenarios_under_each_setting(tmp_path: Path) -> None:
    model = _write_tiny_llama(tmp_path / "tiny")
    out = tmp_path / "scheduling.json"
    printed = _bench(
        "bench.scheduling", "--model", str(model), "--requests", "3", "--concurrency", "2",
        "--prompt", "40", "--output", "4", "--long-prompt", "100", "--reps", "1",
        "--settings", "whole:64,chunked:16", "--out", str(out),
    )  # fmt: skip
    medians = json.loads(out.read_text())["medians"]
    assert set(medians) == {"closed", "long"}
    for scenario in medians.values():
        assert set(scenario) == {"whole:64", "chunked:16"}
    for row in medians["closed"].values():
        assert row["aggregate_tok_s"] > 0 and row["ttft_p90_s"] >= row["ttft_p50_s"] > 0
    for row in medians["long"].values():
        assert row["long_ttft_s"] > 0 and row["decode_stall_max_s"] > 0
    assert "closed (medians of 1)" in printed and "chunked:16" in printed


def test_bench_routing_times_the_prompt_index(tmp_path: Path) -> None:
    out = tmp_path / "routing.json"
    printed = _bench(
        "bench.routing", "--skip-cluster", "--skip-sim", "--index-tes", "5",
        "--index-blocks", "3000", "--index-prompt-tokens", "1024", "--out", str(out),
    )  # fmt: skip
    index = json.loads(out.read_text())["index"]
    assert index["tes"] == 5 and index["prompt_blocks"] == 64
    assert index["blocks"] >= 2900  # the prompt's blocks and each TE's own
    for key in ("hash_ms", "match_ms", "hash_and_match_ms", "miss_ms"):
        assert 0 < index[key]["p50"] <= index[key]["p99"]
    assert index["churn_batches_per_s"] > 0
    assert "prompt index: " in printed


def test_bench_multicast_times_both_schedules_side_by_side(tmp_path: Path) -> None:
    out = tmp_path / "multicast.json"
    printed = _bench(
        "bench.multicast", "--receivers", "1,3", "--bytes", "2MiB", "--block-bytes", "256KiB",
        "--reps", "2", "--quiet-wait", "0", "--out", str(out),
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["blocks"] == 8 and result["loopback_gb_s"] > 0
    rows = {(r["receivers"], r["schedule"]): r for r in result["rows"]}
    assert set(rows) == {(n, s) for n in (1, 3) for s in ("pipeline", "fan-out")}
    assert rows[3, "pipeline"]["steps"] == 8 - 1 + 2 and rows[3, "fan-out"]["steps"] == 3 * 8
    for (n, s), row in rows.items():
        assert row["seconds"] > 0 and row["vs_one"] > 0
        assert len(result["runs"][f"{s}/{n}"]) == 2
    # The pipeline's source sends about one copy, the fan-out's one per receiver.
    assert all(r["source_bytes_sent"] == 3 * (2 << 20) for r in result["runs"]["fan-out/3"])
    assert all(r["source_bytes_sent"] < 2 * (2 << 20) for r in result["runs"]["pipeline/3"])
    assert "fan-out ÷ pipeline" in printed


def test_bench_shadow_cost_times_a_validation_per_device_size(tmp_path: Path) -> None:
    printed = _bench(
        "bench.shadow_cost", "--requests", "1,8", "--repeats", "3", "--out", str(tmp_path)
    )
    rows = json.loads((tmp_path / "shadow-cost.json").read_text())["rows"]
    assert [(r["instances"], r["requests"]) for r in rows] == [(8, 1), (8, 8)]
    assert all(0 < r["median_ms"] <= r["p90_ms"] for r in rows)
    assert "median ms" in printed


def test_bench_kv_transport_pulls_over_both_transports_next_to_the_baselines(
    tmp_path: Path,
) -> None:
    out = tmp_path / "kv-transfer.json"
    printed = _bench(
        "bench.kv_transport", "--tokens", "64,300", "--repeats", "1", "--chunk", "128",
        "--quiet-wait", "0", "--out", str(out),
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert [r["tokens"] for r in result["rows"]] == [64, 300]
    for row in result["rows"]:
        for key in ("shm_gbps", "tcp_gbps", "memcpy_gbps", "socket_gbps", "shm_first_gbps"):
            assert row[key] > 0
        assert row["shm_vs_memcpy"] == row["shm_gbps"] / row["memcpy_gbps"]
    assert "shm/memcpy" in printed and "tcp/socket" in printed


def test_bench_output_length_scores_the_predictor_on_a_trace(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    lines = [
        {
            "arrival_s": i,
            "input_length": 4000 if i % 2 else 50,
            "output_length": 30 if i % 2 else 700,
        }
        for i in range(40)
    ]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "output-length.json"
    printed = _bench("bench.output_length", str(trace), "--out", str(out))
    (row,) = json.loads(out.read_text())["rows"]
    assert row["requests"] == 40 and row["predicted"] == 39
    assert row["exact"] > 0.9 > row["constant_exact"]  # the prompt's length tells them apart
    assert "const exact" in printed


def test_bench_coldstart_times_each_way_back_from_zero(tmp_path: Path) -> None:
    model = _write_tiny_llama(tmp_path / "tiny")
    out = tmp_path / "coldstart.json"
    modes = "te-disk-cold,te-disk-warm,te-cache-store,te-cache-hit,te-fork"
    printed = _bench(
        "bench.coldstart", "--model", str(model), "--modes", modes, "--reps", "1",
        "--out", str(out),
    )  # fmt: skip
    result = json.loads(out.read_text())
    rows = {r["mode"]: r for r in result["rows"]}
    assert set(rows) == set(modes.split(","))
    assert all(r["total_s"] > 0 and r["first_token"] > 0 for r in rows.values())
    stored = rows["te-cache-store"]["misses"]
    assert stored > 0 and rows["te-cache-hit"]["misses"] == 0
    assert rows["te-cache-hit"]["hits"] == rows["te-cache-store"]["hits"] + stored
    assert rows["te-fork"]["fetched"] == stored and rows["te-fork"]["misses"] == 0
    assert result["loopback_gb_s"] > 0
    assert "te-cache-hit" in printed


def test_bench_pd_heatmap_writes_the_table_auto_reads(tmp_path: Path) -> None:
    from services.job_executor.pd_heatmap import load

    out = tmp_path / "pd-heatmap.json"
    printed = _bench(
        "bench.pd_heatmap",
        *("--prompts", "512,4096", "--ratios", "0.03125,0.5", "--loads", "0.3,0.8"),
        *("--duration", "40", "--warmup", "10", "--prefill", "1", "--out", str(out)),
    )
    heatmap = load(out)["bench-qwen2-0.5b"]
    assert heatmap.prompt_tokens == (512, 4096) and heatmap.output_ratio == (0.03125, 0.5)
    assert len(heatmap.rate) == 2 and heatmap.rate[0] < heatmap.rate[1]
    runs = json.loads((tmp_path / "pd-heatmap-runs.json").read_text())
    assert len(runs["cells"]) == 8
    for cell in runs["cells"]:
        assert cell["requests"] > 0 and 0 <= cell["colocated"] <= 1
        delta = cell["pd"]["1"]["attainment"] - cell["colocated"]
        if abs(delta) > 0.01:
            assert cell["gain"] == pytest.approx(delta)
        else:  # a tie: TPOT p90 decides, within the tie's band
            tpot = 1 - cell["pd"]["1"]["tpot_p90_s"] / cell["colocated_tpot_p90_s"]
            want = 0.01 * max(-1, min(1, tpot)) if abs(tpot) >= 0.1 else 0.0
            assert cell["gain"] == pytest.approx(want)
    assert (tmp_path / "pd-heatmap.png").stat().st_size > 0
    assert "PD − colocated" in printed


def test_bench_pd_compares_like_with_like_on_trace_windows(tmp_path: Path) -> None:
    out = tmp_path / "pd.json"
    printed = _bench(
        "bench.pd",
        *("--requests", "40", "--windows", "azure", "--devices", "4", "--out", str(out)),
    )
    rows = json.loads(out.read_text())["rows"]
    assert {(r["device"], r["run"]) for r in rows} == {
        (d, run) for d in ("cpu", "cuda") for run in ("colocated", "always", "auto")
    }
    for device in ("cpu", "cuda"):
        mine = [r for r in rows if r["device"] == device]
        # Every run processed the same prompt and output tokens.
        assert len({(r["prompt_tokens"], r["output_tokens"]) for r in mine}) == 1
        assert all(r["failed"] == 0 for r in mine)
        always = next(r for r in mine if r["run"] == "always")
        assert always["disaggregated"] > 0 and always["kv_gb"] > 0
        assert next(r for r in mine if r["run"] == "colocated")["disaggregated"] == 0
    assert "prompt tok" in printed


def test_slo_scaling_compares_both_fleets_on_the_same_requests(tmp_path: Path) -> None:
    printed = _bench(
        "bench.slo_scaling", "--cases", "az10", "--devices", "4", "--duration", "20",
        "--out", str(tmp_path),
    )  # fmt: skip
    assert "az10:" in printed and "points behind always-on" in printed
    result = json.loads((tmp_path / "slo-scaling.json").read_text())
    auto, on = (
        next(r for r in result["rows"] if r["fleet"] == f) for f in ("autoscaled", "always-on")
    )
    # Like with like: the same requests and tokens through both fleets.
    assert [auto[k] for k in ("requests", "prompt_tokens", "output_tokens")] == [
        on[k] for k in ("requests", "prompt_tokens", "output_tokens")
    ]
    assert auto["requests"] > 0 and on["instance_s"] >= 4 * 20 * 0.9  # every device, throughout
    c = result["compare"]["az10"]
    assert c["instance_s_ratio"] == auto["instance_s"] / on["instance_s"]
