"""PNG plots of a run and of several runs side by side (matplotlib, Agg: no display)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from loadgen.report import cdf, timeline
from loadgen.results import Result
from shared.slo import SLO

_METRICS = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E latency"))


def _values(results: Sequence[Result], attr: str) -> list[float]:
    return [v for r in results if r.ok and (v := getattr(r, attr)) is not None]


def _cdf_axes(axes, groups: Mapping[str, Sequence[Result]], slo: SLO | None) -> None:
    for ax, (attr, title) in zip(axes, _METRICS, strict=True):
        for label, rs in groups.items():
            xs, ys = cdf(_values(rs, attr))
            if xs:
                ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})")
        limit = None if slo is None else {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}.get(attr)
        every = [v for rs in groups.values() for v in _values(rs, attr)]
        hi = max(every, default=0.0)
        lo = min((v for v in every if v > 0), default=0.0)
        if lo > 0 and hi / lo > 100:  # runs far apart: a linear axis would flatten the fast one
            ax.set_xscale("log")
        if limit is not None and limit <= 1.5 * hi:  # a far-off line would squash the curves
            ax.axvline(limit, color="grey", ls="--", lw=1, label=f"SLO {limit:g} s")
        ax.set_xlabel(f"{title} (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")


def _nan(values: Sequence[float | None]) -> list[float]:
    """A series for matplotlib: a bin without data is a gap (NaN)."""
    return [float("nan") if v is None else v for v in values]


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_run(results: Sequence[Result], slo: SLO, out_dir: Path, title: str = "") -> list[Path]:
    """latency_cdf.png, latency_over_time.png, throughput_over_time.png and
    slo_over_time.png in ``out_dir``; per-model curves where the run has several models."""
    out_dir = Path(out_dir)
    models = sorted({r.model for r in results})
    groups: dict[str, Sequence[Result]] = {"all": results}
    if len(models) > 1:
        groups.update({m: [r for r in results if r.model == m] for m in models})
    paths = []

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    _cdf_axes(axes, groups, slo)
    fig.suptitle(f"Latency CDFs {title}".strip())
    paths.append(_save(fig, out_dir / "latency_cdf.png"))

    tl = timeline(results, slo)
    t, ts = tl["t_s"], tl["send_t_s"]

    fig, ax = plt.subplots(figsize=(9, 3.8))
    ok = [r for r in results if r.ok]
    for attr, label in (("ttft_s", "TTFT"), ("e2e_s", "E2E")):
        sent = [(r.sent_s, v) for r in ok if (v := getattr(r, attr)) is not None]
        ax.scatter([x for x, _ in sent], [y for _, y in sent], s=6, alpha=0.4, label=label)
    for key, label in (("ttft_p90_s", "TTFT p90"), ("e2e_p90_s", "E2E p90")):
        pts = [(x, y) for x, y in zip(ts, tl[key], strict=True) if y is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), lw=1.5, label=label)
    failed = [r.sent_s for r in results if not r.ok]
    if failed:
        ax.scatter(failed, [0] * len(failed), marker="x", color="red", label="failed")
    ax.set_xlabel("send time (s from start)")
    ax.set_ylabel("latency (s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"Latency over time {title}".strip())
    paths.append(_save(fig, out_dir / "latency_over_time.png"))

    fig, ax = plt.subplots(figsize=(9, 3.8))
    ax.plot(_nan(t), _nan(tl["output_tok_s"]), drawstyle="steps-mid", label="output tokens/s")
    ax.set_xlabel("time (s from start)")
    ax.set_ylabel("output tokens/s")
    ax2 = ax.twinx()
    ax2.plot(
        _nan(ts),
        _nan(tl["sent_rps"]),
        drawstyle="steps-mid",
        color="tab:orange",
        alpha=0.7,
        label="requests sent/s",
    )
    ax2.set_ylabel("requests sent/s")
    ax.grid(alpha=0.3)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="upper left")
    ax.set_title(f"Throughput over time {title}".strip())
    paths.append(_save(fig, out_dir / "throughput_over_time.png"))

    fig, ax = plt.subplots(figsize=(9, 3.8))
    pts = [(x, y) for x, y in zip(ts, tl["slo_attainment"], strict=True) if y is not None]
    if pts:
        ax.plot(*zip(*pts, strict=True), marker="o", ms=3)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("send time (s from start)")
    ax.set_ylabel("SLO attainment")
    ax.grid(alpha=0.3)
    ax.set_title(f"SLO attainment over time: {slo.describe()}", fontsize=10)
    paths.append(_save(fig, out_dir / "slo_over_time.png"))
    return paths


def plot_compare(runs: Mapping[str, Sequence[Result]], path: Path, slo: SLO | None = None) -> Path:
    """The runs' TTFT, TPOT and E2E CDFs overlaid on one figure."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    _cdf_axes(axes, runs, slo)
    fig.suptitle("Latency CDFs: " + " vs ".join(runs))
    return _save(fig, Path(path))


def plot_fleet(rows: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """``fleet.jsonl``'s rows (``loadgen.fleet``): each model's mean instances and what the
    scaler wanted per bucket, and the requests that missed the SLO (by arrival) beside
    them; one panel per model, at most 8 (the busiest)."""
    by_model: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        by_model.setdefault(r["model"], []).append(r)
    busiest = sorted(by_model, key=lambda m: -sum(r["instance_s"] for r in by_model[m]))[:8]
    fig, axes = plt.subplots(len(busiest), 1, figsize=(9, 2.6 * len(busiest)), squeeze=False)
    for ax, model in zip(axes[:, 0], busiest, strict=True):
        mine = by_model[model]
        t = [r["t_s"] for r in mine]
        ax.step(t, [r["instances"] for r in mine], where="post", label="instances (mean)")
        ax.step(t, [r["max_instances"] for r in mine], where="post", alpha=0.5, label="most")
        ax.step(t, [r["wanted"] for r in mine], where="post", ls="--", label="wanted (mean)")
        ax.set_ylabel("instances")
        ax.grid(alpha=0.3)
        ax2 = ax.twinx()
        width = (t[1] - t[0]) if len(t) > 1 else 1.0
        ax2.bar(t, [r["missed"] for r in mine], width=width, align="edge", color="tab:red",
                alpha=0.25, label="missed SLO")  # fmt: skip
        ax2.set_ylabel("requests missed")
        lines = ax.get_legend_handles_labels()
        lines2 = ax2.get_legend_handles_labels()
        ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=7, loc="upper right")
        ax.set_title(f"Fleet over time: {model}", fontsize=10)
    axes[-1, 0].set_xlabel("time (s from start)")
    return _save(fig, path)
