"""meshserve-loadgen: replay real traces against any OpenAI-compatible endpoint and report
latency percentiles, throughput, goodput and SLO attainment, with plots.

  meshserve-loadgen replay traces/azure_llm_2023_conv.csv \\
      --url http://127.0.0.1:8080/v1 --model demo --tokenizer models/demo \\
      --time-scale 0.1 --max-requests 200 --out runs/azure
  meshserve-loadgen synth --models a:2,b:0.5:3 --duration 120 --turns 3 --out mix.jsonl
  meshserve-loadgen compare runs/meshserve runs/vllm --plot compare.png
  meshserve-loadgen run --url http://127.0.0.1:8080/v1 --model demo --requests 32

Exit status: 0 when the run completed (failed requests are data, counted in the summary),
2 for bad arguments or an unreadable trace, 3 when the endpoint cannot be used."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from loadgen import control_plane as cp
from loadgen import transforms
from loadgen.closed_loop import report, run_closed_loop
from loadgen.plan import PlanError, parse_models_map, plan
from loadgen.progress import Progress
from loadgen.prompts import PromptError, TokenPool, approximate_pool, tokenizer_pool
from loadgen.replay import EndpointError, SendOptions, list_models, replay
from loadgen.traces import FORMATS, TraceError, TraceRequest, read_trace, write_trace
from services.job_executor.disaggregation import PdConfig
from services.job_executor.routing import POLICIES, RoutingConfig
from shared.slo import SLO, parse_slo

if TYPE_CHECKING:
    from loadgen.simulator import SimConfig, SimStats

__all__ = ["main", "report"]

PROG = "meshserve-loadgen"


class UsageError(ValueError):
    """Bad options or inputs: exit status 2."""


def _fail(msg: str, code: int) -> None:
    print(f"{PROG}: error: {msg}", file=sys.stderr)
    sys.exit(code)


# --------------------------------------------------------------------------- replay


def _tokenizer_paths(specs: list[str], models: set[str]) -> dict[str, Path | None]:
    """``--tokenizer PATH`` (every model) and ``--tokenizer MODEL=PATH``; a model without
    one uses ``$MESHSERVE_MODELS_DIR/MODEL`` (default ``models/MODEL``) when that holds a
    tokenizer.json (meshserve's own layout), else none."""
    default: Path | None = None
    per: dict[str, Path] = {}
    for s in specs:
        name, sep, path = s.partition("=")
        if sep and not Path(s).exists():
            per[name] = Path(path)
        else:
            default = Path(s)
    from shared.settings import Settings

    models_dir = Settings.load().models_dir
    out: dict[str, Path | None] = {}
    for m in models:
        p = per.get(m, default)
        if p is None and (models_dir / m / "tokenizer.json").is_file():
            p = models_dir / m
        out[m] = p
    return out


def _pools(paths: dict[str, Path | None], seed: int, need_text: bool) -> dict[str, TokenPool]:
    cache: dict[Path | None, TokenPool] = {}
    out = {}
    for m, p in paths.items():
        if p not in cache:
            if p is None:
                print(
                    f"{PROG}: warning: no tokenizer for model {m!r}: prompt lengths are "
                    "approximate (give --tokenizer for exact ones)",
                    file=sys.stderr,
                )
                cache[p] = approximate_pool()
            else:
                cache[p] = tokenizer_pool(p, seed=seed, need_text=need_text)
        out[m] = cache[p]
    return out


def _context(*limits: int | None) -> int | None:
    """The tightest of the known context limits (``--max-context``, the server's)."""
    known = [c for c in limits if c]
    return min(known) if known else None


def _slo(args: argparse.Namespace) -> SLO:
    slo = SLO(
        ttft_s=args.slo_ttft_s,
        ttft_per_input_token_s=args.slo_ttft_per_token_s,
        tpot_s=args.slo_tpot_s,
    )
    return parse_slo(args.slo, slo) if args.slo else slo


def _requests(args: argparse.Namespace) -> tuple[list[TraceRequest], int]:
    """The trace's requests after rate and time scaling and the limits; and how many the
    trace had."""
    reqs = read_trace(args.trace, args.format)
    n_trace = len(reqs)
    if args.rate_scale != 1:
        reqs = transforms.scale_rate(reqs, args.rate_scale, args.seed)
    if args.time_scale != 1:
        reqs = transforms.scale_time(reqs, args.time_scale)
    if args.prompt_scale != 1:
        try:
            reqs = transforms.scale_prompts(reqs, args.prompt_scale)
        except ValueError as e:
            raise UsageError(str(e)) from None
    reqs = transforms.limit(reqs, duration_s=args.duration, max_requests=args.max_requests)
    if args.spread_models:
        try:
            reqs = transforms.spread_models(reqs, args.spread_models, args.model_skew, args.seed)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if not reqs:
        raise UsageError("no requests left after --duration/--max-requests/--rate-scale")
    return reqs, n_trace


def _write_run(out: Path, results: list, summary: dict, slo: SLO, title: str, plots: bool) -> None:
    from loadgen.plots import plot_run
    from loadgen.results import write_results

    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_results(out / "requests.jsonl", results)
    if plots:
        plot_run(results, slo, out, title=title)
    _print_summary(summary, out)


def cmd_replay(args: argparse.Namespace) -> int:
    if args.api == "chat" and args.prompt_format == "ids":
        raise UsageError("--prompt-format ids needs --api completions")
    slo = _slo(args)
    reqs, n_trace = _requests(args)

    url = args.url.rstrip("/")
    models_map = parse_models_map(args.models_map)
    planned = plan(reqs, model=args.model, models_map=models_map)  # names only, for checks
    served = {p.model for p in planned}
    from shared.settings import Settings

    api_key = args.api_key or Settings.load().loadgen.api_key or "unused"
    try:
        listed = asyncio.run(list_models(url, api_key=api_key))
    except EndpointError as e:
        _fail(str(e), 3)
    missing = sorted(served - set(listed))
    if missing and listed:
        _fail(
            f"{url} does not serve {', '.join(missing)} (it serves {', '.join(sorted(listed))})", 3
        )
    max_context = {m: _context(args.max_context, listed.get(m)) for m in served}
    planned = plan(
        reqs,
        model=args.model,
        models_map=models_map,
        max_context=max_context,
        max_output_tokens=args.max_output_tokens,
    )
    pools = _pools(
        _tokenizer_paths(args.tokenizer or [], served),
        args.seed if args.prompt_seed is None else args.prompt_seed,
        need_text=args.prompt_format == "text",
    )
    if args.prompt_format == "ids" and not all(pools[m].exact for m in served):
        raise UsageError("--prompt-format ids needs the target's --tokenizer")

    opts = SendOptions(
        url=url,
        api=args.api,
        prompt_format=args.prompt_format,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        api_key=api_key,
        seed=args.seed,
        timeout_s=args.timeout,
    )
    span = planned[-1].arrival_s
    print(
        f"{PROG}: replaying {len(planned)} of {n_trace} requests over {span:.1f} s to {url} "
        f"({', '.join(sorted(served))})",
        file=sys.stderr,
    )
    progress = Progress(len(planned), enabled=not args.quiet)
    t0 = time.time()
    results = asyncio.run(replay(planned, pools, opts, progress))

    from loadgen.report import summarize

    summary = summarize(results, slo, exact_prompts=all(pools[m].exact for m in served))
    summary["run"] = {
        "trace": str(args.trace),
        "trace_requests": n_trace,
        "url": url,
        "api": args.api,
        "prompt_format": args.prompt_format,
        "ignore_eos": args.ignore_eos,
        "time_scale": args.time_scale,
        "rate_scale": args.rate_scale,
        "duration": args.duration,
        "max_requests": args.max_requests,
        "max_output_tokens": args.max_output_tokens,
        "max_context": max_context,
        "seed": args.seed,
        "started_at": t0,
        "argv": sys.argv[1:],
    }
    _write_run(args.out, results, summary, slo, f"({Path(args.trace).name})", not args.no_plots)
    return 0


def _print_summary(s: dict, out: Path) -> None:
    def p(d: dict) -> str:
        return " / ".join("-" if d.get(k) is None else f"{d[k]:.0f}" for k in ("p50", "p90", "p99"))

    att = s["slo_attainment"]
    lines = [
        f"requests {s['requests']}  failed {s['failed']}  clipped prompts {s['clipped_prompts']}"
        f"  duration {s['duration_s']:.1f} s",
        f"TTFT p50/p90/p99 ms  {p(s['ttft_ms'])}",
        f"TPOT p50/p90/p99 ms  {p(s['tpot_ms'])}",
        f"E2E  p50/p90/p99 ms  {p(s['e2e_ms'])}",
        f"throughput {s['throughput_tok_s']:.1f} tok/s  goodput {s['goodput_rps']:.2f} req/s  "
        f"SLO attainment {'-' if att is None else f'{att:.1%}'} ({s['slo']['text']})",
    ]
    for name, g in s.get("pd", {}).items():  # the server's PD split (X-Meshserve-Pd)
        lines.append(
            f"  {name}: {g['requests']} requests  TTFT p50/p90/p99 ms {p(g['ttft_ms'])}  "
            f"TPOT {p(g['tpot_ms'])}"
        )
    lines.append(f"results in {out}/ (summary.json, requests.jsonl, *.png)")
    print("\n".join(lines))


# --------------------------------------------------------------------------- synth


def cmd_synth(args: argparse.Namespace) -> int:
    from loadgen.synth import ModelSpec, SynthSpec, parse_models, synthesize

    models = (
        parse_models(args.models) if args.models else [ModelSpec(args.model, args.rate, args.cv)]
    )
    spec = SynthSpec(
        models=models,
        duration_s=args.duration,
        input_mean=args.input_tokens,
        input_cv=args.input_cv,
        output_mean=args.output_tokens,
        output_cv=args.output_cv,
        turns_mean=args.turns,
        think_time_s=args.think_time,
        system_prompt_tokens=args.system_prompt_tokens,
        block_size=args.block_size,
        max_input_tokens=args.max_input_tokens,
        max_requests=args.max_requests,
    )
    reqs = synthesize(spec, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_trace(args.out, reqs)
    by_model: dict[str | None, int] = {}
    for r in reqs:
        by_model[r.model] = by_model.get(r.model, 0) + 1
    mix = ", ".join(f"{m or '(no model)'}: {n}" for m, n in by_model.items())
    print(f"wrote {len(reqs)} requests over {args.duration:g} s to {args.out} ({mix})")
    return 0


# --------------------------------------------------------------------------- compare


def cmd_compare(args: argparse.Namespace) -> int:
    from loadgen.compare import RunError, compare

    try:
        print(compare(args.runs, args.plot))
    except RunError as e:
        raise UsageError(str(e)) from e
    if args.plot:
        print(f"plot: {args.plot}")
    return 0


# --------------------------------------------------------------------------- simulate


def cmd_simulate(args: argparse.Namespace) -> int:
    from loadgen.costmodel import DEFAULT_PROFILE, GPU_PROFILE, load_profiles
    from loadgen.fleet import FleetTimeline, write_fleet
    from loadgen.prefix_sim import reuse_bound
    from loadgen.report import summarize
    from loadgen.simulator import SimConfig, simulate

    slo = _slo(args)
    reqs, n_trace = _requests(args)
    profiles = load_profiles(args.profile or DEFAULT_PROFILE)
    models_map = parse_models_map(args.models_map)
    model = args.model
    if model is None and not models_map and not args.profile_for and len(profiles) == 1:
        model = next(iter(profiles))  # one profile: every request is for its model
    names = {p.model for p in plan(reqs, model=model, models_map=models_map)}
    if args.profile_for:
        base = profiles[args.profile_for] if args.profile_for in profiles else None
        if base is None:
            raise UsageError(
                f"--profile-for {args.profile_for}: no such profile "
                f"(have {', '.join(sorted(profiles))})"
            )
        profiles = {**{m: dataclasses.replace(base, model=m) for m in names}, **profiles}
    missing = sorted(names - set(profiles))
    if missing:
        raise UsageError(
            f"no engine profile for {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}: give --profile-for MODEL to "
            "use one profile for every model, or --model/--models-map"
        )
    max_context = {m: profiles[m].max_model_len for m in names}
    planned = plan(
        reqs,
        model=model,
        models_map=models_map,
        max_context=max_context,
        max_output_tokens=args.max_output_tokens,
    )
    gpu_profiles = None
    if args.gpu_devices:
        gpu_profiles = load_profiles(args.gpu_profile or GPU_PROFILE)
        if args.profile_for:
            gpu_base = next(iter(gpu_profiles.values()))
            gpu_profiles = {
                **{m: dataclasses.replace(gpu_base, model=m) for m in names},
                **gpu_profiles,
            }
    cfg = SimConfig(
        devices=args.devices,
        slots_per_device=args.slots_per_device,
        sharing=args.sharing,
        shadow=args.shadow,
        kv_sizing=args.kv_sizing,
        kv_preemption=args.kv_preemption,
        gpu_devices=args.gpu_devices,
        pool_size=args.pool_size,
        keep_alive_s=args.keep_alive,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas or args.devices * max(1, args.slots_per_device),
        target_utilization=args.target_utilization,
        late_yield_s=args.late_yield,
        stable_window_s=args.stable_window,
        panic_window_s=args.panic_window,
        slo=slo,
        placement_timeout_s=args.placement_timeout,
        heartbeat_s=args.heartbeat,
        network_s=args.network_ms / 1000,
        record_gaps=not args.no_gaps,
        routing=_routing(args),
        prefix_caching=not args.no_prefix_caching,
        host_cache_bytes=args.host_cache_bytes,
        preload_window_s=args.preload_window,
        max_queued_per_slot=args.max_queued_per_slot,
        pd=_pd(args),
        max_prefill_replicas=args.max_prefill_replicas,
        kv_bandwidth=args.kv_bandwidth,
    )
    calibration = None
    if args.calibrate:
        calibration = _calibrate(args.calibrate, planned, profiles, cfg)
        profiles = {
            m: dataclasses.replace(p, emit_s=calibration["emit_s"]) for m, p in profiles.items()
        }
    print(
        f"{PROG}: simulating {len(planned)} of {n_trace} requests on {cfg.devices} devices "
        f"({len(names)} model(s))",
        file=sys.stderr,
    )
    try:
        fleet = FleetTimeline(args.fleet_bucket)
    except ValueError as e:
        raise UsageError(f"--fleet-bucket: {e}") from None
    t0 = time.perf_counter()
    results, stats = simulate(planned, profiles, cfg, gpu_profiles, fleet=fleet)
    wall = time.perf_counter() - t0
    summary = summarize(results, slo, exact_prompts=True)
    ideal = None
    if args.compare_ideal:
        ideal_results, ideal_stats = simulate(
            planned, profiles, dataclasses.replace(cfg, instant_loads=True), gpu_profiles
        )
        ideal = {
            "summary": {
                k: v
                for k, v in summarize(ideal_results, slo, exact_prompts=True).items()
                if k in ("slo_attainment", "goodput_rps", "ttft_ms", "tpot_ms", "failed")
            },
            "stats": dataclasses.asdict(ideal_stats),
        }
    control = _control_plane(args, cfg, stats)
    summary["run"] = {
        "simulated": True,
        "control_plane": cp.to_json(control),
        "trace": str(args.trace),
        "trace_requests": n_trace,
        "config": dataclasses.asdict(cfg),
        "profiles": {m: profiles[m].to_json() for m in sorted(names)},
        "time_scale": args.time_scale,
        "rate_scale": args.rate_scale,
        "seed": args.seed,
        "stats": dataclasses.asdict(stats),
        "weight_cache_hit_rate": stats.weight_cache_hit_rate,
        "wall_s": round(wall, 3),
        "argv": sys.argv[1:],
        "calibration": calibration,
        "ideal": ideal,
    }
    _write_run(
        args.out,
        results,
        summary,
        slo,
        f"(simulated, {cfg.devices} devices, {Path(args.trace).name})",
        not args.no_plots,
    )
    for line in write_fleet(args.out, fleet.rows(results, slo), plots=not args.no_plots):
        print(line)
    print(
        f"simulated {stats.iterations} iterations, {stats.loads} loads, {stats.unloads} "
        f"unloads, {stats.preemptions} preemptions in {wall:.1f} s"
    )
    peak = max(stats.peak_replicas.values(), default=0)
    print(
        f"instance-seconds {stats.instance_seconds:.0f} (then {stats.tail_instance_seconds:.0f} "
        f"waiting out the keep-alive), peak replicas of one model {peak}, "
        f"held requests {stats.held} (mean wait "
        f"{stats.held_wait_s / max(stats.held, 1):.2f} s), timeouts {stats.timeouts}, "
        f"refused by admission control {stats.shed}"
    )
    if cfg.prefix_caching:
        print(
            f"prefix reuse, % of prompt tokens: routed to a cached prefix "
            f"{100 * stats.matched_rate:.1f} (an oracle routing each request to the instance "
            f"holding the most: {100 * stats.oracle_hit_rate:.1f}; any cache of any size: "
            f"{100 * reuse_bound(planned):.1f}), taken from the cache at admission "
            f"{100 * stats.hit_rate:.1f}; routing {stats.routed}"
        )
    print(_weight_cache_line(stats, cfg.host_cache_bytes))
    print("\n".join(cp.lines(control)))
    if stats.prefill_loads or stats.pd_reasons:
        print(
            f"PD: {stats.prefill_loads} prefill instance loads, {stats.disaggregated} "
            f"requests disaggregated, {stats.kv_bytes / 1e9:.2f} GB of KV moved; "
            f"decisions {stats.pd_reasons}"
        )
    if args.routing == "all":
        _compare_routing(planned, profiles, cfg, slo, args.out, (summary, stats))
    if ideal is not None:
        ideal_is = ideal["stats"]["instance_seconds"]
        ratio = stats.instance_seconds / ideal_is if ideal_is else float("nan")
        print(
            f"ideal (instant loads): SLO attainment "
            f"{100 * (ideal['summary']['slo_attainment'] or 0):.1f}%, instance-seconds "
            f"{ideal_is:.0f}; this run uses {ratio:.2f}x the ideal's instance-seconds"
        )
    return 0


def _control_plane(args: argparse.Namespace, cfg: SimConfig, stats: SimStats) -> cp.ControlPlane:
    """What the run asked of the control plane (``loadgen.control_plane``), with the
    per-message costs measured now on this host."""
    tes = cfg.devices * max(1, cfg.slots_per_device)
    fleet = cp.Fleet(
        tes=tes,
        hosts=-(-cfg.devices // max(cfg.pool_size, 1)),
        job_executors=args.job_executors,
        frontends=args.frontends,
        heartbeat_s=cfg.heartbeat_s,
    )
    costs = cp.measure(stats.placement_wall_s / max(stats.placements, 1), tes=max(tes, 100))
    seconds = list(stats.placements_by_s) + list(stats.view_changes_by_s)
    work = cp.Work(
        placements=stats.placements,
        placements_by_s=stats.placements_by_s,
        view_changes_by_s=stats.view_changes_by_s,
        duration_s=float(max(seconds) - min(seconds) + 1) if seconds else 0.0,
    )
    return cp.needs(work, fleet, costs)


def _size(text: str) -> int:
    """``1073741824``, ``1G``, ``512M``: bytes (binary units)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    try:
        if t and t[-1] in units:
            return round(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r}") from None


def _weight_cache_line(stats, host_cache_bytes: int) -> str:
    """Where loads took their weights from, pre-loads and evictions, and the TTFT of the
    requests that found their model at zero."""
    src = stats.loads_by_source
    cold = stats.cold_ttft_s
    cache = f"{host_cache_bytes / 2**30:.3g} GiB a pool" if host_cache_bytes else "off"
    return (
        f"host weight cache ({cache}): loads mapped {src.get('cache', 0)}, forked "
        f"{src.get('fork', 0)}, from disk {src.get('disk', 0)} (hit rate "
        f"{100 * stats.weight_cache_hit_rate:.1f}%), pre-loads {stats.preloads_done}/"
        f"{stats.preloads_sent} done, evictions {stats.evictions}; requests that found no "
        f"instance of their model ready {stats.cold_requests}: TTFT p50 "
        f"{cold.get('p50', float('nan')):.2f} s, p90 {cold.get('p90', float('nan')):.2f} s"
    )


def _routing(args: argparse.Namespace) -> RoutingConfig:
    """The JE's routing settings, with the command line's choices over them."""
    from shared.settings import Settings

    je = Settings.load().job_executor
    policy = args.routing or je.routing
    return RoutingConfig(
        policy="combined" if policy == "all" else policy,
        balance_tokens=je.routing_balance_tokens
        if args.balance_tokens is None
        else args.balance_tokens,
    )


def _pd(args: argparse.Namespace) -> PdConfig:
    """The JE's PD rule from the settings (``MESHSERVE_PD*``), with ``--pd`` over its mode
    and ``--pd-heatmap`` over its heat maps."""
    from services.job_executor.disaggregation import pd_config
    from services.job_executor.pd_heatmap import load
    from shared.settings import Settings

    config = pd_config(Settings.load().job_executor)
    if args.pd:
        config = dataclasses.replace(config, mode=args.pd)
    if args.pd_heatmap:
        config = dataclasses.replace(config, heatmaps=load(args.pd_heatmap))
    return config


def _compare_routing(planned: list, profiles: dict, cfg, slo, out: Path, done: tuple) -> None:
    """Every routing policy on the same requests: a table, and routing.json. ``done``: the
    summary and stats of ``cfg``'s own policy, already run."""
    from loadgen.report import summarize
    from loadgen.simulator import simulate

    rows = {}
    for policy in POLICIES:
        if policy == cfg.routing.policy:
            summary, stats = done
        else:
            routing = dataclasses.replace(cfg.routing, policy=policy)
            results, stats = simulate(planned, profiles, dataclasses.replace(cfg, routing=routing))
            summary = summarize(results, slo, exact_prompts=True)
        rows[policy] = {
            "ttft_ms": summary["ttft_ms"],
            "tpot_ms": summary["tpot_ms"],
            "goodput_rps": summary["goodput_rps"],
            "slo_attainment": summary["slo_attainment"],
            "requests": summary["requests"],
            "failed": summary["failed"],
            "prompt_tokens": stats.prompt_tokens,
            "hit_rate": stats.hit_rate,
            "matched_rate": stats.matched_rate,
            "oracle_hit_rate": stats.oracle_hit_rate,
            "instance_seconds": stats.instance_seconds,
        }
    head = f"{'policy':<14}{'TTFT p50':>10}{'TTFT p90':>10}{'TPOT p90':>10}"
    head += f"{'goodput':>9}{'SLO':>8}{'failed':>8}{'routed':>8}{'oracle':>8}{'cached':>8}"
    print(head)
    for policy, r in rows.items():
        print(
            f"{policy:<14}{r['ttft_ms']['p50']:>8.0f}ms{r['ttft_ms']['p90']:>8.0f}ms"
            f"{r['tpot_ms']['p90']:>8.0f}ms{r['goodput_rps']:>9.3f}"
            f"{100 * (r['slo_attainment'] or 0):>7.1f}%{r['failed']:>8}"
            f"{100 * r['matched_rate']:>7.1f}%{100 * r['oracle_hit_rate']:>7.1f}%"
            f"{100 * r['hit_rate']:>7.1f}%"
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "routing.json").write_text(json.dumps(rows, indent=2) + "\n")


def _calibrate(run_dir: Path, planned: list, profiles: dict, cfg) -> dict:
    """Fit the profile's per-token serving cost to a replay of the same requests."""
    from loadgen.results import read_results
    from loadgen.simulator import calibrate_emit_s
    from loadgen.stats import percentile

    real = read_results(run_dir / "requests.jsonl")
    if len(real) != len(planned):
        raise UsageError(
            f"--calibrate {run_dir}: {len(real)} requests there, {len(planned)} "
            "here; give the same trace options as that replay"
        )
    models = {p.model for p in planned}
    if len(models) != 1:
        raise UsageError("--calibrate needs a single-model run")
    tpots = [t for r in real if (t := r.tpot_s) is not None]
    if not tpots:
        raise UsageError(f"--calibrate {run_dir}: no request there streamed two tokens")
    target = percentile(tpots, 50)
    emit_s = calibrate_emit_s(planned, profiles[models.pop()], cfg, target)
    print(
        f"{PROG}: calibrated emit_s = {emit_s * 1000:.3f} ms per streamed token "
        f"(replay TPOT p50 {target * 1000:.2f} ms)",
        file=sys.stderr,
    )
    return {"run": str(run_dir), "target_tpot_p50_s": target, "emit_s": emit_s}


def cmd_profile(args: argparse.Namespace) -> int:
    from loadgen.costmodel import save_profiles
    from loadgen.profiling import measure_profile
    from shared.settings import Settings

    overrides = {
        k: v
        for k, v in (("engine", args.engine), ("dtype", args.dtype), ("device", args.device))
        if v
    }
    settings = Settings.load(**overrides)
    name = args.name or args.model_dir.name
    prof = measure_profile(
        args.model_dir,
        model=name,
        settings=settings,
        reps=args.reps,
        log=lambda m: print(m, file=sys.stderr),
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_profiles(args.out, [prof])
    print(
        f"wrote {args.out}: load {prof.load_s:.1f} s, decode step "
        f"{prof.decode_s[0] * 1000:.1f} ms at batch {prof.decode_batches[0]}, "
        f"prefill {1 / prof.prefill_s if prof.prefill_s else float('inf'):.0f} tok/s (linear term)"
    )
    return 0


# --------------------------------------------------------------------------- run


def cmd_run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    records = asyncio.run(run_closed_loop(args))
    result = report(records, time.perf_counter() - t0)
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "summary.json").write_text(json.dumps(result, indent=2))
        with open(args.out / "requests.jsonl", "w") as f:
            for rec in records:
                f.write(json.dumps(dataclasses.asdict(rec)) + "\n")
    return 1 if result["failed"] else 0


# --------------------------------------------------------------------------- parser


def _trace_options(p: argparse.ArgumentParser) -> None:
    """What replay and simulate read from a trace, and how they scale it."""
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply inter-arrival times (0.1 = ten times faster)",
    )
    p.add_argument(
        "--rate-scale",
        type=float,
        default=1.0,
        help="<1 thins arrivals (keeps each with this probability); >1 adds "
        "jittered copies with renamed prefix blocks",
    )
    p.add_argument(
        "--prompt-scale",
        type=float,
        default=1.0,
        help="multiply prompt lengths and the trace's prefix block size (0.125: a trace of "
        "512-token blocks gets 64-token ones; sharing keeps its share of each prompt)",
    )
    p.add_argument(
        "--duration",
        type=float,
        help="only requests arriving in the first S seconds (after scaling)",
    )
    p.add_argument("--max-requests", type=int, help="only the first N requests")
    p.add_argument(
        "--spread-models",
        type=int,
        metavar="N",
        help="share the traffic among N models model-01..: each conversation to one, Zipf "
        "popularity (map them with --models-map, or --profile-for in simulate)",
    )
    p.add_argument(
        "--model-skew", type=float, default=1.0, help="--spread-models' Zipf exponent (0: even)"
    )
    p.add_argument("--max-output-tokens", type=int, help="cap every output length")
    p.add_argument("--seed", type=int, default=0, help="prompt content and rate scaling")
    p.add_argument(
        "--prompt-seed",
        type=int,
        default=None,
        help="prompt content only (default: --seed): the same requests with other tokens",
    )


def _slo_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slo-ttft-s", type=float, default=2.0, help="TTFT floor")
    p.add_argument(
        "--slo-ttft-per-token-s",
        type=float,
        default=1 / 512,
        help="TTFT allowance per input token: TTFT <= max(floor, n * this)",
    )
    p.add_argument("--slo-tpot-s", type=float, default=0.25, help="TPOT limit")
    p.add_argument(
        "--slo", help="the same as one spec, e.g. 'ttft=1s,ttft_per_token=1/1024,tpot=100ms'"
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    fmt = argparse.ArgumentDefaultsHelpFormatter

    r = sub.add_parser(
        "replay",
        formatter_class=fmt,
        help="replay a trace open-loop and report latencies and SLO attainment",
    )
    r.add_argument("trace", type=Path, help=f"trace file ({', '.join(FORMATS)}; detected)")
    r.add_argument("--format", choices=FORMATS, help="skip detection")
    r.add_argument(
        "--url", required=True, help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8080/v1"
    )
    r.add_argument("--model", help="send every request to this model (unless --models-map)")
    r.add_argument("--models-map", help="TRACE_MODEL=SERVED[,...]; '*=M' maps the rest")
    r.add_argument(
        "--tokenizer",
        action="append",
        metavar="[MODEL=]PATH",
        help="the target model's tokenizer (a model directory or tokenizer.json), "
        "for prompts of exact token lengths; repeat as MODEL=PATH per model. "
        "Default: $MESHSERVE_MODELS_DIR/MODEL if it has a tokenizer.json, else "
        "approximate lengths from common English words (the summary says "
        "prompt_tokens_exact: false)",
    )
    r.add_argument(
        "--api",
        choices=("completions", "chat"),
        default="completions",
        help="completions: exact prompt lengths; chat: the chat template's "
        "tokens are subtracted when the tokenizer directory has the template",
    )
    r.add_argument(
        "--prompt-format",
        choices=("text", "ids"),
        default="text",
        help="text: words that re-encode to exactly the planned ids; ids: prompt "
        "as a token-id list (servers that accept it: meshserve, vLLM)",
    )
    _trace_options(r)
    r.add_argument(
        "--max-context",
        type=int,
        help="clip prompts to this context; default: the server's max_model_len from /models",
    )
    r.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send ignore_eos (servers that reject it); outputs may then "
        "end before the trace's length",
    )
    r.add_argument("--temperature", type=float, default=0.0)
    _slo_options(r)
    r.add_argument(
        "--api-key",
        help="bearer token; without it $OPENAI_API_KEY, else none that matters ('unused')",
    )
    r.add_argument("--timeout", type=float, default=600, help="per request, seconds")
    r.add_argument("--no-plots", action="store_true")
    r.add_argument("--quiet", action="store_true", help="no progress line")
    r.add_argument("--out", type=Path, required=True, help="directory for the results")
    r.set_defaults(func=cmd_replay)

    s = sub.add_parser("synth", formatter_class=fmt, help="write a synthetic trace")
    s.add_argument("--rate", type=float, default=1.0, help="conversations per second")
    s.add_argument(
        "--cv",
        type=float,
        default=1.0,
        help="coefficient of variation of inter-arrival gaps (1 Poisson, >1 bursty)",
    )
    s.add_argument("--model", help="model name written into the trace")
    s.add_argument(
        "--models",
        help="many-model mix NAME:RATE[:CV],... (overrides "
        "--rate/--cv/--model): each model its own Gamma process",
    )
    s.add_argument("--duration", type=float, default=60.0, help="seconds")
    s.add_argument("--max-requests", type=int)
    s.add_argument("--input-tokens", type=float, default=512, help="mean new prompt tokens")
    s.add_argument("--input-cv", type=float, default=1.0, help="log-normal cv; 0 = constant")
    s.add_argument("--output-tokens", type=float, default=128, help="mean output tokens")
    s.add_argument("--output-cv", type=float, default=1.0)
    s.add_argument(
        "--turns",
        type=float,
        default=1.0,
        help="mean turns per conversation (geometric); each turn's prompt extends "
        "the previous turn's prompt and output",
    )
    s.add_argument(
        "--think-time", type=float, default=10.0, help="mean seconds between turns (exponential)"
    )
    s.add_argument(
        "--system-prompt-tokens",
        type=int,
        default=0,
        help="a prefix shared by every request of a model",
    )
    s.add_argument("--block-size", type=int, default=16, help="tokens per hash id")
    s.add_argument(
        "--max-input-tokens",
        type=int,
        default=32768,
        help="a conversation ends before its prompt passes this",
    )
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", type=Path, required=True, help="JSONL trace to write")
    s.set_defaults(func=cmd_synth)

    c = sub.add_parser("compare", help="runs side by side, with overlaid latency CDFs")
    c.add_argument("runs", type=Path, nargs="+", help="directories written by replay")
    c.add_argument(
        "--plot", type=Path, default=Path("compare.png"), help="PNG to write (default compare.png)"
    )
    c.set_defaults(func=cmd_compare)

    m = sub.add_parser(
        "simulate",
        formatter_class=fmt,
        help="replay a trace through the project's placement, scaling and "
        "batching policies on simulated devices with a profiled cost model",
    )
    m.add_argument("trace", type=Path, help=f"trace file ({', '.join(FORMATS)}; detected)")
    m.add_argument("--format", choices=FORMATS, help="skip detection")
    m.add_argument(
        "--model",
        help="every request is for this model (default: the trace's "
        "names, or the only profile's model)",
    )
    m.add_argument("--models-map", help="TRACE_MODEL=SERVED[,...]; '*=M' maps the rest")
    m.add_argument(
        "--profile",
        type=Path,
        help="engine cost profile(s) written by "
        "`profile` (default: the Qwen2-0.5B-shaped torch bf16 profile measured "
        "on the 2-core dev host, in loadgen/profiles/)",
    )
    m.add_argument(
        "--profile-for",
        metavar="MODEL",
        help="use this profile for every model without its own (many-model traces)",
    )
    m.add_argument("--devices", type=int, default=4, help="devices in the fleet")
    m.add_argument("--pool-size", type=int, default=4, help="TEs per node pool")
    m.add_argument(
        "--job-executors",
        type=int,
        default=2,
        help="job executors sharing the placements (the control plane's report)",
    )
    m.add_argument(
        "--frontends", type=int, default=2, help="frontends (view subscribers, in the report)"
    )
    m.add_argument(
        "--slots-per-device",
        type=int,
        default=1,
        help="instances one device holds at once (a TE each; its KV cache split among them)",
    )
    m.add_argument(
        "--sharing",
        choices=("uncoordinated", "fifo", "headroom"),  # loadgen.simulator.SHARING
        default="headroom",
        help="how a device's instances share it: time-sliced processes, one iteration at a "
        "time first come, or earliest deadline first (the device arbiter's turns)",
    )
    m.add_argument(
        "--shadow",
        action="store_true",
        help="validate each placement against the device's next iterations first",
    )
    m.add_argument(
        "--kv-sizing",
        action="store_true",
        help="KV pools sized by demand within each device's whole cache, the device's books "
        "kept as its arbiter keeps them (MESHSERVE_KV_SIZING with MESHSERVE_DEVICE_KV_BYTES; "
        "else the cache is split evenly among the device's instances)",
    )
    m.add_argument(
        "--kv-preemption",
        action="store_true",
        help="with --kv-sizing: an instance whose grow waits may preempt a smaller neighbour "
        "whose requests pass shadow validation on instances of their model elsewhere "
        "(kv_sizing.preemption); they move there and the neighbour unloads",
    )
    m.add_argument("--gpu-devices", type=int, default=0, help="of --devices, how many are GPUs")
    m.add_argument(
        "--gpu-profile",
        type=Path,
        help="the GPU devices' engine profile (default: the bench model's H100 profile; "
        "--profile-for applies to it too)",
    )
    m.add_argument(
        "--keep-alive", type=float, default=60.0, help="seconds idle before scale to zero"
    )
    m.add_argument(
        "--placement-timeout",
        type=float,
        default=60.0,
        help="seconds a job waits for an instance before it fails (503)",
    )
    m.add_argument(
        "--min-replicas", type=int, default=0, help="instances every model keeps (scaler)"
    )
    m.add_argument(
        "--max-replicas", type=int, help="most instances of one model (default: --devices)"
    )
    m.add_argument(
        "--target-utilization",
        type=float,
        default=0.7,
        help="share of an instance's capacity the scaler plans to use",
    )
    m.add_argument(
        "--stable-window", type=float, default=60.0, help="seconds; the scaler's rate window"
    )
    m.add_argument(
        "--late-yield",
        type=float,
        help="seconds a prompt past its TTFT target waits behind those in time "
        "(MESHSERVE_LATE_YIELD; default its default: 0, deadline order alone)",
    )
    m.add_argument(
        "--panic-window", type=float, default=6.0, help="seconds; the scaler's burst window"
    )
    m.add_argument(
        "--fleet-bucket",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="fleet.jsonl's bucket: each model's instances, what the scaler wanted and why, "
        "and the requests that arrived and missed the SLO, per this many seconds",
    )
    m.add_argument(
        "--compare-ideal",
        action="store_true",
        help="also run the same trace with instances that load instantly (λScale's ideal) "
        "and print both instance-second totals",
    )
    m.add_argument(
        "--host-cache-bytes",
        type=_size,
        default="32G",
        metavar="BYTES",
        help="each node pool's host weight cache (K, M, G, T: binary units; the default is a "
        "quarter of a 128 GiB host): loads map the weights it holds, evicted by Tangram's "
        "cost; 0 = off, every load reads the checkpoint",
    )
    m.add_argument(
        "--preload-window",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="a model with a request this recent is pre-loaded into the host cache of the "
        "pool its next instance would take (the scaler's decision); 0 = off",
    )
    m.add_argument(
        "--max-queued-per-slot",
        type=int,
        default=4,
        metavar="N",
        help="admission control, as the JE's MESHSERVE_MAX_QUEUED_PER_SLOT: refuse a request "
        "at once when every ready instance has N times its batch queued and no capacity is "
        "coming; 0 = never",
    )
    m.add_argument(
        "--max-prefill-replicas",
        type=int,
        default=0,
        metavar="N",
        help="PD disaggregation: the scaler loads up to N prefill instances per model, sized "
        "by the prompts the JE's PD rule sends them (MESHSERVE_MAX_PREFILL_REPLICAS); 0 = none",
    )
    m.add_argument(
        "--pd",
        choices=("auto", "always", "never"),
        help="the JE's PD rule (default: MESHSERVE_PD's, with its MESHSERVE_PD_MIN_UNCACHED_*)",
    )
    m.add_argument(
        "--pd-heatmap",
        type=Path,
        metavar="FILE",
        help="a PD heat map (scripts/bench-pd-heatmap) for auto (default: MESHSERVE_PD_HEATMAP)",
    )
    m.add_argument(
        "--kv-bandwidth",
        type=float,
        default=1.25e9,
        metavar="BYTES_PER_S",
        help="how fast a decode TE pulls a prefill TE's KV (default 10 Gb/s)",
    )
    m.add_argument("--heartbeat", type=float, default=1.0, help="seconds between TE reports")
    m.add_argument("--network-ms", type=float, default=0.5, help="one hop")
    m.add_argument(
        "--routing",
        choices=(*POLICIES, "all"),
        help="the JE's routing policy (default: MESHSERVE_ROUTING's); 'all' runs each on the "
        "same requests and prints them side by side (routing.json in --out)",
    )
    m.add_argument(
        "--balance-tokens",
        type=int,
        help="loads within this many tokens count as balanced (default: "
        "MESHSERVE_ROUTING_BALANCE_TOKENS')",
    )
    m.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="instances keep no prompt prefixes (by default each keeps an LRU of the "
        "trace's hash_ids blocks as large as its KV cache)",
    )
    m.add_argument(
        "--calibrate",
        type=Path,
        metavar="RUN_DIR",
        help="fit the profile's per-token serving cost (emit_s) so that the "
        "simulated TPOT p50 matches this replay of the same requests",
    )
    m.add_argument(
        "--no-gaps",
        action="store_true",
        help="do not keep inter-token gaps (large runs: 8 bytes per token)",
    )
    _trace_options(m)
    _slo_options(m)
    m.add_argument("--no-plots", action="store_true")
    m.add_argument("--out", type=Path, required=True, help="directory for the results")
    m.set_defaults(func=cmd_simulate)

    f = sub.add_parser(
        "profile", formatter_class=fmt, help="measure an engine's cost profile for simulate"
    )
    f.add_argument("model_dir", type=Path, help="an HF checkpoint directory")
    f.add_argument("--name", help="model name in the profile (default: the directory name)")
    f.add_argument(
        "--engine",
        choices=("torch", "openvino", "vllm"),
        help="default: MESHSERVE_ENGINE or auto, as a TE would choose",
    )
    f.add_argument("--dtype", help="default: MESHSERVE_DTYPE")
    f.add_argument("--device", help="default: MESHSERVE_DEVICE")
    f.add_argument("--reps", type=int, default=3)
    f.add_argument("--out", type=Path, required=True, help="JSON profile to write")
    f.set_defaults(func=cmd_profile)

    o = sub.add_parser("run", help="closed-loop load with one prompt (smoke test)")
    o.add_argument("--url", default="http://127.0.0.1:8080/v1")
    o.add_argument("--model", required=True)
    o.add_argument("--prompt", default="Tell me a story about a lighthouse keeper.")
    o.add_argument("--requests", type=int, default=16)
    o.add_argument("--concurrency", type=int, default=4)
    o.add_argument("--max-tokens", type=int, default=64)
    o.add_argument("--temperature", type=float, default=0.0)
    o.add_argument("--ignore-eos", action="store_true")
    o.add_argument("--timeout", type=float, default=600)
    o.add_argument("--out", type=Path, help="directory for summary.json and requests.jsonl")
    o.set_defaults(func=cmd_run)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        code = args.func(args)
    except (TraceError, PromptError, PlanError, UsageError) as e:
        _fail(str(e), 2)
    except ValueError as e:  # option values the parser cannot check (rates, cvs, SLO specs)
        _fail(str(e), 2)
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    sys.exit(code)


if __name__ == "__main__":
    main()
