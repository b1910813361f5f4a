"""Hosts for the multi-host tests: network namespaces joined by veth links to one bridge,
each link shaped with ``tc`` (a token bucket at the link's rate; a netem delay where the
kernel has netem), and processes started inside a host with ``nsenter``.

Each host also has a mount namespace of its own with a fresh tmpfs on ``/dev/shm``, as two
machines do: what one host's node pool writes there (its weight cache, KV segments) the
others cannot see, so two TEs on different hosts find no shared memory and move KV over
their links. The namespace is kept by a bind mount of its file (as ``ip netns`` keeps a
network namespace); ``nsenter`` enters both.

The bridge has an address in the test's own namespace (the gateway), so the test talks to
the hosts' addresses directly; nothing is routed anywhere else. Cutting a host sets its
link down on the bridge's side: its processes live on, packets to and from it are dropped,
and nobody gets a TCP reset (what a pulled cable or a dead switch port does). Needs root
and ``ip netns``; ``available()`` says why not where they are missing."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def _tc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["tc", *args], check=False, capture_output=True, text=True)


def available() -> str | None:
    """None where network-namespace hosts can be built here, else why not."""
    if os.geteuid() != 0:
        return "needs root to build network namespaces"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        return "needs util-linux (unshare, nsenter)"
    name = f"msprobe{secrets.token_hex(3)}"
    probe = _ip("netns", "add", name, check=False)
    if probe.returncode != 0:
        return f"`ip netns add` fails here: {probe.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


@dataclasses.dataclass
class Host:
    index: int
    netns: str
    address: str
    link: str  # the veth end on the bridge (cut: set down)
    inside: str  # the veth end inside the namespace


@dataclasses.dataclass
class Shaping:
    rate: str = "10gbit"
    delay_ms: float = 0.2
    delayed: bool = False  # netem took the delay (else only the rate is shaped)

    @property
    def rate_bytes_s(self) -> float:
        """``rate`` (tc's syntax: ``10gbit``, ``500mbit``) in bytes a second."""
        m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", self.rate.lower())
        if m is None:
            raise ValueError(f"link rate {self.rate!r}: like 10gbit")
        return float(m[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m[2]] / 8


class Hosts:
    """``n`` hosts on one bridge, at 10.<a>.<b>.1 … n; the test's namespace is .254."""

    def __init__(self, n: int, root: Path, shaping: Shaping | None = None) -> None:
        tag = secrets.token_hex(2)
        a, b = 200 + secrets.randbelow(50), secrets.randbelow(250)
        self.subnet = f"10.{a}.{b}"
        self.bridge = f"ms{tag}br"
        self.gateway = f"{self.subnet}.254"
        self.root = root
        self.shaping = shaping or Shaping()
        self.hosts = [
            Host(i, f"ms{tag}h{i}", f"{self.subnet}.{i + 1}", f"ms{tag}v{i}", f"ms{tag}p{i}")
            for i in range(n)
        ]
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.cut_off: set[int] = set()
        self.mounts = root / "mnt-ns"  # one file per host: its mount namespace

    def _mount_ns(self, i: int) -> Path:
        return self.mounts / f"h{i}"

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def _forward(self, op: str) -> None:
        """Where bridged packets pass iptables (br_netfilter, which Docker loads with a
        FORWARD policy of DROP), let the bridge's own traffic through."""
        if shutil.which("iptables") is None:
            return
        rule = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]
        subprocess.run(["iptables", op, *rule], check=False, capture_output=True)

    def _mount_namespaces(self) -> None:
        """Each host's mount namespace, /dev/shm a tmpfs of its own there. The files that
        keep them must sit on a private mount (unshare refuses others)."""
        self.mounts.mkdir(exist_ok=True)
        subprocess.run(["mount", "--bind", self.mounts, self.mounts], check=True)
        subprocess.run(["mount", "--make-private", self.mounts], check=True)
        for h in self.hosts:
            self._mount_ns(h.index).touch()
            subprocess.run(
                ["unshare", f"--mount={self._mount_ns(h.index)}", "--propagation", "slave",
                 "mount", "-t", "tmpfs", "-o", "mode=1777", f"shm-h{h.index}", "/dev/shm"],
                check=True, capture_output=True,
            )  # fmt: skip

    def _enter(self, i: int) -> list[str]:
        """The command prefix that runs a program inside host ``i``."""
        return ["nsenter", f"--mount={self._mount_ns(i)}",
                f"--net=/run/netns/{self.hosts[i].netns}", "--"]  # fmt: skip

    def up(self) -> Hosts:
        self._mount_namespaces()
        _ip("link", "add", self.bridge, "type", "bridge")
        self._forward("-I")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for h in self.hosts:
            _ip("netns", "add", h.netns)
            _ip("link", "add", h.link, "type", "veth", "peer", "name", h.inside)
            _ip("link", "set", h.inside, "netns", h.netns)
            _ip("link", "set", h.link, "master", self.bridge)
            _ip("link", "set", h.link, "up")
            _ip("-n", h.netns, "addr", "add", f"{h.address}/24", "dev", h.inside)
            _ip("-n", h.netns, "link", "set", h.inside, "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")
            self._shape(h)
        return self

    def _shape(self, h: Host) -> None:
        """Both directions of the host's link: the rate by a token bucket, the delay by
        netem under it where the kernel has netem (half the round trip each way)."""
        s = self.shaping
        for ns, dev in ((h.netns, h.inside), (None, h.link)):
            where = ["-n", ns] if ns else []
            tbf = ["tbf", "rate", s.rate, "burst", "1mb", "latency", "50ms"]
            delay = f"{s.delay_ms / 2:g}ms"
            netem = _tc(*where, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                        "delay", delay)  # fmt: skip
            if netem.returncode == 0:
                s.delayed = True
                tc = _tc(*where, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf)
            else:
                tc = _tc(*where, "qdisc", "add", "dev", dev, "root", *tbf)
            if tc.returncode != 0:
                raise RuntimeError(f"tc could not shape {dev}: {tc.stderr.strip()}")

    def cut(self, i: int) -> None:
        _ip("link", "set", self.hosts[i].link, "down")
        self.cut_off.add(i)

    def heal(self, i: int) -> None:
        _ip("link", "set", self.hosts[i].link, "up")
        self.cut_off.discard(i)

    def reachable(self) -> list[Host]:
        return [h for h in self.hosts if h.index not in self.cut_off]

    def spawn(
        self,
        i: int,
        name: str,
        argv: Sequence[str],
        env: dict[str, str],
        log_dir: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """``argv`` inside host ``i``, its output in ``<log_dir or root>/h<i>-<name>.log``."""
        log = ((log_dir or self.root) / f"h{i}-{name}.log").open("ab")
        proc = subprocess.Popen(
            [*self._enter(i), *argv],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=self.root,  # what a server writes (a replica's RDB) stays in the test's dir
        )
        log.close()
        self.procs.append((f"h{i}-{name}", proc))
        return proc

    def run(self, i: int, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        """``argv`` inside host ``i``, to its end (its own /dev/shm, its addresses)."""
        return subprocess.run([*self._enter(i), *argv], check=False, capture_output=True, text=True)

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def stop_processes(self) -> None:
        """Every process started in the hosts, and whatever they started there, stopped; the
        hosts stay up for the next."""
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for _, proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(deadline - time.monotonic(), 0.1))
            if proc.poll() is None:
                self.kill(proc)
        for h in self.hosts:
            # Whatever still runs in the namespace (a TE a node pool started) goes with it.
            pids = _ip("netns", "pids", h.netns, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        self.procs.clear()
        for i in list(self.cut_off):
            self.heal(i)

    def down(self) -> None:
        """Everything ``up`` made (or the part of it a failed ``up`` made), whatever fails."""
        try:
            self.stop_processes()
        finally:
            for h in self.hosts:
                _ip("netns", "del", h.netns, check=False)
            _ip("link", "del", self.bridge, check=False)
            self._forward("-D")
            for path in [*(self._mount_ns(h.index) for h in self.hosts), self.mounts]:
                # A host's mount namespace (and its /dev/shm) goes with its last process.
                subprocess.run(["umount", "-l", path], check=False, capture_output=True)

    def log(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""
