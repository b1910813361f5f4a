"""The performance model's grids (``shared/perf_model.py``): linear prefill interpolation,
bilinear decode interpolation, the scaler's figures read off it; and the measurement's
cleanup of noisy grids (``services/task_executor/perf_profile.py``)."""

from __future__ import annotations

import msgspec
import pytest

from services.task_executor.perf_profile import carry_on, nondecreasing
from shared.perf_model import PerfModel, fit_prefill, powers_of_two


def _bilinear(b: float, c: float) -> float:
    return 0.01 + 0.002 * b + 0.00001 * c + 0.000001 * b * c


def _model(**kw: object) -> PerfModel:
    batches, contexts = [1, 2, 4, 8], [16, 64, 256]
    values = {
        "prefill_lengths": [16, 32, 64, 128],
        "prefill_s": [0.016, 0.032, 0.064, 0.128],  # 1 ms a token
        "decode_batches": batches,
        "decode_contexts": contexts,
        "decode_s": [[_bilinear(b, c) for c in contexts] for b in batches],
        "max_num_seqs": 8,
    }
    return PerfModel(**(values | kw))  # type: ignore[arg-type]


def test_powers_of_two_reach_the_limit():
    assert powers_of_two(16, 128) == [16, 32, 64, 128]
    assert powers_of_two(16, 100) == [16, 32, 64, 100]
    assert powers_of_two(1, 1) == [1]


def test_prefill_interpolates_linearly_and_clamps_below():
    m = _model(prefill_s=[0.02, 0.03, 0.07, 0.10])
    assert m.prefill_time_s(32) == pytest.approx(0.03)
    assert m.prefill_time_s(48) == pytest.approx(0.05)  # halfway from 32 to 64
    assert m.prefill_time_s(4) == pytest.approx(0.02)  # a short prompt still reads the weights
    assert m.prefill_time_s(256) == pytest.approx(0.10 + 0.03 / 64 * 128)  # last slope on
    assert m.prefill_time_s(0) == 0.0


def test_decode_is_bilinear_between_grid_points():
    m = _model()
    for b, c in ((3, 40), (5, 200), (8, 16), (1, 64), (6, 100)):
        assert m.decode_step_s(b, c) == pytest.approx(_bilinear(b, c))
    assert m.decode_step_s(0, 100) == 0.0
    # Past the grid: the edge segments carried on (exact for a bilinear cost).
    assert m.decode_step_s(16, 512) == pytest.approx(_bilinear(16, 512))


def test_an_iteration_reads_the_weights_once():
    m = _model()
    alone = m.prefill_time_s(64)
    assert m.iteration_s(0, 0, 64) == pytest.approx(alone)
    assert m.iteration_s(4, 64, 0) == pytest.approx(m.decode_step_s(4, 64))
    both = m.iteration_s(4, 64, 64)
    assert both == pytest.approx(alone + m.decode_step_s(4, 64) - m.decode_step_s(1, 16))
    assert alone < both < alone + m.decode_step_s(4, 64)


def test_the_scalers_figures_are_read_off_the_grid():
    m = _model()
    cap = m.capacity()
    assert cap.prefill_s == pytest.approx(0.001) and cap.prefill_attention_s == pytest.approx(0)
    assert cap.decode_step_s == pytest.approx(_bilinear(8, 128))
    assert cap.decode_s == pytest.approx(_bilinear(8, 128) / 8)
    grow = (_bilinear(8, 256) - _bilinear(8, 128)) / (8 * 128)
    assert cap.decode_context_s == pytest.approx(grow)
    assert cap.max_num_seqs == 8


def test_a_model_round_trips_and_rejects_a_bad_grid():
    m = _model()
    assert msgspec.json.decode(msgspec.json.encode(m), type=PerfModel) == m
    with pytest.raises(ValueError):
        _model(prefill_lengths=[32, 16, 64, 128])
    with pytest.raises(ValueError):
        _model(decode_s=[[0.1, 0.2, 0.3]] * 3)


def test_fit_prefill_recovers_a_quadratic():
    lengths = [16, 64, 256, 1024]
    a, b = fit_prefill(lengths, [2e-4 * n + 3e-8 * n * n for n in lengths])
    assert a == pytest.approx(2e-4) and b == pytest.approx(3e-8)


def test_noise_that_breaks_monotonicity_is_averaged_out():
    assert nondecreasing([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert nondecreasing([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    # One outlier low in the middle does not drag its neighbours; one high early is pooled
    # rather than lifting every later point to it.
    assert nondecreasing([5.0, 1.0, 2.0, 6.0]) == pytest.approx([8 / 3] * 3 + [6.0])


def test_unmeasured_points_carry_the_attention_cost_on():
    contexts = [16, 32, 64]
    raw: list[list[float | None]] = [[1.0, 1.5, 2.5], [2.0, 3.0, None], [4.0, None, None]]
    rows, guessed = carry_on([1, 2, 4], contexts, raw)
    assert rows[1] == [2.0, 3.0, 3.0 + (1.0 / 16) * 32]  # its own slope
    # One point: batch 1's last slope (1/32 a token) per sequence, times 4 sequences.
    assert rows[2] == pytest.approx([4.0, 4.0 + 4 / 32 * 16, 4.0 + 4 / 32 * 48])
    assert guessed == [[False] * 3, [False, False, True], [False, True, True]]
    with pytest.raises(RuntimeError):
        carry_on([1], contexts, [[None, None, None]])
