"""``scripts/bench-vs-vllm --trace FILE``: a window of a real trace replayed through
``meshserve-loadgen replay`` against each server, at each load, the same requests for all.

Per load (``--loads light=0.08,moderate=0.3``: requests per second), the trace is thinned to
that mean rate (``--rate-scale`` = rate ÷ the trace's own mean rate, the same seed for every
server, so the same requests survive) and cut to its first ``--window`` seconds. Prompts go
as token ids (``--prompt-format ids``, the bench model's tokenizer), clipped to
``--max-context`` for every server, outputs forced to the trace's lengths (``ignore_eos``).

A row compares only like with like: a server's row is printed beside vLLM's only when their
prompt-token and output-token totals agree (a failed request, a clipped prompt or an early
stop would make them differ); otherwise the row says so and no ratio is given.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import ROOT, Col, Table

DEFAULT_LOADS = "light=0.08,moderate=0.3"
SUMMARY_KEYS = ("requests", "failed", "input_tokens", "output_tokens", "slo_attainment")


def parse_loads(text: str) -> dict[str, float]:
    """``name=rate,...`` -> {name: requests/s}."""
    out: dict[str, float] = {}
    for part in text.split(","):
        name, _, rate = part.partition("=")
        if not name.strip() or not rate:
            raise ValueError(f"--loads takes name=rate pairs, not {part!r}")
        out[name.strip()] = float(rate)
    return out


def trace_rate(trace: Path) -> float:
    """The trace's mean arrival rate (requests/s over its span)."""
    from loadgen.traces import read_trace

    reqs = read_trace(trace)
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    if len(reqs) < 2 or span <= 0:
        raise ValueError(f"{trace}: too few requests to have a rate")
    return (len(reqs) - 1) / span


def replay_loads(
    url: str,
    model: str,
    tokenizer: Path,
    trace: Path,
    loads: dict[str, float],
    *,
    window_s: float,
    max_context: int,
    out_dir: Path,
    seed: int = 0,
    prompt_scale: float = 1.0,
    replays: int = 1,
) -> dict[str, Any]:
    """Each load replayed against ``url`` in turn (``replays`` times in a row: ``light``,
    ``light#2``, ...; the same arrivals and lengths, prompts of other tokens, so that a later
    replay finds none of its prompts in the prefix cache: the second of the same tokens ran at
    a tenth of the first's TTFT, both servers); per replay, loadgen's summary."""
    rate = trace_rate(trace)
    results: dict[str, Any] = {}
    runs = [
        (n if r == 0 else f"{n}#{r + 1}", t, seed + r)
        for n, t in loads.items()
        for r in range(replays)
    ]
    for name, target, run_seed in runs:
        scale = target / rate
        run_dir = out_dir / name
        argv = [sys.executable, "-m", "loadgen.cli", "replay", str(trace), "--url", url]
        argv += ["--model", model, "--tokenizer", str(tokenizer), "--prompt-format", "ids"]
        argv += ["--max-context", str(max_context), "--rate-scale", f"{scale:.6g}"]
        argv += ["--prompt-scale", f"{prompt_scale:g}"]
        argv += ["--duration", str(window_s), "--seed", str(seed), "--no-plots", "--quiet"]
        argv += ["--prompt-seed", str(run_seed)]
        argv += ["--out", str(run_dir)]
        out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(
                f"replay at {name} failed (rc {out.returncode}): {out.stderr[-2000:]}"
            )
        summary = json.loads((run_dir / "summary.json").read_text())
        results[name] = {"rate_rps": target, "rate_scale": scale, "summary": summary}
    return results


def _row(server: str, load: str, s: dict[str, Any]) -> dict[str, Any]:
    att = s.get("slo_attainment")
    return {
        "load": load,
        "server": server,
        "requests": s["requests"],
        "failed": s["failed"],
        "prompt_tok": s["input_tokens"],
        "output_tok": s["output_tokens"],
        "ttft_p50": s["ttft_ms"].get("p50"),
        "ttft_p90": s["ttft_ms"].get("p90"),
        "tpot_p50": s["tpot_ms"].get("p50"),
        "tpot_p90": s["tpot_ms"].get("p90"),
        "slo_pct": None if att is None else 100 * att,
        "goodput": s["goodput_rps"],
    }


def compare(results: dict[str, dict[str, Any]], reference: str = "vllm") -> list[dict[str, Any]]:
    """One row per server and load (``results``: server -> {"loads": replay_loads' result});
    ratios to ``reference`` (TTFT, TPOT: server ÷ reference, lower is better; goodput: server
    ÷ reference, higher is better) where the token totals agree, and ``same_tokens`` saying
    whether they do."""
    by_server = {server: r.get("loads", {}) for server, r in results.items()}
    rate = {load: r["rate_rps"] for loads in by_server.values() for load, r in loads.items()}
    rows = []
    for load in sorted(rate, key=rate.__getitem__):
        ref = by_server.get(reference, {}).get(load)
        ref_row = _row(reference, load, ref["summary"]) if ref else None
        for server, loads in by_server.items():
            if load not in loads:
                continue
            row = _row(server, load, loads[load]["summary"])
            same = ref_row is not None and (row["prompt_tok"], row["output_tok"]) == (
                ref_row["prompt_tok"],
                ref_row["output_tok"],
            )
            row["same_tokens"] = same
            if same and server != reference and ref_row is not None:
                for key in ("ttft_p50", "ttft_p90", "tpot_p50", "goodput"):
                    a, b = row[key], ref_row[key]
                    row[f"{key}_x"] = a / b if a is not None and b else None
            rows.append(row)
    return rows


TABLE = Table(
    [
        Col("load", "load", left=True, width=9),
        Col("server", "server", left=True, width=19),
        Col("requests", "reqs"),
        Col("failed", "failed"),
        Col("prompt_tok", "prompt tok", width=10),
        Col("output_tok", "output tok", width=10),
        Col("ttft_p50", "TTFT p50 ms", ".0f", 11),
        Col("ttft_p90", "TTFT p90 ms", ".0f", 11),
        Col("tpot_p50", "TPOT p50 ms", ".0f", 11),
        Col("tpot_p90", "TPOT p90 ms", ".0f", 11),
        Col("slo_pct", "SLO %", ".1f"),
        Col("goodput", "goodput/s", ".3f", 9),
        Col("ttft_p50_x", "TTFT50 x", ".2f", 8),
        Col("ttft_p90_x", "TTFT90 x", ".2f", 8),
        Col("tpot_p50_x", "TPOT50 x", ".2f", 8),
        Col("goodput_x", "goodput x", ".2f", 9),
        Col(lambda r: "yes" if r.get("same_tokens") else "NO", "same tok", width=8),
    ]
)


def print_table(rows: Sequence[dict[str, Any]]) -> None:
    TABLE.print(rows, title="trace replay (x: ratio to vLLM on the same tokens)")
    if any(not r["same_tokens"] for r in rows if r["server"] != "vllm"):
        print("rows marked NO processed other token totals than vLLM: no ratio is given")
