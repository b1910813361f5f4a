"""The decode-length predictor (``services/job_executor/output_length.py``) replayed on the
shipped traces: each request in arrival order is predicted from those before it, then
learned. Prints, per trace, the share of requests whose 128-token output bucket it predicted
exactly and within one bucket, against the best constant guess in hindsight (the trace's
most frequent bucket); writes bench-results/output-length.json.

    python -m bench.output_length [TRACE ...]
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path
from typing import Any

from bench.common import ROOT, write_result
from loadgen.traces import read_trace
from services.job_executor.output_length import OutputPredictor, bucket_of

TRACES = (
    ROOT / "traces" / "azure_llm_2023_conv.csv",
    ROOT / "traces" / "mooncake_conversation.jsonl",
)


def evaluate(path: Path) -> dict[str, Any]:
    reqs = read_trace(path)
    p = OutputPredictor()
    exact = near = predicted = 0
    actual = [bucket_of(r.output_tokens) for r in reqs]
    for r, b in zip(reqs, actual, strict=True):
        model = r.model or "model"
        guess = p.predict_bucket(model, r.input_tokens)
        if guess is not None:
            predicted += 1
            exact += guess == b
            near += abs(guess - b) <= 1
        p.learn(model, r.input_tokens, r.output_tokens)
    mode, mode_n = collections.Counter(actual).most_common(1)[0]
    return {
        "trace": path.name,
        "requests": len(reqs),
        "predicted": predicted,
        "exact": exact / predicted if predicted else None,
        "within_one": near / predicted if predicted else None,
        "constant_bucket": mode,
        "constant_exact": mode_n / len(reqs),
        "constant_within_one": sum(abs(b - mode) <= 1 for b in actual) / len(reqs),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("traces", nargs="*", type=Path, default=list(TRACES))
    ap.add_argument("--out", type=Path, default=ROOT / "bench-results" / "output-length.json")
    args = ap.parse_args(argv)
    rows = [evaluate(t) for t in args.traces]
    print(
        f"{'trace':<32} {'requests':>8} {'exact':>7} {'±1':>7} {'const exact':>12} {'const ±1':>9}"
    )
    for r in rows:
        print(
            f"{r['trace']:<32} {r['requests']:>8} {r['exact']:>7.1%} {r['within_one']:>7.1%}"
            f" {r['constant_exact']:>12.1%} {r['constant_within_one']:>9.1%}"
        )
    write_result(args.out, {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
