"""The transport that runs a broadcast schedule (``multicast``: lambda-Scale's binomial
pipeline, or the one-source fan-out) between processes over TCP, so that N task executors
scaling one model at once get its bytes from each other instead of N copies from one source.

Every node (node 0 the source, receivers 1..N) calls ``run_node`` with the same schedule and
the same list of addresses. A node's bytes are one buffer (``BlockStore``) cut into blocks of
``block_bytes``; from the schedule it takes

- its sends, in step order: it sends each block as soon as it holds it and its previous send
  is done (one thread, so at most one send at a time, as the schedule's model says), over one
  persistent connection per receiver it sends to;
- its receives, grouped by sender: one thread per incoming connection reads that sender's
  blocks in step order into the buffer, checks each and marks it held (a ``threading.Event``
  per block), which is what lets the sender thread forward it while others still arrive.

There is no barrier per step: the pipelining comes from forwarding blocks as they land. The
schedule only ever sends a block its sender holds from an earlier step, so every wait ends.

A connection opens with the sender's node number (4 bytes, big-endian) and the run's tag (8
bytes: ``run_tag`` of the run's name, addresses and block layout). A receiver drops a
connection whose tag is another run's (a sender left over from an earlier, failed multicast
to the same listener) and goes on waiting for its own senders. Each block on a connection is
a header (block index: 4 bytes, length: 8 bytes, big-endian), the payload, and the xxh3-64
digest of the payload (8 bytes). Payloads go out with ``sendall`` from views of the buffer
and come in with ``recv_into`` straight into it: no copies in Python. ``TCP_NODELAY``, as in
``transfer.py``: a digest after a large payload must not wait for a delayed ACK. A receiver
keeps the digest it checked, so a forwarder hashes nothing again. A failed digest, a sender
that closes early or sends the wrong block, or ``timeout`` seconds without progress raises
``RelayError``; the node then closes its connections, so its peers fail fast too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import struct
import threading
import time
from collections.abc import Callable, Collection, Sequence

import xxhash

from services.task_executor.weight_cache.multicast import Transfer, check_schedule

HELLO = struct.Struct("!I8s")  # the sender's node number, the run's tag (``run_tag``)
HEADER = struct.Struct("!IQ")  # block index, payload length
DIGEST = 8  # xxh3-64, big-endian
_POLL_S = 0.05  # how often a blocked wait looks for a failure elsewhere in the node


class RelayError(Exception):
    """A broadcast that failed on this node (checksum, connection, protocol, timeout)."""


def block_count(size: int, block_bytes: int) -> int:
    """Blocks of ``block_bytes`` (the last one shorter) that ``size`` bytes make (at least 1)."""
    if block_bytes < 1 or size < 0:
        raise ValueError(f"bad sizes: {size=}, {block_bytes=}")
    return max(1, -(-size // block_bytes))


class BlockStore:
    """One node's copy of the bytes: ``buffer`` cut into blocks ``[i * block_bytes, …)``, and
    which blocks it holds. ``full``: it holds all of them already (the source)."""

    def __init__(
        self, buffer: bytes | bytearray | memoryview, block_bytes: int, *, full: bool = False
    ) -> None:
        self.view = memoryview(buffer).cast("B")
        if not full and self.view.readonly:
            raise ValueError("a receiver's buffer must be writable")
        self.size = len(self.view)
        self.block_bytes = block_bytes
        self.blocks = block_count(self.size, block_bytes)
        self._held = [threading.Event() for _ in range(self.blocks)]
        self._digests: list[bytes | None] = [None] * self.blocks
        if full:
            for event in self._held:
                event.set()

    def block(self, i: int) -> memoryview:
        return self.view[i * self.block_bytes : (i + 1) * self.block_bytes]

    def holds(self, i: int) -> bool:
        return self._held[i].is_set()

    def holds_all(self) -> bool:
        return all(e.is_set() for e in self._held)

    def wait(self, i: int, timeout: float) -> bool:
        return self._held[i].wait(timeout)

    def digest(self, i: int) -> bytes:
        """Block ``i``'s xxh3-64 digest: the one it arrived with, else computed once."""
        digest = self._digests[i]
        if digest is None:
            digest = self._digests[i] = xxhash.xxh3_64_digest(self.block(i))
        return digest

    def put(self, i: int, digest: bytes) -> None:
        """Block ``i`` is in the buffer and checked against ``digest``: held from now on."""
        self._digests[i] = digest
        self._held[i].set()


@dataclasses.dataclass(frozen=True, slots=True)
class NodeStats:
    """What one node did. Times are ``time.monotonic()`` (one clock for every process of a
    host): ``started`` when ``run_node`` was called, ``first_byte`` when the first payload
    byte arrived, ``held_all`` when it held every block (the source: at the start),
    ``finished`` when its last send was done too."""

    node: int
    started: float
    first_byte: float | None
    held_all: float
    finished: float
    bytes_sent: int
    bytes_received: int
    blocks_sent: int
    blocks_received: int


def run_tag(name: str, addresses: Sequence[str], store: BlockStore) -> bytes:
    """8 bytes that name one run: every node of it computes the same, and a run of another
    model, other nodes or another block layout a different one."""
    text = "\0".join([name, *addresses, str(store.size), str(store.block_bytes)])
    return xxhash.xxh3_64_digest(text.encode())


def listen(address: str = "127.0.0.1:0") -> socket.socket:
    """A listening socket on ``host:port`` (port 0: a free one; ``address_of`` says which)."""
    host, port = _split(address)
    return socket.create_server((host, port), backlog=64)


def address_of(listener: socket.socket) -> str:
    host, port = listener.getsockname()[:2]
    return f"{host}:{port}"


def run_node(
    node: int,
    schedule: Sequence[Sequence[Transfer]],
    addresses: Sequence[str],
    store: BlockStore,
    *,
    listener: socket.socket | None = None,
    timeout: float = 60.0,
    corrupt: Collection[int] = (),
    name: str = "",
) -> NodeStats:
    """Play ``node``'s part of ``schedule`` (node ``k`` listens on ``addresses[k]``; there
    are ``len(addresses) − 1`` receivers) until it holds every block and made all its sends.

    ``listener``: this node's listening socket, already bound (``listen``), so that peers can
    connect before this call; without one, ``addresses[node]`` is bound for the call (peers
    that connect too early are retried until ``timeout``). ``timeout``: seconds any one wait
    (for a block, a connection, bytes) may take. ``corrupt`` (tests): blocks this node sends
    with a wrong digest. ``name``: the run's name (the model), which every node passes alike;
    with the addresses and the layout it makes the tag that tells this run's connections
    from a stale one's. ``RelayError`` on any failure."""
    check_schedule(schedule, len(addresses) - 1, store.blocks)
    started = time.monotonic()
    sends = [t for step in schedule for t in step if t.sender == node]
    expected: dict[int, list[int]] = {}
    for step in schedule:
        for t in step:
            if t.receiver == node:
                expected.setdefault(t.sender, []).append(t.block)
    receives = sum(len(b) for b in expected.values())
    run = _Run(node, store, timeout, receives, run_tag(name, addresses, store))
    own = listener is None and bool(expected)
    if listener is None and expected:
        listener = listen(addresses[node])
    threads: list[threading.Thread] = []
    try:
        if expected:
            assert listener is not None
            acceptor = threading.Thread(
                target=run.guard, args=(run.accept, listener, expected), name=f"relay-{node}"
            )
            acceptor.start()
            threads.append(acceptor)
        run.guard(run.send, sends, addresses, set(corrupt))
        run.wait_held(expected)
        for thread in threads:
            thread.join()
        for thread in run.readers:
            thread.join()
    finally:
        run.close()
        for thread in (*threads, *run.readers):
            thread.join(timeout)
        if own and listener is not None:
            listener.close()
    if run.error is not None:
        raise run.error
    return NodeStats(
        node=node,
        started=started,
        first_byte=run.first_byte,
        held_all=run.held_all or started,
        finished=time.monotonic(),
        bytes_sent=run.bytes_sent,
        bytes_received=run.bytes_received,
        blocks_sent=len(sends),
        blocks_received=receives,
    )


class _Run:
    """One ``run_node`` call's shared state: its connections, counters and first failure."""

    def __init__(
        self, node: int, store: BlockStore, timeout: float, receives: int, tag: bytes
    ) -> None:
        self.node, self.store, self.timeout, self.tag = node, store, timeout, tag
        self.stray = 0  # connections of another run, dropped
        self._receives_left = receives
        self.error: RelayError | None = None
        self.failed = threading.Event()
        self.readers: list[threading.Thread] = []
        self.first_byte: float | None = None
        self.held_all: float | None = None
        self.bytes_sent = self.bytes_received = 0
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []

    def guard(self, fn: Callable[..., None], *args: object) -> None:
        """``fn(*args)``, its failure recorded (the first one is the cause) and every
        connection of the node closed so that blocked threads and peers stop."""
        try:
            fn(*args)
        except Exception as e:
            error = e if isinstance(e, RelayError) else RelayError(f"node {self.node}: {e!r}")
            with self._lock:
                if self.error is None:
                    self.error = error
                self.failed.set()
            self.close()

    def close(self) -> None:
        with self._lock:
            socks, self._socks = self._socks, []
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _untrack(self, sock: socket.socket) -> None:
        with self._lock:
            if sock in self._socks:
                self._socks.remove(sock)
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()

    def _track(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(self.timeout)
        with self._lock:
            if self.failed.is_set():
                sock.close()
                raise RelayError(f"node {self.node}: stopped")
            self._socks.append(sock)

    # --- sending ---------------------------------------------------------------------------

    def send(self, sends: list[Transfer], addresses: Sequence[str], corrupt: set[int]) -> None:
        conns: dict[int, socket.socket] = {}
        for t in sends:  # every connection first: receivers accept while blocks still come
            if t.receiver not in conns:
                conns[t.receiver] = self._connect(t.receiver, addresses[t.receiver])
        header = bytearray(HEADER.size)
        for t in sends:
            self._wait_block(t)
            payload = self.store.block(t.block)
            digest = self.store.digest(t.block)
            if t.block in corrupt:
                digest = bytes(b ^ 0xFF for b in digest)
            HEADER.pack_into(header, 0, t.block, len(payload))
            sock = conns[t.receiver]
            try:
                sock.sendall(header)
                sock.sendall(payload)
                sock.sendall(digest)
            except OSError as e:
                raise RelayError(
                    f"node {self.node}: sending block {t.block} to node {t.receiver}: {e}"
                ) from e
            self.bytes_sent += len(payload)
        for sock in conns.values():  # everything sent: let the receivers see the end
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)

    def _connect(self, receiver: int, address: str) -> socket.socket:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                sock = socket.create_connection(_split(address), timeout=self.timeout)
                break
            except ConnectionRefusedError as e:  # not listening yet
                if time.monotonic() > deadline or self.failed.wait(0.01):
                    raise RelayError(
                        f"node {self.node}: node {receiver} at {address} refuses connections"
                    ) from e
            except OSError as e:
                raise RelayError(f"node {self.node}: connecting to node {receiver}: {e}") from e
        self._track(sock)
        sock.sendall(HELLO.pack(self.node, self.tag))
        return sock

    def _wait_block(self, t: Transfer) -> None:
        deadline = time.monotonic() + self.timeout
        while not self.store.wait(t.block, _POLL_S):
            if self.failed.is_set():
                raise RelayError(f"node {self.node}: stopped")
            if time.monotonic() > deadline:
                raise RelayError(
                    f"node {self.node}: block {t.block} (for node {t.receiver}) never arrived"
                )

    # --- receiving -------------------------------------------------------------------------

    def accept(self, listener: socket.socket, expected: dict[int, list[int]]) -> None:
        """Every sender's connection, each read on a thread of its own."""
        waiting = set(expected)
        listener.settimeout(_POLL_S)
        deadline = time.monotonic() + self.timeout
        while waiting:
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                if self.failed.is_set():
                    return
                if time.monotonic() > deadline:
                    raise RelayError(
                        f"node {self.node}: nodes {sorted(waiting)} never connected"
                    ) from None
                continue
            self._track(sock)
            hello = bytearray(HELLO.size)
            self._read(sock, memoryview(hello), "its node number", None)
            sender, tag = HELLO.unpack(hello)
            if tag != self.tag:  # a sender of an earlier run to this listener
                self.stray += 1
                self._untrack(sock)
                continue
            if sender not in waiting:
                raise RelayError(f"node {self.node}: unexpected connection from node {sender}")
            waiting.discard(sender)
            reader = threading.Thread(
                target=self.guard,
                args=(self.receive, sock, sender, expected[sender]),
                name=f"relay-{self.node}-from-{sender}",
            )
            reader.start()
            self.readers.append(reader)

    def receive(self, sock: socket.socket, sender: int, blocks: list[int]) -> None:
        header = bytearray(HEADER.size)
        digest = bytearray(DIGEST)
        for want in blocks:
            self._read(sock, memoryview(header), f"the header of block {want}", sender)
            block, length = HEADER.unpack(header)
            into = self.store.block(want)
            if block != want or length != len(into):
                raise RelayError(
                    f"node {self.node}: node {sender} sent block {block} of {length} bytes, "
                    f"expected block {want} of {len(into)}"
                )
            self._read(sock, into, f"block {want}", sender, payload=True)
            self._read(sock, memoryview(digest), f"the digest of block {want}", sender)
            got = xxhash.xxh3_64_digest(into)
            if got != bytes(digest):
                raise RelayError(
                    f"node {self.node}: block {want} from node {sender} failed its checksum "
                    f"(xxh3-64 {got.hex()}, sent {bytes(digest).hex()})"
                )
            self.store.put(want, got)
            with self._lock:
                self.bytes_received += length
                self._receives_left -= 1
                if not self._receives_left:
                    self.held_all = time.monotonic()

    def _read(
        self,
        sock: socket.socket,
        into: memoryview,
        what: str,
        sender: int | None,
        *,
        payload: bool = False,
    ) -> None:
        done = 0
        peer = "a peer" if sender is None else f"node {sender}"
        while done < len(into):
            try:
                n = sock.recv_into(into[done:], len(into) - done)
            except OSError as e:
                if self.failed.is_set():
                    raise RelayError(f"node {self.node}: stopped") from e
                raise RelayError(f"node {self.node}: reading {what} from {peer}: {e}") from e
            if not n:
                raise RelayError(f"node {self.node}: {peer} closed the connection before {what}")
            if payload and self.first_byte is None:
                self.first_byte = time.monotonic()
            done += n

    def wait_held(self, expected: dict[int, list[int]]) -> None:
        """Until every block the schedule brings this node is held (or the node failed)."""
        for blocks in expected.values():
            for block in blocks:
                while not self.store.wait(block, _POLL_S):
                    if self.failed.is_set():
                        return


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)
