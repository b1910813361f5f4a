"""Weights over TCP: a node pool serves its host cache's entries to TEs on other hosts, so a
model can be forked from where it already runs (DeepServe §6) instead of read from disk.

The protocol is a request line of JSON, answered by a line of JSON and, for an entry, its
file in chunks of ``CHUNK`` bytes, each followed by the xxh3-64 digest of its bytes (8 bytes,
big-endian):

- ``{"op": "fingerprints", "model": M}`` -> ``{"fingerprints": {name: fp}}`` (the checkpoint
  tensors' fingerprints of a model loaded on that host, so the receiver can name the entries
  it needs without reading its own copy of the checkpoint), or ``{"error": ...}``;
- ``{"op": "get", "key": K}`` -> ``{"size": n}`` then the entry's bytes, or ``{"error": ...}``;
- ``{"op": "manifest", "model": M}`` -> ``{"keys": [...], "sizes": [...], "fingerprints":
  {...}}``: the entries of a model the cache holds whole, in the order of its image (their
  files one after another), for a multicast;
- ``{"op": "multicast", "model": M, "nodes": [...], "block_bytes": B}`` -> ``{"started":
  true}``: the server sends the model's image as node 0 of lambda-Scale's binomial pipeline
  to ``nodes[1:]`` (``relay.py``; ``nodes[0]`` is its own relay listener, ``relay_address``).

The receiver reads an entry into its own memory, checking every chunk as it arrives; a
torn or corrupted transfer never becomes a tensor: the load builds it from the checkpoint
instead (``ForkError``, logged by the cache session), and only a whole, checked entry is
stored into the receiver's cache (after the load, like what a load builds). One connection
serves many requests; the server answers each connection on a thread of its own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import socketserver
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash

from services.task_executor.weight_cache import relay
from services.task_executor.weight_cache.index import SUFFIX, entry_path, entry_size, read_index
from services.task_executor.weight_cache.multicast import binomial_pipeline

log = logging.getLogger(__name__)

CHUNK = 4 << 20
DIGEST = 8


class ForkError(Exception):
    """A transfer that failed (connection, checksum): load from disk."""


class MissingEntry(ForkError):
    """The server does not hold that entry (the rest may still come from it)."""


def _digest(data: memoryview | bytes) -> bytes:
    return xxhash.xxh3_64_digest(data)


class _Handler(socketserver.StreamRequestHandler):
    server: WeightServer
    # A chunk's small digest must not wait for the chunk's ACK (Nagle's algorithm against
    # the receiver's delayed ACK: 40 ms a chunk).
    disable_nagle_algorithm = True

    def handle(self) -> None:
        for line in self.rfile:
            try:
                request = json.loads(line)
                if request.get("op") == "fingerprints":
                    self._reply(self.server.fingerprints(str(request["model"])))
                elif request.get("op") == "get":
                    self._send_entry(str(request["key"]))
                elif request.get("op") == "manifest":
                    self._reply(self.server.manifest(str(request["model"])))
                elif request.get("op") == "multicast":
                    self._reply(self.server.multicast(request))
                else:
                    self._reply({"error": f"unknown op {request.get('op')!r}"})
            except (ValueError, KeyError) as e:
                self._reply({"error": f"bad request: {e}"})
            except OSError:  # the client went away
                return

    def _reply(self, body: dict[str, Any]) -> None:
        self.wfile.write(json.dumps(body).encode() + b"\n")
        self.wfile.flush()

    def _send_entry(self, key: str) -> None:
        path = self.server.entry(key)
        if path is None:
            self._reply({"error": "bad key"})
            return
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._reply({"error": f"no entry {key}", "missing": True})
            return
        try:
            size = os.fstat(fd).st_size
            self._reply({"size": size})
            # Through one reused buffer (pread, then send): mapping the file instead costs a
            # page fault per 4 KiB page, which on this project's VMs halves the rate.
            buf = bytearray(min(CHUNK, size) or 1)
            view = memoryview(buf)
            for start in range(0, size, CHUNK):
                n = os.preadv(fd, [view[: min(CHUNK, size - start)]], start)
                chunk = view[:n]
                self.wfile.write(chunk)
                self.wfile.write(self.server.corrupt(_digest(chunk)))
            self.wfile.flush()
        finally:
            os.close(fd)


class WeightServer(socketserver.ThreadingTCPServer):
    """Serves the cache directory ``root`` (a ``HostWeightCache``'s) on ``host:port`` (0: a
    free port; ``address`` says which)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, root: Path, host: str = "127.0.0.1", port: int = 0) -> None:
        self.root = root
        self.corrupt_chunks = 0  # tests: that many chunk digests are sent wrong
        super().__init__((host, port), _Handler)
        self._thread: threading.Thread | None = None
        self._relay = relay.listen(f"{host}:0")  # node 0 of its multicasts
        self._relay_lock = threading.Lock()  # one multicast at a time

    @property
    def relay_address(self) -> str:
        return relay.address_of(self._relay)

    @property
    def address(self) -> str:
        host, port = self.server_address[:2]
        return f"{host!s}:{port}"

    def start(self) -> WeightServer:
        self._thread = threading.Thread(target=self.serve_forever, name="weight-server")
        self._thread.daemon = True
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        self._relay.close()

    def manifest(self, model: str) -> dict[str, Any]:
        index = read_index(self.root)
        entry = index["models"].get(model)
        if entry is None:
            return {"error": f"model {model} was never loaded here", "missing": True}
        keys = list(dict.fromkeys(entry["keys"]))
        sizes = [entry_size(entry_path(self.root, k)) for k in keys]
        if not all(sizes):
            return {"error": f"the cache here no longer holds all of {model}", "missing": True}
        return {"keys": keys, "sizes": sizes, "fingerprints": entry["fingerprints"]}

    def multicast(self, request: dict[str, Any]) -> dict[str, Any]:
        """Start sending ``request["model"]``'s image as node 0 of the pipeline, on a thread;
        the receivers' failures are theirs (they fall back), this side only logs."""
        manifest = self.manifest(str(request["model"]))
        if "error" in manifest:
            return manifest
        nodes = [str(n) for n in request["nodes"]]
        block_bytes = int(request["block_bytes"])
        image = bytearray()
        for key in manifest["keys"]:
            image += entry_path(self.root, key).read_bytes()
        store = relay.BlockStore(image, block_bytes, full=True)
        schedule = binomial_pipeline(len(nodes) - 1, store.blocks)

        def send() -> None:
            with self._relay_lock:
                try:
                    relay.run_node(
                        0, schedule, nodes, store, listener=self._relay, name=str(request["model"])
                    )
                except relay.RelayError as e:
                    log.warning("multicast of %s failed: %s", request["model"], e)

        threading.Thread(target=send, name="weight-multicast", daemon=True).start()
        return {"started": True, "bytes": len(image)}

    def entry(self, key: str) -> Path | None:
        return self.root / "tensors" / f"{key}{SUFFIX}" if key.isalnum() else None

    def fingerprints(self, model: str) -> dict[str, Any]:
        try:
            index = json.loads((self.root / "index.json").read_text())
            fps = index["models"][model]["fingerprints"]
        except (OSError, ValueError, KeyError):
            return {"error": f"model {model} was never loaded here"}
        return {"fingerprints": fps}

    def corrupt(self, digest: bytes) -> bytes:
        if self.corrupt_chunks > 0:
            self.corrupt_chunks -= 1
            return bytes(b ^ 0xFF for b in digest)
        return digest


class WeightPeer:
    """A client of one ``WeightServer`` (``host:port``); one connection, used by one thread."""

    def __init__(self, address: str, timeout: float = 30.0) -> None:
        self.address = address
        self._timeout = timeout
        self._sock: socket.socket | None = None
        self._file: Any = None
        self.fetched_bytes = 0

    def _connect(self) -> None:
        if self._sock is None:
            host, _, port = self.address.rpartition(":")
            self._sock = socket.create_connection((host, int(port)), timeout=self._timeout)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._file = self._sock.makefile("rwb", buffering=1 << 20)

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._file.close()
                self._sock.close()
        self._sock = self._file = None

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        try:
            self._connect()
            self._file.write(json.dumps(request).encode() + b"\n")
            self._file.flush()
            line = self._file.readline()
        except OSError as e:
            self.close()
            raise ForkError(f"weight server {self.address}: {e}") from e
        if not line:
            self.close()
            raise ForkError(f"weight server {self.address} closed the connection")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            if reply.get("missing"):
                raise MissingEntry(f"weight server {self.address}: {reply['error']}")
            raise ForkError(f"weight server {self.address}: {reply['error']}")
        return reply

    def fingerprints(self, model: str) -> dict[str, str]:
        fps: dict[str, str] = self._ask({"op": "fingerprints", "model": model})["fingerprints"]
        return fps

    def manifest(self, model: str) -> dict[str, Any]:
        return self._ask({"op": "manifest", "model": model})

    def start_multicast(self, model: str, nodes: list[str], block_bytes: int) -> None:
        self._ask({"op": "multicast", "model": model, "nodes": nodes, "block_bytes": block_bytes})

    def fetch_into(self, key: str, alloc: Callable[[int], memoryview]) -> memoryview:
        """The entry ``key`` into the buffer ``alloc(size)`` returns (a whole tensor file's
        image), checked chunk by chunk; ``ForkError`` on any failure."""
        size = int(self._ask({"op": "get", "key": key})["size"])
        into = alloc(size)
        digest = bytearray(DIGEST)
        for i, start in enumerate(range(0, size, CHUNK)):
            chunk = into[start : start + CHUNK]
            try:
                _read_exactly(self._file, chunk)
                _read_exactly(self._file, memoryview(digest))
            except (OSError, EOFError) as e:
                self.close()
                raise ForkError(f"weight server {self.address}: {key}: {e}") from e
            if _digest(chunk) != bytes(digest):
                self.close()  # the rest of the entry is still on the wire
                raise ForkError(f"{key} from {self.address}: chunk {i} failed its checksum")
        self.fetched_bytes += size
        return into


def _read_exactly(f: Any, into: memoryview) -> None:
    done = 0
    while done < len(into):
        n = f.readinto(into[done:])
        if not n:
            raise EOFError("connection closed mid-entry")
        done += n
