"""PD's heat map and what feeds it: the cell a request falls in, ``auto`` deciding by it
instead of the uncached-token threshold (with the predicted output and the rate per
instance), the output-length predictor learning from the tasks the JE placed as they end,
and the JE's arrival-rate meter."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from services.job_executor.disaggregation import Demand, PdConfig, decide
from services.job_executor.output_length import OutputPredictor
from services.job_executor.pd_heatmap import PdHeatmap, load, save
from services.job_executor.traffic import RateMeter
from tests.unit.test_pd_decision import DECODE, P1

# Rows: 512 and 4096 prompt tokens; columns: output ratio 1/32 and 1/2; two rates. PD pays
# only for long prompts with short outputs, and at the higher rate also with long ones.
HEATMAP = PdHeatmap(
    prompt_tokens=(512, 4096),
    output_ratio=(1 / 32, 0.5),
    rate=(0.5, 2.0),
    gain=(
        ((-0.5, -0.9), (0.2, -0.1)),
        ((-0.4, -0.9), (0.3, 0.1)),
    ),
)


def test_a_request_falls_in_the_cell_below_it_on_each_axis() -> None:
    assert HEATMAP.cell(4096, 64, 0.5) == 0.2
    assert HEATMAP.cell(8000, 64, 0.1) == 0.2  # past the last row, below the first rate
    assert HEATMAP.cell(4096, 4000, 3.0) == 0.1
    assert HEATMAP.cell(100, 1, 1.0) == -0.5  # below the first row: the first
    assert HEATMAP.pays(4096, 100, 1.0) and not HEATMAP.pays(4096, 3000, 1.0)


def test_a_heat_map_round_trips_through_its_file_and_a_bad_one_is_refused(
    tmp_path: Path,
) -> None:
    path = tmp_path / "hm.json"
    save(path, {"m": HEATMAP})
    assert load(path) == {"m": HEATMAP}
    path.write_text('{"maps": {"m": {"prompt_tokens": [2, 1]}}}')
    with pytest.raises(ValueError, match=r"hm\.json"):
        load(path)
    with pytest.raises(ValueError, match="2x2x2"):
        PdHeatmap((1, 2), (0.1, 0.2), (1.0, 2.0), (((0.0, 0.0),),) * 2)


def test_auto_decides_by_the_heat_map_where_the_model_has_one() -> None:
    config = PdConfig(mode="auto", min_uncached_tokens=2048, heatmaps={"m": HEATMAP})

    def prefill_te(prompt: int, cached: int = 0, demand: Demand | None = None) -> str | None:
        return decide(
            config,
            decode=DECODE,
            prompt_tokens=prompt,
            cached_tokens=cached,
            max_tokens=4000,
            prefill_tes=[P1],
            unreported={},
            demand=demand,
        ).prefill_te

    short_out, long_out = Demand(64, 1.0), Demand(3000, 1.0)
    assert prefill_te(4096, demand=short_out) == "p1"
    assert prefill_te(4096, demand=long_out) is None  # the map says colocated
    assert prefill_te(4096, demand=Demand(3000, 2.5)) == "p1"  # busier: it pays again
    # The ratio rule still holds: a mostly cached prompt stays.
    assert prefill_te(8192, cached=4096, demand=short_out) is None
    # No demand (or a model without a map): the threshold.
    assert prefill_te(4096) == "p1" and prefill_te(1000) is None
    d = decide(
        config,
        decode=DECODE,
        prompt_tokens=4096,
        cached_tokens=0,
        max_tokens=4000,
        prefill_tes=[],
        unreported={},
        demand=long_out,
    )
    assert d.reason == "no prefill instance" and not d.wanted  # no prefill work to scale for


def test_the_predictor_learns_from_placed_tasks_as_they_end() -> None:
    p = OutputPredictor()
    for i in range(5):
        p.placed(f"r{i}", "m", 4000)
    p.ended("r0", 40)
    p.ended("r1", None)  # failed or cancelled: nothing learned
    p.ended("unknown", 900)  # never placed here: nothing learned
    assert p.predict("m", 4000, 1000) == 128
    assert p.predict("m", 4000, 100) == 100  # never past max_tokens
    small = OutputPredictor(max_pending=2)
    for i in range(3):
        small.placed(f"r{i}", "m", 10)
    small.ended("r0", 500)  # forgotten: the oldest went
    assert small.predict_bucket("m", 10) is None


def test_the_rate_meter_follows_arrivals_and_decays() -> None:
    meter = RateMeter(horizon_s=10.0)
    for i in range(200):
        meter.arrived("m", 1000.0 + i * 0.25)  # 4 requests/s for 50 s
    assert meter.rate("m", 1050.0) == pytest.approx(4.0, rel=0.05)
    assert meter.rate("m", 1060.0) == pytest.approx(4.0 * math.exp(-1), rel=0.05)
    assert meter.rate("other", 1060.0) == 0.0
