"""`scripts/soak` for a minute: load with every fault on the schedule loses no accepted
request and gets no token wrong (the long run is `scripts/soak`, ten minutes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_minute_of_load_with_every_fault_loses_nothing(fault_models_dir, tmp_path):
    out = tmp_path / "soak.json"
    run = subprocess.run(
        [sys.executable, "-m", "bench.soak", "--duration", "60", "--rate", "1", "--out", str(out)],
        cwd=ROOT,
        env={**os.environ, "MESHSERVE_MODELS_DIR": str(fault_models_dir)},
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    s = result["summary"]
    assert s["sent"] >= 40 and s["lost"] == 0 and s["wrong"] == 0, (s, result["failures"])
    assert s["ok"] + s["refused"] == s["sent"]
    assert [f["fault"] for f in result["faults"]] == ["te", "je", "redis", "nats"]
    assert all(f["detail"] != "no process to kill" for f in result["faults"])
    assert {"frontend", "job_executor", "te"} <= set(result["memory"])
    assert "goal: 0 lost, 0 wrong: met" in run.stdout
