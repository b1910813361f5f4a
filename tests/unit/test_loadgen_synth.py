"""Synthetic traces: Gamma arrivals, length distributions, model mixes, conversations."""

from __future__ import annotations

import itertools
import random
import statistics
from pathlib import Path

import pytest

from loadgen.synth import (
    ModelSpec,
    SynthSpec,
    gamma_arrivals,
    lognormal_int,
    parse_models,
    synthesize,
)
from loadgen.traces import read_trace, write_trace


@pytest.mark.parametrize("cv", [0.5, 1.0, 3.0])
def test_gamma_arrivals_have_the_rate_and_cv(cv: float) -> None:
    t = gamma_arrivals(rate=20.0, cv=cv, duration_s=2000.0, rng=random.Random(1))
    gaps = [b - a for a, b in itertools.pairwise(t)]
    assert len(t) / 2000.0 == pytest.approx(20.0, rel=0.1)
    assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(cv, rel=0.1)


def test_cv_zero_is_a_metronome() -> None:
    t = gamma_arrivals(rate=2.0, cv=0.0, duration_s=10.0, rng=random.Random(0))
    assert len(t) == 20 and all(b - a == pytest.approx(0.5) for a, b in itertools.pairwise(t))


def test_lognormal_lengths() -> None:
    rng = random.Random(0)
    xs = [lognormal_int(500, 1.0, rng) for _ in range(20000)]
    assert statistics.mean(xs) == pytest.approx(500, rel=0.05)
    assert statistics.pstdev(xs) / statistics.mean(xs) == pytest.approx(1.0, rel=0.1)
    assert lognormal_int(123.4, 0, rng) == 123 and min(xs) >= 1


def test_model_mix() -> None:
    assert parse_models("a:2,b:0.5:3") == [ModelSpec("a", 2.0, 1.0), ModelSpec("b", 0.5, 3.0)]
    with pytest.raises(ValueError):
        parse_models("a")
    reqs = synthesize(SynthSpec(models=parse_models("a:4,b:1:2"), duration_s=500), seed=3)
    counts = {m: sum(r.model == m for r in reqs) for m in ("a", "b")}
    assert counts["a"] == pytest.approx(2000, rel=0.1) and counts["b"] == pytest.approx(
        500, rel=0.3
    )
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    assert reqs == synthesize(SynthSpec(models=parse_models("a:4,b:1:2"), duration_s=500), seed=3)


def test_conversations_grow_a_shared_prefix() -> None:
    spec = SynthSpec(
        models=[ModelSpec("m", 0.5)],
        duration_s=400,
        turns_mean=4,
        think_time_s=5,
        input_mean=100,
        output_mean=50,
        block_size=16,
        system_prompt_tokens=64,
    )
    reqs = synthesize(spec, seed=7)
    sessions: dict[str, list] = {}
    for r in reqs:
        sessions.setdefault(r.session_id, []).append(r)
    multi = [s for s in sessions.values() if len(s) > 1]
    assert len(multi) > 10
    sys_ids = reqs[0].hash_ids[:4]  # 64 tokens / 16
    for turns in sessions.values():
        for r in turns:
            assert r.hash_ids[:4] == sys_ids  # the system prompt is every request's prefix
            assert len(r.hash_ids) == -(-r.input_tokens // 16)
        for prev, cur in itertools.pairwise(turns):
            assert cur.turn == prev.turn + 1 and cur.arrival_s > prev.arrival_s
            assert cur.input_tokens > prev.input_tokens + prev.output_tokens
            full = prev.input_tokens // 16
            assert cur.hash_ids[:full] == prev.hash_ids[:full]  # the whole previous prompt
            assert cur.hash_ids[full : full + 1] != prev.hash_ids[full : full + 1]
    # Different conversations share only the system prompt.
    firsts = [t[0] for t in sessions.values()]
    assert len({f.hash_ids[4] for f in firsts}) == len(firsts)


def test_written_trace_reads_back(tmp_path: Path) -> None:
    reqs = synthesize(SynthSpec(models=[ModelSpec(None, 2.0)], duration_s=20, turns_mean=2), seed=1)
    write_trace(tmp_path / "s.jsonl", reqs)
    back = read_trace(tmp_path / "s.jsonl")
    assert len(back) == len(reqs)
    assert [r.hash_ids for r in back] == [r.hash_ids for r in reqs]
    assert back[0].arrival_s == 0 and back[0].model is None
