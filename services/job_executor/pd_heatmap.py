"""Where PD disaggregation pays, measured (DeepServe §4.5's PD heat map): for one model on
one fleet, the SLO attainment of disaggregated serving minus that of colocated serving, over
a grid of uncached prompt lengths × output/prompt ratios × request rates per instance.
``scripts/bench-pd-heatmap`` fills it with ``meshserve-loadgen simulate`` runs of the
model's profile (the project's own policies) and writes it as JSON; ``MESHSERVE_PD_HEATMAP``
names the file, and ``auto`` then disaggregates a request where its cell says PD pays
instead of using ``MESHSERVE_PD_MIN_UNCACHED_TOKENS`` (``disaggregation.decide``). Pure
lookups; ``load`` reads the file."""

from __future__ import annotations

import bisect
import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True, slots=True)
class PdHeatmap:
    prompt_tokens: tuple[int, ...]  # ascending: the uncached prompt tokens of each row
    output_ratio: tuple[float, ...]  # ascending: output tokens over uncached prompt tokens
    rate: tuple[float, ...]  # ascending: requests/s per instance of the model
    # gain[rate][prompt][ratio]: SLO attainment disaggregated minus colocated (-1..1); where
    # they tie (within 0.01), PD's TPOT p90 improvement scaled into ±0.01 (bench.pd_heatmap)
    gain: tuple[tuple[tuple[float, ...], ...], ...]
    source: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # how it was measured

    def __post_init__(self) -> None:
        shape = (len(self.rate), len(self.prompt_tokens), len(self.output_ratio))
        if not all(shape):
            raise ValueError("a PD heat map needs at least one value on each axis")
        for axis in (self.prompt_tokens, self.output_ratio, self.rate):
            if list(axis) != sorted(set(axis)):
                raise ValueError("a PD heat map's axes must be distinct and ascending")
        if len(self.gain) != shape[0] or any(
            len(rows) != shape[1] or any(len(r) != shape[2] for r in rows) for rows in self.gain
        ):
            raise ValueError(f"a PD heat map's gain must be {shape[0]}x{shape[1]}x{shape[2]}")

    def cell(self, prompt_tokens: int, output_tokens: int, rate: float) -> float:
        """The gain of the grid cell a request falls in: on each axis the largest grid value
        not above its own (the first where it is below them all)."""
        ratio = output_tokens / max(prompt_tokens, 1)
        i = _floor_index(self.rate, rate)
        j = _floor_index(self.prompt_tokens, prompt_tokens)
        k = _floor_index(self.output_ratio, ratio)
        return self.gain[i][j][k]

    def pays(self, prompt_tokens: int, output_tokens: int, rate: float) -> bool:
        return self.cell(prompt_tokens, output_tokens, rate) > 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt_tokens": list(self.prompt_tokens),
            "output_ratio": list(self.output_ratio),
            "rate": list(self.rate),
            "gain": [[list(r) for r in rows] for rows in self.gain],
            "source": dict(self.source),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PdHeatmap:
        return cls(
            prompt_tokens=tuple(int(x) for x in d["prompt_tokens"]),
            output_ratio=tuple(float(x) for x in d["output_ratio"]),
            rate=tuple(float(x) for x in d["rate"]),
            gain=tuple(tuple(tuple(float(g) for g in r) for r in rows) for rows in d["gain"]),
            source=dict(d.get("source", {})),
        )


def _floor_index(axis: Sequence[float], value: float) -> int:
    return max(bisect.bisect_right(axis, value) - 1, 0)


def load(path: Path) -> dict[str, PdHeatmap]:
    """A heat map file: ``{"maps": {model: heat map}}``, as ``scripts/bench-pd-heatmap``
    writes it."""
    try:
        data = json.loads(path.read_text())
        return {m: PdHeatmap.from_json(d) for m, d in data["maps"].items()}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"PD heat map {path}: {e}") from e


def save(path: Path, maps: Mapping[str, PdHeatmap]) -> None:
    path.write_text(json.dumps({"maps": {m: h.to_json() for m, h in maps.items()}}, indent=1))
