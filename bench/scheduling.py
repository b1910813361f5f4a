"""The torch engine's prefill scheduling compared on one workload, in process: whole prompts
against chunked prefill at several prefill budgets (``scheduler.py``).

Two scenarios, each replayed under every setting, settings alternating within a repetition:
- ``closed``: ``--concurrency`` requests in flight, ``--requests`` in all, each a distinct
  ``--prompt``-token prompt and ``--output`` tokens (ignore_eos); a new one joins as one ends
  (the shape of ``bench-vs-vllm``'s concurrency phase);
- ``long``: ``--concurrency - 1`` requests decode steadily and a ``--long-prompt``-token
  prompt arrives among them: how long it stalls them, and its own time to first token.

Reported per setting (medians over repetitions): TTFT p50/p90, inter-token latency p50/p99/max,
per-request decode tok/s (median over requests), aggregate output tok/s; for ``long``, the
longest gap of the decoding requests and the long prompt's TTFT.

    scripts/bench-scheduling --model models/bench-qwen2-0.5b --dtype float32
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS, ROOT, Col, Table, median, prompts_for, write_result
from loadgen.stats import percentile
from services.task_executor.engines.base import EngineRequest
from services.task_executor.engines.torch_engine import TorchEngine
from shared.messages.api import SamplingParams


@dataclasses.dataclass(frozen=True)
class Setting:
    chunked: bool
    budget: int

    @property
    def name(self) -> str:
        return f"{'chunked' if self.chunked else 'whole'}:{self.budget}"


def parse_settings(text: str) -> list[Setting]:
    out = []
    for item in text.split(","):
        mode, _, budget = item.strip().partition(":")
        if mode not in ("whole", "chunked") or not budget.isdigit():
            raise argparse.ArgumentTypeError(f"{item!r}: expected whole:N or chunked:N")
        out.append(Setting(mode == "chunked", int(budget)))
    return out


def _engine(args: argparse.Namespace, s: Setting) -> TorchEngine:
    return TorchEngine(
        args.model,
        device="cpu",
        dtype=args.dtype,
        max_prefill_tokens=s.budget,
        chunked_prefill=s.chunked,
        enable_prefix_caching=False,
        max_num_seqs=args.concurrency,
    )


def _run(
    engine: TorchEngine, arrivals: list[tuple[int, list[int], int]], concurrency: int
) -> dict[str, list[float]]:
    """Replays requests (after_done, prompt, output tokens): a request joins once ``after_done``
    earlier ones finished and fewer than ``concurrency`` run. Token times per request."""
    times: dict[str, list[float]] = {}
    sent: dict[str, float] = {}
    pending = list(enumerate(arrivals))
    done = 0
    while pending or engine.has_work():
        while pending and pending[0][1][0] <= done and len(sent) - done < concurrency:
            i, (_, prompt, out) = pending.pop(0)
            rid = f"r{i}"
            params = SamplingParams(max_tokens=out, temperature=0, ignore_eos=True)
            engine.add_request(EngineRequest(rid, prompt, params))
            sent[rid] = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        for o in outputs:
            times.setdefault(o.request_id, [sent[o.request_id]]).append(now)
            done += o.finished
    return times


def _metrics(times: dict[str, list[float]]) -> dict[str, float]:
    ttft = [t[1] - t[0] for t in times.values()]
    gaps = [b - a for t in times.values() for a, b in itertools.pairwise(t[1:])]
    decode = [(len(t) - 2) / (t[-1] - t[1]) for t in times.values() if len(t) > 2]
    start = min(t[0] for t in times.values())
    end = max(t[-1] for t in times.values())
    tokens = sum(len(t) - 1 for t in times.values())
    return {
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "itl_p50_s": percentile(gaps, 50),
        "itl_p99_s": percentile(gaps, 99),
        "itl_max_s": max(gaps),
        "decode_tok_s": median(decode),
        "aggregate_tok_s": tokens / (end - start),
    }


def closed(args: argparse.Namespace, s: Setting) -> dict[str, float]:
    engine = _engine(args, s)
    prompts = prompts_for(args.requests, args.prompt, engine.config.vocab_size, seed=1)
    try:
        return _metrics(_run(engine, [(0, p, args.output) for p in prompts], args.concurrency))
    finally:
        engine.close()


def long(args: argparse.Namespace, s: Setting) -> dict[str, float]:
    """The decoding requests start together; the long prompt joins once they all decode."""
    engine = _engine(args, s)
    n = args.concurrency - 1
    vocab = engine.config.vocab_size
    short = prompts_for(n, 64, vocab, seed=2)
    (big,) = prompts_for(1, args.long_prompt, vocab, seed=3)
    try:
        times: dict[str, list[float]] = {}
        for i, p in enumerate(short):
            engine.add_request(
                EngineRequest(
                    f"d{i}",
                    p,
                    SamplingParams(max_tokens=args.output * 4, temperature=0, ignore_eos=True),
                )
            )
        while len(times) < n or any(len(t) < 4 for t in times.values()):
            for o in engine.step():
                times.setdefault(o.request_id, []).append(time.perf_counter())
        sent = time.perf_counter()
        engine.add_request(
            EngineRequest("long", big, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        )
        first = None
        stall = 0.0
        last = {rid: t[-1] for rid, t in times.items()}
        while first is None:
            outputs = engine.step()
            now = time.perf_counter()
            for o in outputs:
                if o.request_id == "long":
                    first = now
                elif o.request_id in last:
                    stall = max(stall, now - last[o.request_id])
                    last[o.request_id] = now
        return {"long_ttft_s": first - sent, "decode_stall_max_s": stall}
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="scripts/bench-scheduling",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--model", type=Path, default=ROOT / "models" / "bench-qwen2-0.5b")
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--settings",
        type=parse_settings,
        default=parse_settings("whole:2048,chunked:2048,chunked:512,chunked:256"),
    )
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--long-prompt", type=int, default=2048)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--scenarios", default="closed,long")
    p.add_argument("--out", type=Path, default=RESULTS / "scheduling.json")
    args = p.parse_args(argv)
    scenarios = {"closed": closed, "long": long}
    chosen = [x.strip() for x in args.scenarios.split(",")]
    runs: dict[str, dict[str, list[dict[str, float]]]] = {}
    for rep in range(args.reps):
        for scen in chosen:
            for s in args.settings if rep % 2 == 0 else args.settings[::-1]:
                m = scenarios[scen](args, s)
                runs.setdefault(scen, {}).setdefault(s.name, []).append(m)
                print(
                    f"rep {rep} {scen} {s.name}: "
                    + ", ".join(f"{k}={v:.3g}" for k, v in m.items()),
                    flush=True,
                )
    table: dict[str, dict[str, dict[str, float]]] = {
        scen: {
            name: {k: median([r[k] for r in reps]) for k in reps[0]} for name, reps in by.items()
        }
        for scen, by in runs.items()
    }
    for scen, by in table.items():
        keys = list(next(iter(by.values())))
        cols = [Col("setting", "setting", left=True, width=14)]
        cols += [Col(k, k, ".3f", width=max(12, len(k))) for k in keys]
        Table(cols).print(
            [{"setting": name, **row} for name, row in by.items()],
            title=f"{scen} (medians of {args.reps})",
        )
    out: dict[str, Any] = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "medians": table,
        "runs": runs,
    }
    write_result(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
