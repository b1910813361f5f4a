"""What every benchmark shares: the neighbour-load monitor, the bandwidth probe and bound,
one table printer, one result writer (which records the host), the engine-level timing
helpers, and token-id prompts (built by ``loadgen.prompts``, as a replay builds them).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import torch

from services.task_executor.engines.base import Engine, EngineRequest
from shared.messages.api import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench-results"

# --- the bandwidth bound --------------------------------------------------------------------


def measure_bandwidth(gib: float = 1.0, reps: int = 7, device: str = "cpu") -> float:
    """Read bandwidth in GB/s of ``device``'s memory: the median time to sum a tensor far
    larger than any cache (the host's caches, or a GPU's L2)."""
    dev = torch.device(device)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32, device=dev)
    x.sum()
    sync()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        sync()
        times.append(time.perf_counter() - t)
    nbytes = x.numel() * 4
    del x
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return nbytes / statistics.median(times) / 1e9


def with_bandwidth(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    """(read bandwidth in GB/s measured just before, ``fn(*args)``). The host's bandwidth is
    shared with other machines and drifts by ±30% within minutes, so each run's bound is
    taken from a sample next to it, under the same check for quiet neighbours."""
    return measure_bandwidth(gib=0.5, reps=3), fn(*args)


def bound_tok_s(batch: int, bandwidth_gb_s: float, weight_bytes: int) -> float:
    """Decode tok/s if a step cost only one read of the weights at the measured bandwidth."""
    return batch * bandwidth_gb_s * 1e9 / weight_bytes


def median(samples: Sequence[float]) -> float:
    """The median, NaN when there are no samples."""
    return statistics.median(samples) if samples else float("nan")


# --- prompts --------------------------------------------------------------------------------


def prompts_for(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``batch`` distinct prompts of ``length`` ids, the same for a seed whatever the engine,
    for benches that drive an engine directly (no tokenizer in the loop). Ids past the first
    few (special tokens) and inside a small tokenizer's range, so the same prompts are
    plausible for every checkpoint."""
    g = torch.Generator().manual_seed(seed)
    hi = min(vocab, 4000)
    return torch.randint(8, hi, (batch, length), generator=g).tolist()


# --- one run on an engine (any Engine: torch, OpenVINO) --------------------------------------

BLOCK_SIZE = 16  # the KV block of the torch engines the benches build


def engine_decode(
    engine: Engine, prompts: list[list[int]], new_tokens: int, *, one_step_prefill: bool = False
) -> tuple[float, float]:
    """(prefill seconds, decode seconds) for one batch run to completion: the first ``step()``,
    then every step after it. ``one_step_prefill`` asserts the first step prefilled every
    prompt (else the decode time would include prefills)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"b{time.monotonic_ns()}-{i}", p, params))
    t0 = time.perf_counter()
    first = engine.step()
    t1 = time.perf_counter()
    produced = sum(len(o.new_token_ids) for o in first)
    while engine.has_work():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    t2 = time.perf_counter()
    if one_step_prefill:
        assert len(first) == len(prompts), "the prefill step did not cover every prompt"
    assert produced == len(prompts) * new_tokens, produced
    return t1 - t0, t2 - t1


def first_token_s(engine: Engine, prompt: list[int]) -> float:
    """Seconds from queueing a one-token request to its token (its TTFT on an idle engine)."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    engine.add_request(EngineRequest(f"p{time.monotonic_ns()}", prompt, params))
    while engine.has_work():
        engine.step()
    return time.perf_counter() - t


def call(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``: the ``timed`` of a run that needs no quiet host (warm-ups)."""
    return fn(*args)


# --- a quiet host -----------------------------------------------------------------------------


def cpu_ticks(pids: Iterable[int]) -> int:
    """utime + stime of these processes, in clock ticks (those gone count 0)."""
    total = 0
    for pid in set(pids):
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = Path(f"/proc/{pid}/stat").read_text()
            # fields after the command: state is [0], utime [11], stime [12]
            fields = stat[stat.rindex(")") + 2 :].split()
            total += int(fields[11]) + int(fields[12])
    return total


Sample = tuple[int, int, float]  # (busy ticks of the host, ticks of ours, monotonic time)


class Neighbours:
    """CPU time used by other processes: /proc/stat minus this process's own and that of
    ``ours()`` (a server under test, an engine's child process).

    On a shared host a busy neighbour ruins CPU timings (with every core in use, each
    parallel op waits for a descheduled thread). A run starts once the others stay under
    ``quiet_cores`` for two half-second samples in a row, and is repeated when they used
    more than ``noisy_cores`` during it (Linux only; elsewhere runs are taken as they come).
    """

    MAX_TRIES = 6

    def __init__(
        self,
        ours: Callable[[], Iterable[int]] | None = None,
        *,
        quiet_cores: float = 0.2,
        noisy_cores: float = 0.2,
        enabled: bool = True,
    ) -> None:
        self.enabled = enabled and Path("/proc/stat").is_file()
        self.tick = os.sysconf("SC_CLK_TCK") if self.enabled else 100
        self.ours = ours
        self.quiet_cores, self.noisy_cores = quiet_cores, noisy_cores
        self.retries = 0

    def sample(self) -> Sample:
        if not self.enabled:
            return 0, 0, time.monotonic()
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:9]]
        pids = [os.getpid(), *(self.ours() if self.ours else ())]
        return sum(vals) - vals[3] - vals[4], cpu_ticks(pids), time.monotonic()

    def cores_used(self, since: Sample) -> float:
        """Cores the others used on average since the sample."""
        busy, mine, now = self.sample()
        others = (busy - since[0]) - (mine - since[1])
        return max(others, 0) / self.tick / max(now - since[2], 1e-3)

    def noisy(self, since: Sample) -> bool:
        return self.cores_used(since) > self.noisy_cores

    def wait_quiet(self, max_wait_s: float = 120.0) -> float:
        """Until the others are quiet (or ``max_wait_s``); the seconds waited."""
        t0 = time.monotonic()
        quiet = 0
        while self.enabled and quiet < 2 and time.monotonic() - t0 < max_wait_s:
            start = self.sample()
            time.sleep(0.5)
            quiet = quiet + 1 if self.cores_used(start) < self.quiet_cores else 0
        return time.monotonic() - t0

    async def wait_quiet_async(self, max_wait_s: float = 120.0) -> float:
        """``wait_quiet`` for an event loop that must keep running (a server's client)."""
        t0 = time.monotonic()
        quiet = 0
        while self.enabled and quiet < 2 and time.monotonic() - t0 < max_wait_s:
            start = self.sample()
            await asyncio.sleep(0.5)
            quiet = quiet + 1 if self.cores_used(start) < self.quiet_cores else 0
        return time.monotonic() - t0

    def timed(self, run: Callable[..., Any], *args: Any) -> Any:
        """``run(*args)`` from a run the neighbours left alone (or the last try)."""
        if not self.enabled:
            return run(*args)
        for _ in range(self.MAX_TRIES):
            self.wait_quiet()
            start = self.sample()
            result = run(*args)
            if not self.noisy(start):
                return result
            self.retries += 1
        return result


# --- tables ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Col:
    """A column: ``key`` of a row (or a function of the row), its header, the format of its
    values (a format spec, applied to numbers), and its alignment."""

    key: str | Callable[[Mapping[str, Any]], Any]
    header: str
    fmt: str = ""
    width: int = 0  # 0: as wide as the header (and at least 6)
    left: bool = False

    def text(self, row: Mapping[str, Any]) -> str:
        value = self.key(row) if callable(self.key) else row.get(self.key)
        if value is None or (isinstance(value, float) and value != value):
            return "-"
        if self.fmt and isinstance(value, int | float) and not isinstance(value, bool):
            return format(value, self.fmt)
        return str(value)

    def cell(self, text: str) -> str:
        width = self.width or max(len(self.header), 6)
        return f"{text:<{width}}" if self.left else f"{text:>{width}}"


class Table:
    """How every bench prints results: a header, then rows as they come (flushed, so a long
    run shows its progress), aligned."""

    def __init__(self, cols: Sequence[Col], *, out: TextIO | None = None) -> None:
        self.cols = list(cols)
        self._out = out
        self._started = False

    def _print(self, line: str) -> None:
        print(line.rstrip(), file=self._out or sys.stdout, flush=True)

    def header(self) -> None:
        self._started = True
        self._print(" ".join(c.cell(c.header) for c in self.cols))

    def row(self, row: Mapping[str, Any]) -> None:
        if not self._started:
            self.header()
        self._print(" ".join(c.cell(c.text(row)) for c in self.cols))

    def print(self, rows: Iterable[Mapping[str, Any]], *, title: str | None = None) -> None:
        if title:
            self._print(f"\n{title}\n")
        self.header()
        for r in rows:
            self.row(r)

    def markdown(self, rows: Iterable[Mapping[str, Any]]) -> str:
        """The same table in Markdown (for the docs)."""
        lines = [
            "| " + " | ".join(c.header for c in self.cols) + " |",
            "|" + "|".join("---" for _ in self.cols) + "|",
        ]
        lines += ["| " + " | ".join(c.text(r) for c in self.cols) + " |" for r in rows]
        return "\n".join(lines)


# --- replays -------------------------------------------------------------------------------


def replay_row(config: str, summary: Mapping[str, Any]) -> dict[str, Any]:
    """A table row of what ``meshserve-loadgen replay`` (or ``simulate``) summarised."""
    return {
        "config": config,
        "requests": summary.get("requests"),
        "prompt_tokens": summary.get("input_tokens"),
        "output_tokens": summary.get("output_tokens"),
        "ttft_p50": summary["ttft_ms"]["p50"],
        "ttft_p90": summary["ttft_ms"]["p90"],
        "tpot_p90": summary["tpot_ms"]["p90"],
        "slo": 100 * (summary.get("slo_attainment") or 0.0),
        "goodput": summary.get("goodput_rps"),
        "failed": summary.get("failed"),
    }


# --- results --------------------------------------------------------------------------------


def _cpu_model_and_flags() -> tuple[str, list[str]]:
    model, flags = platform.processor() or platform.machine(), set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = set(value.split())
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
    return model, [f for f in wanted if f in flags]


def host_info() -> dict[str, Any]:
    """What a number depends on besides the code: the CPU and its matrix/vector units, the
    cores, torch and its view of the CPU, the GPU if any."""
    model, flags = _cpu_model_and_flags()
    info: dict[str, Any] = {
        "cpu": model,
        "cpu_flags": flags,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    with contextlib.suppress(OSError):
        info["load_avg"] = list(os.getloadavg())
    return info


def write_result(path: Path, result: Mapping[str, Any]) -> Path:
    """``result`` as JSON at ``path``, with the host it was measured on."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"host": host_info(), **result}, indent=2, default=str) + "\n")
    print(f"written: {path}", flush=True)
    return path


# --- models and arguments -------------------------------------------------------------------

# name: (directory under the models dir, devtools.modelgen function that makes it)
MODELS: dict[str, tuple[str, str]] = {
    "demo": ("demo", "make_demo_model"),
    "bench-qwen2-0.5b": ("bench-qwen2-0.5b", "make_bench_model"),
}


def models_dir() -> Path:
    """Where the benches keep their checkpoints: the cluster's models directory."""
    from shared.settings import Settings

    return Settings.load().models_dir


def ensure_model(name: str, directory: Path) -> Path:
    """The checkpoint ``name`` under ``directory``, generated offline when missing."""
    subdir, maker = MODELS[name]
    path = directory / subdir
    if not (path / "config.json").is_file():
        from devtools import modelgen

        print(f"generating {name} at {path} ...", file=sys.stderr, flush=True)
        getattr(modelgen, maker)(path)
    return path


def numbers(s: str) -> list[int]:
    """An argument of comma-separated integers."""
    return [int(x) for x in s.split(",") if x]


def names(s: str) -> list[str]:
    """An argument of comma-separated names."""
    return [x.strip() for x in s.split(",") if x.strip()]
