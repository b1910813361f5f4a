"""Weight multicast: one model's bytes from one source to N receivers, lambda-Scale's binomial
pipeline (receivers forward blocks while they receive, ``weight_cache/multicast.py``) against
the one-source fan-out (the source sends every receiver every block itself), both played by
the TCP transport ``weight_cache/relay.py``, side by side in the same run.

Every node is a process of its own on this host (spawned once per N and kept for that N's
runs), talking over loopback: the source holds ``--bytes`` of random-ish bytes (and their
blocks' digests, as a host cache keeps them); before each run every receiver allocates (and
touches) a fresh buffer, outside the clock. A run's time is from the source's start to the
last receiver holding every block (all nodes on one host share ``time.monotonic``); each
receiver's bytes are checked against the source's after the run. Medians over ``--reps``,
the two schedules alternating which goes first.

The goal (issue 16): the pipeline's time for 8 receivers within 1.5× its time for one. The
step model (a step = one block over one link, every link at once) predicts
``(b − 1 + ⌈log2(N + 1)⌉) / b`` for the pipeline and ``N`` for the fan-out: that assumes
every node sends and receives at full rate in parallel. Loopback TCP costs CPU on both ends
(a copy into the kernel, a copy out), so on a host with fewer cores than the pipeline has
active links the pipeline is CPU-bound and its time grows with N too; the table prints the
host's cores, the bandwidth of one loopback connection and the others' CPU use during each
run, so the numbers can be read for what they are.

    scripts/bench-multicast [--receivers 1,2,4,8] [--bytes 512MiB] [--block-bytes 16MiB]

Writes bench-results/multicast.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from services.task_executor.weight_cache.multicast import binomial_pipeline, fan_out, steps_needed
from services.task_executor.weight_cache.relay import (
    BlockStore,
    address_of,
    block_count,
    listen,
    run_node,
)

# bench.common imports torch: the parent imports it where it needs it, so that the nodes
# (processes that only move bytes) start in a fraction of a second.
ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path("bench-results")
SCHEDULES = {"pipeline": binomial_pipeline, "fan-out": fan_out}
UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9}
UNITS |= {"gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def size(text: str) -> int:
    """Bytes from ``512MiB``, ``16MiB``, ``1GiB``, ``1000000``, ``4k``."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


# --- a node (a child process) ---------------------------------------------------------------


def _source_bytes(total: int) -> bytearray:
    """``total`` random-ish bytes: one random MiB over and over, each copy stamped with its
    offset so that no two blocks are alike."""
    pattern = os.urandom(1 << 20)
    buf = bytearray(total)
    for off in range(0, total, len(pattern)):
        n = min(len(pattern), total - off)
        buf[off : off + n] = pattern[:n]
        stamp = off.to_bytes(8, "little")[: min(8, n)]
        buf[off : off + len(stamp)] = stamp
    return buf


def _node(node: int, total: int, block_bytes: int, timeout: float) -> int:
    """A node's loop: answers one JSON line per command on stdin (``prepare``, ``run``)."""
    import xxhash

    listener = listen("127.0.0.1:0")
    buffer = _source_bytes(total) if node == 0 else bytearray(0)
    source = BlockStore(buffer, block_bytes, full=True) if node == 0 else None
    if source is not None:
        for i in range(source.blocks):
            source.digest(i)
    blocks = block_count(total, block_bytes)

    def reply(body: dict[str, Any]) -> None:
        print(json.dumps(body), flush=True)

    reply({"address": address_of(listener), "digest": xxhash.xxh3_64_hexdigest(buffer)})
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "prepare":
            if node:
                buffer = bytearray(0)  # the last run's copy goes first
                buffer = bytearray(total)  # zero-filled: its pages are touched here
            reply({"ready": True})
        elif command["op"] == "run":
            addresses: list[str] = command["addresses"]
            schedule = SCHEDULES[command["schedule"]](len(addresses) - 1, blocks)
            store = source or BlockStore(buffer, block_bytes)
            stats = run_node(node, schedule, addresses, store, listener=listener, timeout=timeout)
            digest = xxhash.xxh3_64_hexdigest(buffer) if node else None
            reply({"stats": _asdict(stats), "digest": digest})
        else:
            return 0
    return 0


def _asdict(stats: Any) -> dict[str, Any]:
    return {f: getattr(stats, f) for f in stats.__dataclass_fields__}


# --- the parent -----------------------------------------------------------------------------


class Nodes:
    """The source and ``receivers`` receivers, a process each, listening."""

    def __init__(self, receivers: int, total: int, block_bytes: int, timeout: float) -> None:
        argv = [sys.executable, "-m", "bench.multicast", "--bytes", str(total)]
        argv += ["--block-bytes", str(block_bytes), "--timeout", str(timeout)]
        self.procs = [
            subprocess.Popen(
                [*argv, "--node", str(k)],
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for k in range(receivers + 1)
        ]
        hello = [self._answer(k) for k in range(receivers + 1)]
        self.addresses = [h["address"] for h in hello]
        self.source_digest: str = hello[0]["digest"]

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _ask(self, k: int, command: dict[str, Any]) -> None:
        stdin = self.procs[k].stdin
        assert stdin is not None
        stdin.write(json.dumps(command) + "\n")
        stdin.flush()

    def _answer(self, k: int) -> dict[str, Any]:
        stdout = self.procs[k].stdout
        assert stdout is not None
        line = stdout.readline()
        if not line:
            raise RuntimeError(f"node {k} exited with {self.procs[k].wait()} (its stderr above)")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def prepare(self) -> None:
        for k in range(len(self.procs)):
            self._ask(k, {"op": "prepare"})
        for k in range(len(self.procs)):
            self._answer(k)

    def run(self, schedule: str) -> dict[str, Any]:
        """One broadcast: the receivers start first (they wait for bytes), then the source."""
        command = {"op": "run", "schedule": schedule, "addresses": self.addresses}
        for k in [*range(1, len(self.procs)), 0]:
            self._ask(k, command)
        answers = [self._answer(k) for k in range(len(self.procs))]
        stats = [a["stats"] for a in answers]
        for k, a in enumerate(answers[1:], 1):
            if a["digest"] != self.source_digest:
                raise RuntimeError(f"{schedule}: receiver {k} ended with other bytes")
        start = stats[0]["started"]
        return {
            "schedule": schedule,
            "seconds": max(s["held_all"] for s in stats[1:]) - start,
            "first_byte_s": min(s["first_byte"] for s in stats[1:]) - start,
            "source_bytes_sent": stats[0]["bytes_sent"],
            "nodes": stats,
        }

    def close(self) -> None:
        for p in self.procs:
            if p.stdin is not None:
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="scripts/bench-multicast",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--receivers", default="1,2,4,8", help="receiver counts, comma-separated")
    p.add_argument("--bytes", type=size, default=512 << 20, help="the model's bytes (512MiB)")
    p.add_argument("--block-bytes", type=size, default=16 << 20, help="block size (16MiB)")
    p.add_argument("--reps", type=int, default=3, help="runs of each schedule per N")
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=30.0,
        help="seconds to wait at most, before each run, for other processes to go quiet",
    )
    p.add_argument("--timeout", type=float, default=120.0, help="a node's longest wait (s)")
    p.add_argument("--out", type=Path, default=RESULTS / "multicast.json")
    p.add_argument("--node", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.node is not None:
        return _node(args.node, args.bytes, args.block_bytes, args.timeout)

    from bench.coldstart import loopback_gb_s
    from bench.common import Col, Neighbours, Table, median, numbers, write_result

    receivers = sorted(set(numbers(args.receivers)))
    if not receivers or min(receivers) < 1:
        p.error("--receivers: counts of at least 1")
    blocks = block_count(args.bytes, args.block_bytes)
    cpus = os.cpu_count() or 1
    loopback = loopback_gb_s(min(args.bytes, 1 << 30) // (4 << 20) * (4 << 20) or (4 << 20))
    print(
        f"{args.bytes / (1 << 20):.0f} MiB in {blocks} blocks of {args.block_bytes / (1 << 20):g}"
        f" MiB; {cpus} cores on this host; one loopback connection: {loopback:.2f} GB/s",
        flush=True,
    )
    table = Table(
        [
            Col("receivers", "N"),
            Col("schedule", "schedule", left=True, width=9),
            Col("steps", "steps"),
            Col("seconds", "time p50 (s)", ".3f"),
            Col("min_s", "min (s)", ".3f"),
            Col("vs_one", "÷ own N=1", ".2f"),
            Col("model_vs_one", "model ÷ N=1", ".2f"),
            Col("fan_over_pipe", "fan-out ÷ pipeline", ".2f"),
            Col("gb_s", "delivered GB/s", ".2f"),
            Col("first_byte_s", "1st byte (s)", ".3f"),
            Col("others", "others' cores", ".2f"),
        ]
    )
    rows: list[dict[str, Any]] = []
    runs: dict[str, list[dict[str, Any]]] = {}
    one: dict[str, float] = {}  # each schedule's time for one receiver
    for n in receivers:
        nodes = Nodes(n, args.bytes, args.block_bytes, args.timeout)
        neighbours = Neighbours(ours=nodes.pids, enabled=args.quiet_wait > 0)
        try:
            got: dict[str, list[dict[str, Any]]] = {s: [] for s in SCHEDULES}
            for rep in range(args.reps):
                order = list(SCHEDULES) if rep % 2 == 0 else list(reversed(SCHEDULES))
                for name in order:
                    nodes.prepare()
                    neighbours.wait_quiet(args.quiet_wait)
                    since = neighbours.sample()
                    run = nodes.run(name)
                    run["others_cores"] = (
                        neighbours.cores_used(since) if neighbours.enabled else None
                    )
                    got[name].append(run | {"rep": rep})
        finally:
            nodes.close()
        times = {s: median([r["seconds"] for r in got[s]]) for s in SCHEDULES}
        if n == 1:
            one = times
        for name, schedule in SCHEDULES.items():
            steps = len(schedule(n, blocks))  # with one receiver, either: one per block
            others = [r["others_cores"] for r in got[name] if r["others_cores"] is not None]
            row = {
                "receivers": n,
                "schedule": name,
                "steps": steps,
                "seconds": times[name],
                "min_s": min(r["seconds"] for r in got[name]),
                "vs_one": times[name] / one[name] if one else None,
                "model_vs_one": steps / blocks,
                "fan_over_pipe": times["fan-out"] / times["pipeline"],
                "gb_s": n * args.bytes / times[name] / 1e9,
                "first_byte_s": median([r["first_byte_s"] for r in got[name]]),
                "others": max(others) if others else None,
            }
            rows.append(row)
            table.row(row)
            runs[f"{name}/{n}"] = got[name]
    pipe = {r["receivers"]: r for r in rows if r["schedule"] == "pipeline"}
    goal: dict[str, Any] = {}
    if 1 in pipe and 8 in pipe:
        ratio = pipe[8]["seconds"] / pipe[1]["seconds"]
        goal = {"pipeline_8_over_1": ratio, "target": 1.5, "met": ratio <= 1.5}
        print(
            f"goal: pipeline(8) ÷ pipeline(1) = {ratio:.2f} (target ≤ 1.5: "
            f"{'met' if ratio <= 1.5 else 'not met'}; step model "
            f"{steps_needed(8, blocks) / blocks:.2f}; {cpus} cores for 9 processes)",
            flush=True,
        )
    write_result(
        args.out,
        {
            "bytes": args.bytes,
            "block_bytes": args.block_bytes,
            "blocks": blocks,
            "reps": args.reps,
            "loopback_gb_s": loopback,
            "goal": goal,
            "rows": rows,
            "runs": runs,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
