"""The decode side's kept connections to prefill TEs, one pull at a time on each.

Opening a connection for every pull costs a TCP handshake, the server's accept and, for
shared memory, the same-host probe (a file written in /dev/shm, read by the server): about
a millisecond on this project's VMs, as long as copying a 1k-token prompt's KV. So a pull
that completed hands its connection back: once the server has acknowledged the release
(``Ok``: the lease ended as released, nothing more will come on it), the connection waits
here for the next pull to the same address, which skips the handshake and, where the first
pull proved both ends share /dev/shm, the probe (the server remembers that per connection).

A connection is kept only after a clean release; any failure closes it (a pull that failed
may have left frames in flight). One that waited too long, or that the server closed
meanwhile (it is readable: data or the end of the stream where nothing is due), is closed
instead of used. Event-loop thread only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time

from services.task_executor.kv_transport import wire
from services.task_executor.kv_transport.per_loop import PerLoop

IDLE_S = 30.0  # how long a connection waits for its next pull (the server waits longer)
PER_ADDRESS = 4  # the most idle connections kept to one address
ACK_TIMEOUT_S = 5.0  # the server's Ok after a release


@dataclasses.dataclass(eq=False)
class Connection:
    """A connection to ``address``; ``same_host``: what the server found the last time this
    connection asked (None: never asked)."""

    address: str
    sock: socket.socket
    same_host: bool | None = None
    reused: bool = False  # it served a pull before this one
    idle_since: float = 0.0

    def close(self) -> None:
        self.sock.close()


class Connections:
    """Idle connections by address."""

    def __init__(self, *, idle_s: float = IDLE_S, per_address: int = PER_ADDRESS) -> None:
        self.idle_s, self.per_address = idle_s, per_address
        self._idle: dict[str, list[Connection]] = {}
        self._acks: set[asyncio.Task[None]] = set()
        self.opened = self.reused = 0

    async def get(self, address: str) -> Connection:
        """An idle connection to ``address`` that is still open, else a new one
        (``OSError`` if it cannot be made)."""
        now = time.monotonic()
        idle = self._idle.get(address, [])
        while idle:
            conn = idle.pop()  # the most recently used
            if now - conn.idle_since <= self.idle_s and _quiet(conn.sock):
                conn.reused = True
                self.reused += 1
                return conn
            conn.close()
        self.opened += 1
        return Connection(address, await wire.connect(address))

    def released(self, conn: Connection) -> None:
        """``conn``'s pull sent its release: keep it once the server acknowledges."""
        task = asyncio.create_task(self._await_ack(conn), name=f"kv-ack-{conn.address}")
        self._acks.add(task)
        task.add_done_callback(self._acks.discard)

    async def _await_ack(self, conn: Connection) -> None:
        try:
            async with asyncio.timeout(ACK_TIMEOUT_S):
                msg, _ = await wire.recv_from_server(conn.sock)
        except (OSError, wire.ProtocolError):  # TimeoutError is an OSError
            conn.close()
            return
        if not isinstance(msg, wire.Ok):
            conn.close()
            return
        idle = self._idle.setdefault(conn.address, [])
        self._drop_stale(idle)
        if len(idle) >= self.per_address:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def _drop_stale(self, idle: list[Connection]) -> None:
        now = time.monotonic()
        for conn in [c for c in idle if now - c.idle_since > self.idle_s]:
            idle.remove(conn)
            conn.close()

    @property
    def idle(self) -> int:
        return sum(len(v) for v in self._idle.values())

    def close(self) -> None:
        for task in self._acks:
            task.cancel()
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


def _quiet(sock: socket.socket) -> bool:
    """Open, with nothing to read: nothing is due on an idle connection, so data or the end
    of the stream means the server closed it (or broke the protocol)."""
    try:
        sock.recv(1, socket.MSG_PEEK)
    except (BlockingIOError, InterruptedError):
        return True
    except OSError:
        return False
    return False


_BY_LOOP = PerLoop(Connections)


def default_connections() -> Connections:
    """The running event loop's kept connections (a TE pulls on one loop)."""
    return _BY_LOOP.get()
