"""From per-request results to ``summary.json`` and to time series for the plots. Pure."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from loadgen.results import Result
from loadgen.stats import percentile
from shared.slo import SLO, attainment, goodput_rps

PERCENTILES = (50, 90, 99)


def _ms(values: Sequence[float]) -> dict[str, float | None]:
    """p50/p90/p99 and mean in milliseconds; ``None`` where there are no values (JSON has
    no NaN)."""
    out: dict[str, float | None] = {
        f"p{p}": round(percentile(values, p) * 1000, 2) if values else None for p in PERCENTILES
    }
    out["mean"] = round(sum(values) / len(values) * 1000, 2) if values else None
    return out


def run_span_s(results: Sequence[Result]) -> float:
    """From the first send to the last response: the denominator of every rate."""
    if not results:
        return 0.0
    start = min(r.sent_s for r in results)
    end = max(r.sent_s + (r.e2e_s or 0.0) for r in results)
    return max(end - start, 0.0)


def slo_met(results: Sequence[Result], slo: SLO) -> list[bool]:
    return [
        slo.met(ok=r.ok, input_tokens=r.slo_input_tokens, ttft_s=r.ttft_s, tpot_s=r.tpot_s)
        for r in results
    ]


def metrics(results: Sequence[Result], slo: SLO, duration_s: float) -> dict[str, Any]:
    """The numbers of one group of requests over a run of ``duration_s`` seconds."""
    ok = [r for r in results if r.ok]
    met = slo_met(results, slo)
    out_tok = sum(r.completion_tokens for r in ok)
    in_tok = sum(r.prompt_tokens or r.input_tokens for r in ok)
    att = attainment(met)
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "ttft_ms": _ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": _ms([t for r in ok if (t := r.tpot_s) is not None]),
        "e2e_ms": _ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        "itl_ms": _ms([g for r in ok for g in r.gaps_s]),
        "slo_attainment": round(att, 4) if att is not None else None,
        "slo_met": sum(met),
        "throughput_tok_s": round(out_tok / duration_s, 2) if duration_s > 0 else 0.0,
        "input_throughput_tok_s": round(in_tok / duration_s, 2) if duration_s > 0 else 0.0,
        "request_rate_rps": round(len(ok) / duration_s, 3) if duration_s > 0 else 0.0,
        "goodput_rps": round(goodput_rps(met, duration_s), 3),
        "input_tokens": in_tok,
        "output_tokens": out_tok,
        "cached_tokens": sum(r.cached_tokens for r in ok),
    }


def summarize(results: Sequence[Result], slo: SLO, *, exact_prompts: bool = True) -> dict[str, Any]:
    """Overall and per-model metrics, plus what a reader needs to trust them: how many
    prompts were clipped, whether the server counted the tokens we meant to send, how late
    the open-loop sender was, the first distinct errors."""
    duration = run_span_s(results)
    out = metrics(results, slo, duration)
    ok = [r for r in results if r.ok]
    lags = [r.lag_s for r in results]
    out.update(
        {
            "duration_s": round(duration, 3),
            "slo": {**slo.to_json(), "text": slo.describe()},
            "clipped_prompts": sum(r.clipped_prompt for r in results),
            "clipped_outputs": sum(r.clipped_output for r in results),
            "prompt_tokens_exact": exact_prompts,
            "prompt_token_mismatches": sum(
                1 for r in ok if r.prompt_tokens and r.prompt_tokens != r.input_tokens
            )
            if exact_prompts
            else None,
            "output_token_mismatches": sum(1 for r in ok if r.completion_tokens != r.output_tokens),
            "send_lag_ms": {
                "p50": round(percentile(lags, 50) * 1000, 2) if lags else None,
                "p99": round(percentile(lags, 99) * 1000, 2) if lags else None,
                "max": round(max(lags) * 1000, 2) if lags else None,
            },
            "errors": sorted({r.error for r in results if r.error})[:5],
        }
    )
    models = sorted({r.model for r in results})
    out["per_model"] = {
        m: metrics([r for r in results if r.model == m], slo, duration) for m in models
    }
    # A mix mapped onto fewer served models (--models-map a=demo,b=demo) is still reported
    # per function of the trace.
    # PD: the requests the server disaggregated and those it ran whole, apart.
    if any(r.disaggregated is not None for r in results):
        out["pd"] = {
            name: metrics([r for r in results if r.disaggregated is flag], slo, duration)
            for name, flag in (("disaggregated", True), ("colocated", False))
        }
    trace_models = sorted({r.trace_model for r in results if r.trace_model is not None})
    if trace_models and trace_models != models:
        out["per_trace_model"] = {
            m: metrics([r for r in results if r.trace_model == m], slo, duration)
            for m in trace_models
        }
    return out


def timeline(
    results: Sequence[Result], slo: SLO, bins: int | None = None
) -> dict[str, list[float | None]]:
    """Time series for the plots, ``None`` where a bin has no data.

    By send time, over the span of sends (``send_t_s``, ``send_width_s``): requests sent per
    second, TTFT and E2E p50/p90 in seconds, SLO attainment. By token arrival, over the
    whole run (``t_s``, ``width_s``): output tokens per second. By default about ten
    requests a bin, 5 to 60 bins."""
    if not results:
        return {"t_s": [], "send_t_s": []}
    bins = bins or max(5, min(60, len(results) // 10))
    end = max(max(r.sent_s + (r.e2e_s or 0.0) for r in results), 1e-9)
    send_end = max(max(r.sent_s for r in results), 1e-9)
    width, send_width = end / bins, send_end / bins

    def idx(x: float, w: float) -> int:
        return min(bins - 1, max(0, int(x / w)))

    groups: list[list[Result]] = [[] for _ in range(bins)]
    met_by: list[list[bool]] = [[] for _ in range(bins)]
    tokens = [0] * bins
    for r, m in zip(results, slo_met(results, slo), strict=True):
        groups[idx(r.sent_s, send_width)].append(r)
        met_by[idx(r.sent_s, send_width)].append(m)
        for tt in r.token_times_s():
            tokens[idx(tt, width)] += 1

    def pct(rs: list[Result], attr: str, p: float) -> float | None:
        xs = [v for r in rs if r.ok and (v := getattr(r, attr)) is not None]
        return percentile(xs, p) if xs else None

    return {
        "t_s": [(i + 0.5) * width for i in range(bins)],
        "width_s": [width] * bins,
        "output_tok_s": [n / width for n in tokens],
        "send_t_s": [(i + 0.5) * send_width for i in range(bins)],
        "send_width_s": [send_width] * bins,
        "sent_rps": [len(g) / send_width for g in groups],
        "ttft_p50_s": [pct(g, "ttft_s", 50) for g in groups],
        "ttft_p90_s": [pct(g, "ttft_s", 90) for g in groups],
        "e2e_p50_s": [pct(g, "e2e_s", 50) for g in groups],
        "e2e_p90_s": [pct(g, "e2e_s", 90) for g in groups],
        "slo_attainment": [attainment(m) for m in met_by],
    }


def cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    """Sorted values and their empirical cumulative fractions (for step plots)."""
    xs = sorted(v for v in values if v is not None and not math.isnan(v))
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


def table(rows: dict[str, dict[str, Any]]) -> str:
    """Runs side by side: one column per run, one line per metric (plain text)."""
    lines: list[tuple[str, list[str]]] = []

    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
        return str(v)

    names = list(rows)
    keys: list[tuple[str, tuple[str, ...]]] = [("requests", ("requests",)), ("failed", ("failed",))]
    for metric in ("ttft_ms", "tpot_ms", "e2e_ms"):
        for p in PERCENTILES:
            keys.append((f"{metric[:-3]} p{p} (ms)", (metric, f"p{p}")))
    keys += [
        ("SLO attainment", ("slo_attainment",)),
        ("throughput (tok/s)", ("throughput_tok_s",)),
        ("goodput (req/s)", ("goodput_rps",)),
        ("duration (s)", ("duration_s",)),
    ]
    for label, path in keys:
        vals = []
        for n in names:
            v: Any = rows[n]
            for k in path:
                v = v.get(k) if isinstance(v, dict) else None
            vals.append(fmt(v))
        lines.append((label, vals))
    w0 = max(len(label) for label, _ in lines)
    widths = [max(len(n), *(len(v[i]) for _, v in lines)) for i, n in enumerate(names)]
    out = [" " * w0 + "  " + "  ".join(n.rjust(w) for n, w in zip(names, widths, strict=True))]
    for label, vals in lines:
        out.append(
            label.ljust(w0)
            + "  "
            + "  ".join(v.rjust(w) for v, w in zip(vals, widths, strict=True))
        )
    return "\n".join(out)
