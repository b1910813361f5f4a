"""meshserve-loadgen replay, as a user runs it, against a whole local cluster: a slice of the
real Azure conversation trace, open-loop, with exact prompt lengths and forced outputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadgen.traces import read_trace
from tests.shared_traces import azure_slice

pytestmark = [pytest.mark.e2e, pytest.mark.nats, pytest.mark.redis]

ROOT = Path(__file__).resolve().parents[2]
AZURE = azure_slice()
N = 32
MAX_OUT = 16
CONTEXT = 1024  # below the demo model's 8192, so that the trace's long prompts get clipped
PNG = b"\x89PNG\r\n\x1a\n"


def loadgen(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loadgen.cli", *args],
        cwd=ROOT,
        text=True,
        capture_output=True,
        timeout=timeout,
    )


def test_replay_azure_slice(cluster_up, demo_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "azure"
    p = loadgen(
        "replay",
        str(AZURE),
        "--url",
        cluster_up.url,
        "--model",
        "demo",
        "--tokenizer",
        str(demo_model_dir),
        "--time-scale",
        "0.25",
        "--max-requests",
        str(N),
        "--max-output-tokens",
        str(MAX_OUT),
        "--max-context",
        str(CONTEXT),
        "--out",
        str(out),
    )
    assert p.returncode == 0, p.stderr
    assert "TTFT p50/p90/p99" in p.stdout and f"{N}/{N} done" in p.stderr

    trace = read_trace(AZURE)[:N]
    s = json.loads((out / "summary.json").read_text())
    assert s["requests"] == N and s["failed"] == 0, s["errors"]
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert 0 < s[key]["p50"] <= s[key]["p90"] <= s[key]["p99"]
    assert 0 <= s["slo_attainment"] <= 1 and s["throughput_tok_s"] > 0
    assert s["goodput_rps"] <= s["request_rate_rps"]
    assert s["clipped_prompts"] == sum(r.input_tokens > CONTEXT - 1 for r in trace) > 0
    assert s["prompt_tokens_exact"] and s["prompt_token_mismatches"] == 0
    assert s["output_token_mismatches"] == 0

    recs = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(recs) == N
    for rec, tr in zip(recs, trace, strict=True):
        assert rec["status"] == 200 and rec["error"] is None
        assert rec["trace_input_tokens"] == tr.input_tokens
        assert rec["scheduled_s"] == pytest.approx(tr.arrival_s * 0.25, abs=1e-3)
        # The server counted exactly the synthesised prompt, clipped to fit the context.
        assert rec["prompt_tokens"] == rec["input_tokens"] == min(tr.input_tokens, CONTEXT - 1)
        # Outputs forced to the trace's length (capped, and clipped to the context's rest).
        want = min(tr.output_tokens, MAX_OUT, CONTEXT - rec["input_tokens"])
        assert rec["completion_tokens"] == rec["output_tokens"] == want
        # One gap per event after the first: an event may carry several tokens when the
        # frontend's writer is behind (a loaded machine): they coalesce, never get lost (on a
        # busy host a short reply can come whole in one event: no gap at all).
        assert rec["ttft_s"] > 0 and len(rec["gaps_s"]) <= want - 1
        assert rec["e2e_s"] >= rec["ttft_s"] + sum(rec["gaps_s"]) - 1e-6
    assert any(rec["gaps_s"] for rec in recs)  # the gaps are recorded
    for png in ("latency_cdf", "latency_over_time", "throughput_over_time", "slo_over_time"):
        data = (out / f"{png}.png").read_bytes()
        assert data[:8] == PNG and len(data) > 5000


def test_replay_chat_api_counts_the_template(
    cluster_up, demo_model_dir: Path, tmp_path: Path
) -> None:
    trace = tmp_path / "chat.jsonl"
    trace.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": 50 * i,
                    "input_length": 40 + 37 * i,
                    "output_length": 6,
                    "hash_ids": [1, 2, 100 + i],
                }
            )
            + "\n"
            for i in range(6)
        )
    )
    out = tmp_path / "chat"
    p = loadgen(
        "replay",
        str(trace),
        "--url",
        cluster_up.url,
        "--model",
        "demo",
        "--api",
        "chat",
        "--tokenizer",
        str(demo_model_dir),
        "--out",
        str(out),
        "--no-plots",
    )
    assert p.returncode == 0, p.stderr
    recs = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert [r["prompt_tokens"] for r in recs] == [40 + 37 * i for i in range(6)]
    assert all(r["completion_tokens"] == 6 for r in recs)


def test_unreachable_endpoint(tmp_path: Path) -> None:
    from shared.embedded import free_port

    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,10,2\n")
    url = f"http://127.0.0.1:{free_port()}/v1"
    p = loadgen("replay", str(trace), "--url", url, "--model", "demo", "--out", str(tmp_path / "x"))
    assert p.returncode == 3 and "cannot reach" in p.stderr and url in p.stderr
