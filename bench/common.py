"""What the engine benchmarks share: the bandwidth bound, the prompts, one timed decode run,
time to first token, medians, and waiting out busy neighbours on a shared host.

Imported by ``scripts/bench_engine.py`` and ``scripts/bench_openvino.py`` (with the repository
root on ``sys.path``, as bench_engine puts it).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from services.task_executor.engines.base import Engine, EngineRequest
from shared.messages.api import SamplingParams


def measure_bandwidth(gib: float = 1.0, reps: int = 7) -> float:
    """Read bandwidth in GB/s: the median time to sum a tensor far larger than any cache."""
    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    x.sum()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(times) / 1e9


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


def prompts_for(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``batch`` distinct prompts of ``length`` ids, the same for a seed whatever the engine.
    Ids past the first few (special tokens) and inside a small tokenizer's range, so the same
    prompts are plausible for every checkpoint."""
    g = torch.Generator().manual_seed(seed)
    hi = min(vocab, 4000)
    return torch.randint(8, hi, (batch, length), generator=g).tolist()


# --- one run on an engine (any Engine: torch, OpenVINO) --------------------------------------


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


class Neighbours:
    """CPU time used by other processes, from /proc/stat minus this process's own (and that
    of ``ours()``, e.g. a server under test).

    On a shared host a busy neighbour ruins CPU timings (with every core in use, each parallel
    op waits for a descheduled thread): ``timed`` starts a run once the others are quiet and
    repeats it when they used more than ``MAX_CORES`` during it (Linux only)."""

    MAX_CORES = 0.2  # a run during which others averaged more than this is repeated
    MAX_TRIES = 6

    def __init__(self, ours: Callable[[], Iterable[int]] | None = None) -> None:
        self.enabled = Path("/proc/stat").is_file()
        self.tick = os.sysconf("SC_CLK_TCK") if self.enabled else 100
        self.ours = ours
        self.retries = 0

    def _busy(self) -> tuple[int, int, float]:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:9]]
        pids = [os.getpid(), *(self.ours() if self.ours else ())]
        return sum(vals) - vals[3] - vals[4], cpu_ticks(pids), time.monotonic()

    def cores_used(self, since: tuple[int, int, float]) -> float:
        busy, mine, now = self._busy()
        others = (busy - since[0]) - (mine - since[1])
        return max(others, 0) / self.tick / max(now - since[2], 1e-3)

    def wait_quiet(self, max_wait_s: float = 120.0) -> None:
        deadline = time.monotonic() + max_wait_s
        quiet = 0
        while quiet < 2 and time.monotonic() < deadline:
            start = self._busy()
            time.sleep(0.5)
            quiet = quiet + 1 if self.cores_used(start) < self.MAX_CORES else 0

    def timed(self, run: Callable[..., Any], *args: Any) -> Any:
        """``run(*args)`` from a run the neighbours left alone (or the last try)."""
        if not self.enabled:
            return run(*args)
        for _ in range(self.MAX_TRIES):
            self.wait_quiet()
            start = self._busy()
            result = run(*args)
            if self.cores_used(start) < self.MAX_CORES:
                return result
            self.retries += 1
        return result


def call(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``: the ``timed`` of a run that needs no quiet host (warm-ups)."""
    return fn(*args)
