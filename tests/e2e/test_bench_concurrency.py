"""scripts/bench-concurrency end to end on a tiny budget (``python -m bench.concurrency`` in
a process of its own, as its users run it; no test imports a benchmark)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.nats, pytest.mark.redis, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def test_bench_concurrency_holds_streams_and_writes_what_it_printed(
    tmp_path: Path, nats_url: str, redis_url: str
) -> None:
    out = tmp_path / "concurrency.json"
    env = {**os.environ, "MESHSERVE_NATS_URL": nats_url, "MESHSERVE_REDIS_URL": redis_url}
    run = subprocess.run(
        [sys.executable, "-m", "bench.concurrency", "--streams", "20", "--tokens", "8",
         "--stalled", "0.1", "--ramp", "0", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["streams"], r["stalled_share"]) for r in rows] == [(20, 0.0), (20, 0.1)]
    for r in rows:
        assert r["error_count"] == 0 and r["short_streams"] == 0, r
        assert r["completed"] == r["readers"] == 20 - round(20 * r["stalled_share"])
        assert r["itl_p99_ms"] >= r["itl_p50_ms"] > 0 and r["rss_peak_mib"] > 0
        assert r["fe_delay_p99_ms"] >= r["fe_delay_p50_ms"] >= 0
    assert sum(rows[1]["stalled_outcomes"].values()) == 2
    assert "KiB/stream" in run.stdout
