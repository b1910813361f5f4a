"""The simulator's host weight caches: loads by where their weights come from, eviction by
the real cost, pre-loads by the real decision, and what the cache does to cold starts."""

from __future__ import annotations

import json

import pytest

from loadgen.costmodel import CACHED_LOAD_FRACTION, EngineProfile
from loadgen.plan import plan
from loadgen.simulator import SimConfig, Simulation, simulate
from loadgen.synth import ModelSpec, SynthSpec, synthesize
from loadgen.weight_cache_sim import HostCacheModel
from services.task_executor.weight_cache.eviction import EvictionConfig
from shared.messages.cluster import CachedWeights, TEState
from tests.unit.test_loadgen_simulator import NO_NET, profile, trace

GB = 1 << 30


def cached_profile(model: str = "m", **kw) -> EngineProfile:
    """2 s from disk, 0.5 s mapped from the cache, 1 GiB of weights."""
    return profile(model, **{"load_cached_s": 0.5, "weight_bytes": GB, **kw})


def sim(planned, profiles, **cfg) -> Simulation:
    s = Simulation(planned, profiles, SimConfig(**{**NO_NET, **cfg}))
    s.run()
    return s


def test_profiles_without_the_new_fields_estimate_them() -> None:
    p = profile(load_s=2.0)
    assert p.weight_bytes == 0 and p.load_cached_s is None
    assert p.weight_size() == 2_000_000_000  # what load_s reads at 1 GB/s
    assert p.cached_load_s() == pytest.approx(2.0 * CACHED_LOAD_FRACTION)
    saved = p.to_json()
    del saved["weight_bytes"], saved["load_cached_s"]  # a profile written before them
    assert EngineProfile.from_json(saved) == p
    q = cached_profile()
    assert EngineProfile.from_json(q.to_json()) == q
    assert (q.weight_size(), q.cached_load_s()) == (GB, 0.5)


def test_a_model_at_zero_comes_back_from_its_pools_cache() -> None:
    planned = plan(trace((0.0, 10, 2), (100.0, 10, 2)), model="m")
    prof = {"m": cached_profile()}
    # One TE: no pre-load (a pool keeps an idle TE for loads). Keep-alive 30 s: the model
    # scales to zero in between and its second request loads it again.
    results, stats = simulate(planned, prof, SimConfig(devices=1, keep_alive_s=30.0, **NO_NET))
    first, again = results
    # Load, then a prefill-only iteration (at least a decode step's weight pass: 0.02 s).
    assert first.ttft_s == pytest.approx(2.0 + 0.02)
    assert again.ttft_s == pytest.approx(0.5 + 0.02)  # mapped from the pool's cache
    assert stats.loads_by_source == {"disk": 1, "cache": 1}
    assert stats.weight_cache_hit_rate == 0.5
    assert stats.cold_requests == 2  # both found the model at zero
    assert stats.cold_ttft_s["p50"] == pytest.approx((2.02 + 0.52) / 2)
    # The cache off: every load reads the checkpoint.
    off = SimConfig(devices=1, keep_alive_s=30.0, host_cache_bytes=0, **NO_NET)
    results, stats = simulate(planned, prof, off)
    assert [r.ttft_s for r in results] == pytest.approx([2.02, 2.02])
    assert stats.loads_by_source == {"disk": 2} and stats.weight_cache_hit_rate == 0.0
    # Instant loads (λScale's ideal) ignore the cache.
    ideal = SimConfig(devices=1, keep_alive_s=30.0, instant_loads=True, **NO_NET)
    results, stats = simulate(planned, prof, ideal)
    assert [r.ttft_s for r in results] == pytest.approx([0.02, 0.02])
    assert stats.loads_by_source == {"instant": 2}


def test_a_ready_te_reports_its_pools_cache_as_a_heartbeat_does() -> None:
    planned = plan(trace((0.0, 10, 2)), model="m")
    s = sim(planned, {"m": cached_profile()}, devices=2, pool_size=2, host_cache_bytes=3 * GB)
    for te in s.tes:  # both TEs of the pool: the host's cache, whoever loaded through it
        v = te.view(s.now)
        assert v.cached_weights == {"m": CachedWeights(resident_bytes=GB, total_bytes=GB)}
        assert v.cache_free_bytes == 2 * GB and v.weight_server


def test_eviction_takes_the_cheapest_entry_by_the_real_cost_never_one_in_use() -> None:
    cache = HostCacheModel(2 * GB, EvictionConfig())
    for t in (0.0, 1.0, 2.0, 3.0):  # hot: four loads
        assert cache.store("hot", GB, t, in_use=()).cached
        cache.record("hot", t)
    assert cache.store("rare", GB, 50.0, in_use=()).cached  # rare: one load, used last
    cache.record("rare", 50.0)
    # Full. Least recently used would take hot; the cost (p_miss × size / B) takes rare.
    stored = cache.store("new", GB, 60.0, in_use=())
    assert stored == (stored.__class__(True, ("rare",), GB))
    cache.record("new", 60.0)
    assert "hot" in cache and "rare" not in cache and cache.used_bytes() == 2 * GB
    # Evicted, its size is still reported (S, for t_load), none of it resident.
    assert cache.residencies()["rare"] == CachedWeights(resident_bytes=0, total_bytes=GB)
    # Everything in use: nothing evicted, the new model stays uncached; too large: likewise.
    assert not cache.store("x", GB, 70.0, in_use=("hot", "new")).cached
    assert not cache.store("huge", 3 * GB, 70.0, in_use=()).cached
    assert {"hot", "new"} <= set(cache.residencies()) and cache.used_bytes() == 2 * GB
    # A model in use is kept even when it is the cheapest.
    stored = cache.store("y", GB, 80.0, in_use=("new",))
    assert stored.evicted == ("hot",) and "new" in cache


def test_the_simulated_cache_keeps_the_hot_model_and_never_evicts_one_in_use() -> None:
    """One TE, a cache for two models. hot comes and goes (keep-alive 10 s); rare once; then
    new needs room: rare goes, not hot, though hot was used longer ago."""
    reqs = (
        trace((0.0, 10, 2), (20.0, 10, 2), (40.0, 10, 2), model="hot")
        + trace((60.0, 10, 2), model="rare")
        + trace((80.0, 10, 2), model="new")
        + trace((100.0, 10, 2), model="hot")
    )
    profiles = {m: cached_profile(m) for m in ("hot", "rare", "new")}
    s = sim(plan(reqs), profiles, devices=1, keep_alive_s=10.0, host_cache_bytes=2 * GB)
    host = s.tes[0].host
    assert host is not None and "hot" in host and "new" in host and "rare" not in host
    assert s.stats.evictions == 1 and s.stats.evicted_bytes == GB
    assert s.stats.loads_by_source == {"disk": 3, "cache": 3}
    assert host.used_bytes() <= 2 * GB
    # Two TEs of one pool, room for one model: b cannot evict a, which a TE serves.
    reqs = trace((0.0, 10, 400), model="a") + trace((1.0, 10, 2), model="b")
    profiles = {m: cached_profile(m) for m in ("a", "b")}
    s = sim(plan(reqs), profiles, devices=2, pool_size=2, host_cache_bytes=GB)
    host = s.tes[0].host
    assert host is not None and "a" in host and "b" not in host
    assert s.stats.evictions == 0 and s.stats.uncached_loads == 1


def test_a_recent_model_is_preloaded_where_its_next_instance_goes_which_then_maps_it() -> None:
    """Two pools of two TEs. m loads on pool 0 from disk; the scaler pre-loads it into pool 1
    (its next instance's pool), forked from pool 0; a burst then scales m out onto pool 1,
    and that load maps the weights. Without pre-loads, it forks them."""
    reqs = trace((0.0, 100, 2), *[(8.0, 100, 200)] * 48, model="m")
    planned = plan(reqs)
    prof = {"m": cached_profile()}
    common = dict(devices=4, pool_size=2, max_replicas=2, host_cache_bytes=4 * GB)
    s = sim(planned, prof, **common)
    assert s.stats.preloads_sent == s.stats.preloads_done == 1
    assert s.stats.loads_by_source == {"disk": 1, "cache": 1}
    assert s.stats.preload_seconds == pytest.approx(GB / 1.25e9 + 0.5)
    assert all(te.state == TEState.IDLE for te in s.tes)
    off = sim(planned, prof, **common, preload_window_s=0)
    assert off.stats.preloads_sent == 0
    assert off.stats.loads_by_source == {"disk": 1, "fork": 1}


def test_the_cache_shortens_cold_starts_of_a_bursty_many_model_mix() -> None:
    """12 models, bursty (cv 4), on 8 TEs in two pools: most models scale to zero between
    their bursts. Requests that find their model at zero wait for a load: with the cache,
    most loads map the weights (a model's first load reads the checkpoint), and those
    requests' TTFT falls (its tail is the bursts' queues, which no cache shortens)."""
    spec = SynthSpec(
        models=[ModelSpec(f"m{k}", 0.02, 4.0) for k in range(12)],
        duration_s=1800,
        input_mean=50,
        output_mean=20,
    )
    planned = plan(synthesize(spec, seed=1))
    profiles = {f"m{k}": cached_profile(f"m{k}") for k in range(12)}
    cfg = dict(devices=8, pool_size=4, keep_alive_s=20.0, record_gaps=False)
    _, on = simulate(planned, profiles, SimConfig(**cfg))
    _, off = simulate(planned, profiles, SimConfig(**cfg, host_cache_bytes=0))
    assert on.cold_requests > 100 and off.cold_requests > 100
    assert on.weight_cache_hit_rate > 0.8 and off.weight_cache_hit_rate == 0.0
    assert on.loads_by_source["disk"] == 12  # each model's first load only
    assert on.cold_ttft_s["p50"] < 0.5 * off.cold_ttft_s["p50"]
    assert on.cold_ttft_s["p90"] < 0.8 * off.cold_ttft_s["p90"]


def test_cli_reports_the_caches_and_takes_their_flags(tmp_path, capsys) -> None:
    from loadgen.cli import main
    from loadgen.costmodel import save_profiles
    from loadgen.traces import write_trace

    trace_file = tmp_path / "mix.jsonl"
    spec = SynthSpec(models=[ModelSpec(f"m{k}", 0.05, 3.0) for k in range(4)], duration_s=300)
    write_trace(trace_file, synthesize(spec, seed=2))
    prof = tmp_path / "p.json"
    save_profiles(prof, [cached_profile("base")])

    def run(*flags: str) -> dict:
        out = tmp_path / f"sim{len(flags)}"
        argv = ["simulate", str(trace_file), "--profile", str(prof), "--profile-for", "base"]
        argv += ["--devices", "4", "--pool-size", "2", "--keep-alive", "10", "--no-plots"]
        with pytest.raises(SystemExit) as e:
            main([*argv, *flags, "--out", str(out)])
        assert e.value.code == 0
        return json.loads((out / "summary.json").read_text())["run"]

    on = run()
    # --profile-for: one profile for every model of the trace, each its own model.
    assert set(on["profiles"]) == {"m0", "m1", "m2", "m3"}
    assert on["config"]["host_cache_bytes"] == 32 << 30
    assert on["config"]["preload_window_s"] == 600.0
    stats = on["stats"]
    assert stats["loads_by_source"]["cache"] > 0 and on["weight_cache_hit_rate"] > 0
    assert stats["cold_requests"] > 0 and set(stats["cold_ttft_s"]) == {"p50", "p90", "p99"}
    assert "host weight cache (32 GiB a pool): loads mapped" in capsys.readouterr().out
    off = run("--host-cache-bytes", "0", "--preload-window", "0")
    assert off["config"]["host_cache_bytes"] == 0 and off["weight_cache_hit_rate"] == 0.0
    assert set(off["stats"]["loads_by_source"]) == {"disk"}
    assert off["stats"]["preloads_sent"] == 0
    assert "host weight cache (off)" in capsys.readouterr().out
    assert run("--host-cache-bytes", "1.5G")["config"]["host_cache_bytes"] == 3 << 29
