"""Several runs side by side: one table, one chart of overlaid latency CDFs.

A run is a directory ``replay`` wrote (``summary.json`` and ``requests.jsonl``), against
meshserve or against any other server, so the same trace on two platforms compares
directly."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadgen.report import table
from loadgen.results import Result, read_results
from shared.slo import SLO


class RunError(ValueError):
    pass


def load_run(path: Path) -> tuple[dict[str, Any], list[Result]]:
    path = Path(path)
    summary, requests = path / "summary.json", path / "requests.jsonl"
    if not summary.is_file() or not requests.is_file():
        raise RunError(f"{path}: not a run directory (needs summary.json and requests.jsonl)")
    try:
        return json.loads(summary.read_text()), read_results(requests)
    except (ValueError, TypeError) as e:
        raise RunError(f"{path}: unreadable run: {e}") from e


def run_names(paths: Sequence[Path]) -> list[str]:
    """Each run's directory name, with its parent's where two names collide."""
    names = [Path(p).resolve().name for p in paths]
    if len(set(names)) < len(names):
        names = [f"{Path(p).resolve().parent.name}/{Path(p).resolve().name}" for p in paths]
    if len(set(names)) < len(names):
        names = [f"{n}#{i}" for i, n in enumerate(names, 1)]
    return names


def compare(paths: Sequence[Path], plot_path: Path | None) -> str:
    """The side-by-side table; the CDF chart written to ``plot_path`` if given."""
    runs = {name: load_run(p) for name, p in zip(run_names(paths), paths, strict=True)}
    text = table({name: s for name, (s, _) in runs.items()})
    if plot_path is not None:
        from loadgen.plots import plot_compare

        slos = {json.dumps(s.get("slo", {}), sort_keys=True) for s, _ in runs.values()}
        slo = None
        if len(slos) == 1:
            raw = next(iter(runs.values()))[0].get("slo") or {}
            slo = SLO(**{k: v for k, v in raw.items() if k in SLO.__dataclass_fields__})
        plot_compare({name: rs for name, (_, rs) in runs.items()}, plot_path, slo)
    return text
