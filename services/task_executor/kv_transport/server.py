"""The prefill side of the KV data plane: a TCP listener decode TEs pull offered outboxes
from, and the leases that decide when an outbox's KV may be freed.

A lease starts at ``offer`` and lasts ``outbox.lease_s`` past the last sign of life from
its puller (the pull request, each renewal); it ends exactly once, with ``on_end(key,
reason)``, which is where the TE frees the task's KV blocks:

- ``"released"``: the puller holds everything and said so;
- ``"rejected: <why>"``: the decode side will not use it;
- ``"disconnected"``: the puller's connection dropped before its release;
- ``"expired"``: no renewal within ``lease_s`` (also when nobody ever connected);
- ``"failed: <why>"``: the outbox failed (``Outbox.fail``), or ``done`` left a range unwritten;
- ``withdraw``'s reason: the TE dropped it;
- ``"closed"``: the server closed.

A connection may carry one pull after another (``connections.py``): after a release the
server answers ``Ok`` and waits up to ``IDLE_S`` for the next ``Pull``, remembering whether
the connection's probe found /dev/shm shared. Any other end of a pull closes it.

One puller per key: a second pull is refused, and so is a pull of a key whose lease has
ended (it is remembered for ``ENDED_MEMORY_S``, to answer with what happened rather than
"unknown"). A puller may arrive before the offer (control messages race): it waits up to
``grace_s`` for the key.

Everything here runs on the event loop the server was started on; ``offer``, ``withdraw``
and ``close`` must be called there. The KV goes out over the puller's connection from that
loop or, to a puller on this host, is read by it in place, in the outbox's arena in /dev/shm
(``pool.py``): the arena is written again only after a lease that ended released.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import socket
from collections.abc import Callable

from services.task_executor.kv_transport import shm, wire
from services.task_executor.kv_transport.outbox import Outbox
from services.task_executor.kv_transport.session import Session
from shared.logging import get_logger

log = get_logger(__name__)

GRACE_S = 2.0  # how long a pull of an unknown key waits for its offer
HELLO_TIMEOUT_S = 10.0  # a connection's first frame
IDLE_S = 120.0  # a kept connection's wait for its next pull (pullers keep them less long)
ENDED_MEMORY_S = 60.0
ENDED_MEMORY_KEYS = 4096


@dataclasses.dataclass(eq=False)
class _Lease:
    outbox: Outbox
    timer: asyncio.TimerHandle | None = None
    taken: bool = False  # a puller came (one per key)
    session: Session | None = None
    reason: str | None = None  # why it ended


class KvServer:
    """Serves offered outboxes to pullers on ``host:port`` (0: a free port)."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        on_end: Callable[[str, str], None],
        grace_s: float = GRACE_S,
    ) -> None:
        self._host, self._port = host, port
        self._on_end = on_end
        self._grace_s = grace_s
        self._leases: dict[str, _Lease] = {}
        # key -> (what a late puller is told, when the lease ended)
        self._ended: collections.OrderedDict[str, tuple[str, float]] = collections.OrderedDict()
        self._offered = asyncio.Event()
        self._handlers: set[asyncio.Task[None]] = set()
        self._idle: set[asyncio.Task[None]] = set()  # handlers waiting on a kept connection
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        infos = await self._loop.getaddrinfo(
            self._host, self._port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, kind, proto, _, addr = infos[0]
        listener = socket.socket(family, kind, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(addr)
            listener.listen(128)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self._accepting = asyncio.create_task(self._accept(), name="kv-server-accept")

    @property
    def address(self) -> str:
        if self._listener is None:
            raise RuntimeError("the KV server has not started")
        host, port = self._listener.getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    # --- the TE's side --------------------------------------------------------------------

    def offer(self, outbox: Outbox) -> None:
        """Serve ``outbox`` under its key; its lease starts now."""
        loop = self._running_loop()
        key = outbox.key
        if key in self._leases:
            raise ValueError(f"KV {key!r} is already offered")
        if self._closed:
            raise RuntimeError("the KV server is closed")
        self._ended.pop(key, None)
        # A lease object per offer: a timer or callback of an earlier lease of the same key
        # finds another object there and does nothing.
        lease = _Lease(outbox)
        self._leases[key] = lease
        self._renew(lease)
        outbox.attach(loop, lambda: self._changed(lease))
        self._offered.set()
        self._offered = asyncio.Event()

    def withdraw(self, key: str, reason: str) -> None:
        """The TE drops ``key`` (its task was cancelled): a puller gets an error, and
        ``on_end(key, reason)`` runs (unless the lease had already ended)."""
        lease = self._leases.get(key)
        if lease is not None:
            self._end(lease, reason, f"withdrawn: {reason}")

    async def close(self) -> None:
        """Stop listening, end every lease (``"closed"``) and drop every connection."""
        self._closed = True
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.gather(self._accepting, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
        for lease in list(self._leases.values()):
            self._end(lease, "closed", "the prefill side is shutting down")
        for task in self._idle:
            task.cancel()
        if self._handlers:
            await asyncio.wait(self._handlers, timeout=2.0)
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    # --- leases ---------------------------------------------------------------------------

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("the KV server has not started")
        return self._loop

    def _expire(self, lease: _Lease) -> None:
        self._end(lease, "expired", "the lease expired (no renewal in time)")

    def _renew(self, lease: _Lease) -> None:
        if self._leases.get(lease.outbox.key) is lease:
            if lease.timer is not None:
                lease.timer.cancel()
            loop = self._running_loop()
            lease.timer = loop.call_later(lease.outbox.lease_s, self._expire, lease)

    def _changed(self, lease: _Lease) -> None:
        if self._leases.get(lease.outbox.key) is not lease:
            return
        failure = lease.outbox.failure
        if failure is not None:
            self._end(lease, f"failed: {failure}", f"the prefill failed: {failure}")
        elif lease.session is not None:
            lease.session.wake()

    def _end(self, lease: _Lease, reason: str, error: str | None) -> None:
        """End ``lease`` (once): forget it, tell its puller ``error`` (if any), free its KV,
        call ``on_end``."""
        key = lease.outbox.key
        if self._leases.get(key) is not lease:
            return
        del self._leases[key]
        lease.reason = reason
        if lease.timer is not None:
            lease.timer.cancel()
        self._remember(key, error or f"the KV is gone ({reason})")
        # The arena is written again only where nobody may still read it: a puller in place
        # that released has read all it will read; a TCP puller's reads were this side's.
        in_place = lease.session is not None and lease.session.in_place
        lease.outbox.discard(reuse=reason == "released" or not in_place)
        if lease.session is not None:
            lease.session.stop(error)
        try:
            self._on_end(key, reason)
        except Exception:
            log.exception("on_end failed", key=key, reason=reason)

    def _remember(self, key: str, text: str) -> None:
        now = self._running_loop().time()
        self._ended[key] = (text, now)
        self._ended.move_to_end(key)
        while self._ended:
            oldest, (_, when) = next(iter(self._ended.items()))
            if len(self._ended) <= ENDED_MEMORY_KEYS and now - when < ENDED_MEMORY_S:
                break
            del self._ended[oldest]

    async def _find(self, key: str) -> _Lease | str:
        """The lease of ``key``, waiting up to the grace for its offer; else why not."""
        loop = self._running_loop()
        deadline = loop.time() + self._grace_s
        while True:
            lease = self._leases.get(key)
            if lease is not None:
                return lease
            if key in self._ended:
                return self._ended[key][0]
            remaining = deadline - loop.time()
            if remaining <= 0 or self._closed:
                return f"no KV under key {key!r} here"
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._offered.wait(), remaining)

    # --- connections ----------------------------------------------------------------------

    async def _accept(self) -> None:
        loop = self._running_loop()
        assert self._listener is not None
        while True:
            try:
                sock, _ = await loop.sock_accept(self._listener)
            except OSError as e:
                log.warning("KV server accept failed", error=str(e))
                await asyncio.sleep(0.1)
                continue
            wire.tune(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, wire.SOCKET_BUFFER)
            task = asyncio.create_task(self._handle(sock), name="kv-server-conn")
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    async def _handle(self, sock: socket.socket) -> None:
        task = asyncio.current_task()
        assert task is not None
        same_host = False  # what this connection's last probe found
        timeout = HELLO_TIMEOUT_S
        try:
            while not self._closed:
                if timeout == IDLE_S:
                    self._idle.add(task)
                try:
                    async with asyncio.timeout(timeout):
                        hello = await wire.recv_from_client(sock)
                finally:
                    self._idle.discard(task)
                if isinstance(hello, wire.Pull):
                    if hello.probe_path is not None and hello.probe is not None:
                        same_host = shm.probe_matches(hello.probe_path, hello.probe)
                        use_shm = same_host
                    else:
                        use_shm = same_host and hello.same_host_as_before
                    if not await self._pull(sock, hello, use_shm):
                        return
                    await wire.send(sock, wire.Ok())  # released: the next pull may follow
                    timeout = IDLE_S
                elif isinstance(hello, wire.Reject):
                    await self._reject(sock, hello)
                    return
                else:
                    await wire.send(sock, wire.Error(f"a {type(hello).__name__} before any pull"))
                    return
        except (OSError, TimeoutError, wire.ProtocolError) as e:
            log.debug("KV server connection failed", error=str(e))
        finally:
            sock.close()

    async def _reject(self, sock: socket.socket, msg: wire.Reject) -> None:
        found = await self._find(msg.key)
        if isinstance(found, str):
            await wire.send(sock, wire.Error(found))
            return
        self._end(found, f"rejected: {msg.reason}", f"rejected by the decode side: {msg.reason}")
        await wire.send(sock, wire.Ok())

    async def _pull(self, sock: socket.socket, msg: wire.Pull, use_shm: bool) -> bool:
        """Serve one pull; whether it ended released (the connection may carry another)."""
        found = await self._find(msg.key)
        if isinstance(found, str):
            await wire.send(sock, wire.Error(found))
            return False
        lease = found
        if lease.taken:
            await wire.send(sock, wire.Error(f"KV {msg.key!r} is already being pulled"))
            return False
        lease.taken = True
        outbox = lease.outbox
        first = min(max(msg.skip_tokens, 0), outbox.num_prompt_tokens)
        arena = outbox.shared_path if use_shm and first < outbox.num_prompt_tokens else None
        self._renew(lease)
        try:
            session = Session(
                sock,
                outbox,
                skip_tokens=first,
                arena=arena,
                on_renew=lambda: self._renew(lease),
                on_end=lambda reason, error: self._end(lease, reason, error),
            )
            lease.session = session
            await session.run()
        finally:
            self._end(lease, "disconnected", None)
        return lease.reason == "released" and session.clean
