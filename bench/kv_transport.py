"""The KV data plane of PD disaggregation (``services/task_executor/kv_transport``) against
what its two transports are made of, in the same run: a prefill TE's KV pulled by a decode
TE over shared memory and over loopback TCP, next to a plain memory copy of the same bytes
(torch ``copy_``) and a plain socket copy (two processes, blocking ``sendall``/``recv_into``).

The KV is that of one prompt of ``--tokens`` tokens in the Qwen2-0.5B shape (24 layers, 2 KV
heads, head dim 64, bf16: 12 KiB a token), offered in chunks of ``--chunk`` tokens per layer
as a chunked prefill writes it. The server (``KvServer``) and the puller are processes of
their own, each on its own event loop (uvloop, as a TE runs), and both set the allocator up
as a TE does (``host_malloc``: large tensors, the outbox's arena among them, from a warm
heap), and the server's outboxes write into arenas in /dev/shm as a prefill TE's do
(``pool.ArenaPool``). The whole KV is offered before the pull starts, so a pull's time is
the transfer alone; its bytes are checked against the source's after each pull.

A time is until the KV lies in memory of the puller's own, as the transports compare with
their baselines: over TCP the pull itself (the payloads are received into its result); over
shared memory the pull (which hands back a view of the prefill's arena, no copy) and then
the one copy out of it, into a new tensor, that a decode TE's import makes into its KV
cache. The lease is released once that copy is made and the view dropped (not timed).

The baselines run in the puller's process on buffers made the same way as the transports':
``memcpy`` copies into a warm buffer as the import's copy does (a decode TE copies into its
KV cache, which is there already; a new ``torch.empty`` of the size would come from fresh
pages or from the heap by the allocator's whim, 8 ms or 0.8 ms at 1k tokens on host B),
``socket`` receives into a new ``torch.empty`` as a TCP pull does (with the socket buffers
the transport sets, ``wire.SOCKET_BUFFER``, over one connection kept for all runs; a pull
reuses its kept connection too). Each size starts with ``WARMUP`` untimed rounds (the
heap of both processes grows to the new size in them: a copy into pages the heap has not
used yet runs at a fraction of the memory's speed), after which a shared-memory pull reads
an arena made (and mapped by the puller) in the first, as in TEs that have pulled before:
``shm 1st`` is that first pull, through a new mapping, and ``fresh`` a copy into fresh
anonymous pages, what new memory costs on the host.

``piped`` is the same over shared memory as a decode TE pulls: asked for while the prefill
still computes (the layers are written, the pull waits for ``Done``), timed from the
prefill's end (``Outbox.done``, in the server's process) until the KV lies in the puller's
memory (``Done``'s way over, the result, the import's copy); the server answers the parent
only after the release, so nothing else runs meanwhile. What the standalone pull adds on top
is the request's round trip, which a TE's pull makes while the prefill computes.

    scripts/bench-kv-transfer [--tokens 1024,2048,4096,8192,16384] [--repeats 9] [--chunk 512]

Writes bench-results/kv-transfer.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LAYERS, KV_HEADS, HEAD_DIM = 24, 2, 64
TOKEN_BYTES = LAYERS * 2 * KV_HEADS * HEAD_DIM * 2  # bf16
# Each step (the server's writing of an offer, each of the puller's pulls and baselines)
# starts this long after the one before: a torch copy leaves its process's OpenMP team
# spinning for about 10 ms of CPU (libgomp's default GOMP_SPINCOUNT), and on two cores a
# step in that time would share them with the spinning of the step before.
SETTLE_S = 0.02
WARMUP = 3  # untimed rounds per size


def _reply(body: dict[str, Any]) -> None:
    print(json.dumps(body), flush=True)


def _digest(t: Any) -> str:
    import torch
    import xxhash

    return xxhash.xxh3_64_hexdigest(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _install_uvloop() -> None:
    import uvloop

    uvloop.install()


# --- the prefill side (a process) -----------------------------------------------------------


def _server(max_tokens: int, chunk: int) -> int:
    import torch

    from services.task_executor.engines.torch_engine.host_malloc import keep_large_allocations
    from services.task_executor.kv_transport.outbox import Outbox
    from services.task_executor.kv_transport.pool import ArenaPool
    from services.task_executor.kv_transport.server import KvServer

    keep_large_allocations()  # as in a prefill TE
    _install_uvloop()
    g = torch.Generator().manual_seed(0)
    src = torch.randn(LAYERS, 2, max_tokens, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    raw = src.reshape(-1).view(torch.uint8).numpy()
    ended: dict[str, str] = {}
    arenas = ArenaPool()
    plain = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_plain_sender, args=(plain, memoryview(raw)), daemon=True).start()

    async def main() -> None:
        lease_ended = asyncio.Event()

        def on_end(key: str, reason: str) -> None:
            ended[key] = reason
            lease_ended.set()

        server = KvServer(on_end=on_end)
        await server.start()
        _reply({"address": server.address, "plain": f"127.0.0.1:{plain.getsockname()[1]}"})
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                break
            command = json.loads(line)
            if command["op"] == "offer":
                n = int(command["tokens"])
                piped = bool(command.get("piped"))
                box = Outbox(
                    command["key"],
                    num_layers=LAYERS,
                    num_kv_heads=KV_HEADS,
                    head_dim=HEAD_DIM,
                    dtype=torch.bfloat16,
                    num_prompt_tokens=n,
                    lease_s=30.0,
                    arenas=arenas,
                )
                for s in range(0, n, chunk):
                    for layer in range(LAYERS):
                        e = min(s + chunk, n)
                        box.layer(layer, s, src[layer, 0, s:e].clone(), src[layer, 1, s:e].clone())
                digest = _digest(src[:, :, :n])  # (now: it holds the loop for milliseconds)
                if piped:  # the puller is waiting: it is told once the prefill is done
                    server.offer(box)
                    await asyncio.sleep(SETTLE_S)  # its OpenMP threads stop spinning
                    lease_ended.clear()
                    done_at = time.perf_counter()
                    box.done([*range(n), 1], n, None)
                    # The answer waits for the puller's release: nothing of the parent's
                    # (which then asks the puller for its times) runs while it pulls.
                    async with asyncio.timeout(30):
                        while command["key"] not in ended:
                            await lease_ended.wait()
                            lease_ended.clear()
                else:
                    box.done([*range(n), 1], n, None)
                    server.offer(box)
                    done_at = 0.0
                    await asyncio.sleep(SETTLE_S)
                _reply({"digest": digest, "done_at": done_at})
            elif command["op"] == "ended":
                _reply({"reason": ended.get(command["key"])})
        await server.close()

    asyncio.run(main())
    arenas.close()
    return 0


def _plain_sender(listener: socket.socket, raw: memoryview) -> None:
    """The socket baseline's sender: for each 8-byte request ``n``, ``n`` bytes at once."""
    from services.task_executor.kv_transport.wire import SOCKET_BUFFER

    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    while True:
        ask = conn.recv(8, socket.MSG_WAITALL)
        if len(ask) < 8:
            return
        conn.sendall(raw[: int.from_bytes(ask, "little")])


# --- the decode side (a process) ------------------------------------------------------------


def _client() -> int:
    # A TE's process: the engine imported, large allocations from a warm heap.

    import services.task_executor.engines.torch_engine.engine  # noqa: F401
    from services.task_executor.engines.torch_engine.host_malloc import keep_large_allocations
    from services.task_executor.kv_transport.wire import SOCKET_BUFFER

    keep_large_allocations()
    _install_uvloop()
    plain: socket.socket | None = None

    async def main() -> None:  # one loop for every pull, as in a TE
        nonlocal plain
        pulling: asyncio.Task[Any] | None = None
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                return
            command = json.loads(line)
            op = command["op"]
            if op != "pull-finish":  # (which waits for a pull that ends when its Done comes)
                await asyncio.sleep(SETTLE_S)  # no OpenMP team of ours spins from the last step
            if op in ("pull", "pull-start"):
                pulling = asyncio.create_task(_pull_and_import(command))
                if op == "pull-start":  # the offer comes next: the pull waits for its Done
                    await asyncio.sleep(SETTLE_S)  # (it has reached the server)
                    _reply({"started": True})
                    continue
            if op in ("pull", "pull-finish"):
                assert pulling is not None
                answer, kv = await pulling
                pulling = None
                _reply(answer | {"digest": _digest(kv)})
                del kv
            elif op == "socket":
                if plain is None:  # buffers as the transport's (wire.SOCKET_BUFFER)
                    host, _, port = command["address"].rpartition(":")
                    plain = socket.socket()
                    plain.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
                    plain.connect((host, int(port)))
                    plain.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                _reply({"seconds": _plain_receive(plain, int(command["bytes"]))})
            elif op == "memcpy":
                _reply(_memcpy(int(command["bytes"])))

    asyncio.run(main())
    return 0


async def _pull_and_import(command: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """A pull and, over shared memory, the import's copy out of the prefill's arena (as into
    a decode TE's KV cache, which is there already): the times, and the KV."""
    from services.task_executor.kv_transport.client import pull

    started = time.perf_counter()
    p = await pull(
        command["address"],
        command["key"],
        skip_tokens=0,
        deadline_s=60,
        renew_s=1.0,
        shm=command["shm"],
    )
    kv = p.kv
    if p.transport == "shm":
        dest = _warm(p.nbytes, "import")
        kv = dest.view(p.kv.dtype).view(p.kv.shape).copy_(p.kv)
    ended = time.perf_counter()
    answer: dict[str, Any] = {"seconds": ended - started, "pull_seconds": p.seconds}
    answer |= {"ended_at": ended, "nbytes": p.nbytes, "transport": p.transport}
    return answer, kv  # (in place: the lease is released once the result is gone)


def _plain_receive(conn: socket.socket, n: int) -> float:
    """The socket baseline's receiver: ``n`` bytes into a new tensor, the seconds it took."""
    import torch

    t = time.perf_counter()
    buf = torch.empty(n, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    conn.sendall(n.to_bytes(8, "little"))
    got = 0
    while got < n:
        got += conn.recv_into(view[got:])
    return time.perf_counter() - t


_WARM: dict[tuple[int, str], Any] = {}


def _warm(n: int, use: str) -> Any:
    """A buffer of ``n`` bytes for ``use``, written before (made and touched the first time):
    where a copy lands that a process makes again and again, as a TE's KV cache."""
    import torch

    buf = _WARM.get((n, use))
    if buf is None:
        buf = _WARM[n, use] = torch.zeros(n, dtype=torch.uint8)
    return buf


def _memcpy(n: int) -> dict[str, float]:
    """``n`` bytes copied into a warm buffer (``seconds``) and into fresh pages
    (``fresh``)."""
    import torch

    src = torch.ones(n, dtype=torch.uint8)
    dest = _warm(n, "memcpy")
    t = time.perf_counter()
    dest.copy_(src)
    warm = time.perf_counter() - t
    mm = mmap.mmap(-1, n)
    t = time.perf_counter()
    torch.frombuffer(mm, dtype=torch.uint8).copy_(src)
    fresh = time.perf_counter() - t
    mm.close()
    return {"seconds": warm, "fresh_seconds": fresh}


# --- the parent -----------------------------------------------------------------------------


class Proc:
    def __init__(self, *args: str) -> None:
        self.p = subprocess.Popen(
            [sys.executable, "-m", "bench.kv_transport", *args],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def ask(self, body: dict[str, Any]) -> dict[str, Any]:
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write(json.dumps(body) + "\n")
        self.p.stdin.flush()
        return self.answer()

    def answer(self) -> dict[str, Any]:
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.p.args} exited with {self.p.wait()} (its stderr above)")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        if self.p.stdin is not None:
            self.p.stdin.close()
        try:
            self.p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


def _gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def measure(tokens: list[int], repeats: int, chunk: int, max_wait_s: float) -> list[dict[str, Any]]:
    from bench.common import Col, Neighbours, Table

    table = Table(
        [
            Col("tokens", "tokens"),
            Col("mb", "MB", ".1f"),
            Col("shm_gbps", "shm GB/s", ".2f"),
            Col("memcpy_gbps", "memcpy GB/s", ".2f"),
            Col("shm_vs_memcpy", "shm/memcpy", ".0%"),
            Col("shm_pull_ms", "shm pull ms", ".2f"),
            Col("piped_vs_memcpy", "piped/memcpy", ".0%"),
            Col("piped_ms", "piped ms", ".2f"),
            Col("tcp_gbps", "tcp GB/s", ".2f"),
            Col("socket_gbps", "socket GB/s", ".2f"),
            Col("tcp_vs_socket", "tcp/socket", ".0%"),
            Col("shm_first_gbps", "shm 1st GB/s", ".2f"),
            Col("fresh_gbps", "fresh GB/s", ".2f"),
            Col("neighbour_cores", "others' cores", ".2f"),
        ]
    )
    server = Proc("--role", "server", "--max-tokens", str(max(tokens)), "--chunk", str(chunk))
    client = Proc("--role", "client")
    neighbours = Neighbours(lambda: [server.p.pid, client.p.pid])
    rows = []
    try:
        address = server.answer()
        keys = iter(range(1 << 62))
        for n in tokens:
            nbytes = n * TOKEN_BYTES
            kinds = ("shm", "tcp", "piped", "socket", "memcpy")
            times: dict[str, list[float]] = {k: [] for k in kinds}
            firsts: dict[str, float] = {}
            pulls: dict[str, list[float]] = {"shm": [], "tcp": []}  # the pull alone
            fresh: list[float] = []
            neighbours.wait_quiet(max_wait_s=max_wait_s)
            start = neighbours.sample()
            for rep in range(WARMUP + repeats):  # untimed first (but for shm 1st)
                timed = rep >= WARMUP
                for transport in ("shm", "tcp"):
                    seconds, pull_s = _pull_once(
                        server, client, address, f"{transport}-{next(keys)}", n
                    )
                    if timed:
                        times[transport].append(seconds)
                        pulls[transport].append(pull_s)
                    elif rep == 0:
                        firsts[transport] = seconds
                piped = _piped_once(server, client, address, f"piped-{next(keys)}", n)
                if timed:
                    times["piped"].append(piped)
                sock = client.ask({"op": "socket", "address": address["plain"], "bytes": nbytes})
                copy = client.ask({"op": "memcpy", "bytes": nbytes})
                if timed:
                    times["socket"].append(sock["seconds"])
                    times["memcpy"].append(copy["seconds"])
                    fresh.append(copy["fresh_seconds"])
            rate = {k: _gbps(nbytes, v) for k, v in times.items()}
            rows.append(
                {
                    "tokens": n,
                    "mb": nbytes / 1e6,
                    "shm_gbps": rate["shm"],
                    "memcpy_gbps": rate["memcpy"],
                    "shm_vs_memcpy": rate["shm"] / rate["memcpy"],
                    "shm_pull_ms": statistics.median(pulls["shm"]) * 1e3,
                    "piped_vs_memcpy": rate["piped"] / rate["memcpy"],
                    "piped_ms": statistics.median(times["piped"]) * 1e3,
                    "tcp_gbps": rate["tcp"],
                    "socket_gbps": rate["socket"],
                    "tcp_vs_socket": rate["tcp"] / rate["socket"],
                    "shm_first_gbps": nbytes / firsts["shm"] / 1e9,
                    "fresh_gbps": _gbps(nbytes, fresh),
                    "seconds": times,
                    "pull_seconds": pulls,
                    "fresh_seconds": fresh,
                    "neighbour_cores": neighbours.cores_used(start),
                }
            )
            table.row(rows[-1])
    finally:
        server.close()
        client.close()
    return rows


def _piped_once(server: Proc, client: Proc, address: dict[str, Any], key: str, n: int) -> float:
    """A pull over shared memory asked for before the KV is complete, as a decode TE pulls
    while the prefill computes: the seconds from the prefill's end (``Outbox.done``) until
    the KV was in the puller's memory (``Done``'s way over, and the import's copy)."""
    client.ask({"op": "pull-start", "address": address["address"], "key": key, "shm": True})
    offered = server.ask({"op": "offer", "key": key, "tokens": n, "piped": True})
    got = client.ask({"op": "pull-finish"})
    _check(server, key, n, offered["digest"], got, "shm")
    return float(got["ended_at"]) - float(offered["done_at"])


def _check(
    server: Proc, key: str, n: int, digest: str, got: dict[str, Any], transport: str
) -> None:
    """The pulled KV is the source's, over ``transport``, and its lease ended released."""
    if got["digest"] != digest or got["nbytes"] != n * TOKEN_BYTES:
        raise RuntimeError(f"{key}: the pulled KV is not the source's")
    if got["transport"] != transport:
        raise RuntimeError(f"{key}: pulled over {got['transport']}")
    for _ in range(20):  # the release may still be on its way
        ended = server.ask({"op": "ended", "key": key})["reason"]
        if ended is not None:
            break
        time.sleep(0.01)
    if ended != "released":
        raise RuntimeError(f"{key}: the lease ended {ended!r}")


def _pull_once(
    server: Proc, client: Proc, address: dict[str, Any], key: str, n: int
) -> tuple[float, float]:
    """One offer and its pull, checked (bytes, transport, lease); the seconds until the KV
    was in the puller's memory, and those of the pull alone."""
    digest = server.ask({"op": "offer", "key": key, "tokens": n})["digest"]
    transport = key.partition("-")[0]
    pull = {"op": "pull", "address": address["address"], "key": key, "shm": transport == "shm"}
    got = client.ask(pull)
    _check(server, key, n, digest, got, transport)
    return float(got["seconds"]), float(got["pull_seconds"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", default="1024,2048,4096,8192,16384", help="prompt lengths")
    ap.add_argument("--repeats", type=int, default=9, help="timed runs per size (median)")
    ap.add_argument("--chunk", type=int, default=512, help="tokens per layer write")
    ap.add_argument(
        "--quiet-wait", type=float, default=20.0, help="seconds to wait for a quiet host per size"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "bench-results" / "kv-transfer.json")
    ap.add_argument("--role", choices=["server", "client"], help=argparse.SUPPRESS)
    ap.add_argument("--max-tokens", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role == "server":
        return _server(args.max_tokens, args.chunk)
    if args.role == "client":
        return _client()

    from bench.common import numbers, write_result

    tokens = numbers(args.tokens)
    print(
        f"KV of {LAYERS} layers x {KV_HEADS} KV heads x {HEAD_DIM} (bf16, {TOKEN_BYTES} B a token), "
        f"written in chunks of {args.chunk} tokens; medians of {args.repeats}",
        flush=True,
    )
    rows = measure(tokens, args.repeats, args.chunk, args.quiet_wait)
    write_result(
        args.out,
        {
            "bench": "kv-transfer",
            "shape": {
                "layers": LAYERS,
                "kv_heads": KV_HEADS,
                "head_dim": HEAD_DIM,
                "dtype": "bfloat16",
            },
            "chunk": args.chunk,
            "repeats": args.repeats,
            "cpus": os.cpu_count(),
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
