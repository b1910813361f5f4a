"""The servers a benchmark starts: one process tree (``Server``: vLLM's OpenAI server, a
meshserve process) and the one launcher of a meshserve cluster (``LocalCluster``).

``LocalCluster`` runs ``meshserve up`` (``python -m services.cli up``, and optionally a second
node pool) as child processes, under a cluster name of its own, on the NATS and Redis the
bench runs with (or servers of its own):

    with LocalCluster("combined", models, pool_size=3, settings={"ROUTING": "combined"},
                      log=work / "combined.log") as cluster:
        cluster.wait(lambda health: ...)
        replay(cluster.url, ...)
        text = cluster.metrics()

or, where the caller decides when it stops, ``url = cluster.start()`` … ``cluster.stop(45)``.
``settings`` are MESHSERVE_* variables without their prefix, ``env`` any other variables
(full names, set last); the cluster's processes get them through
``settings.process_environment``, like any child of the project. The launcher's stderr goes
to ``log``, its stdout (where it prints the API's URL) beside it with the suffix ``.out``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.common import ROOT
from shared.embedded import die_with_parent, free_port
from shared.settings import Settings, process_environment


def _stderr(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


# --- one process tree -----------------------------------------------------------------------


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, start time) for every process visible in /proc."""
    table: dict[int, tuple[int, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        table[int(entry)] = (int(fields[1]), fields[19])
    return table


class Server:
    """One server process tree. Its stderr goes to ``log``, its stdout to ``stdout`` (by
    default ``log`` with the suffix .out; the same path: one file). The files are emptied
    first unless ``fresh`` is false, and always appended to, so that several processes can
    share one. stop() signals the leader, waits, then kills whatever of the tree (as last
    seen, checked by start time so a reused pid is never hit) is still there."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: dict[str, str],
        log: Path,
        *,
        signal_group: bool,
        stdout: Path | None = None,
        fresh: bool = True,
        say: Callable[[str], None] = _stderr,
    ) -> None:
        self.name = name
        # True: SIGTERM goes to the whole process group (vLLM's engine core and worker);
        # False: to the leader only, which stops its children in order (meshserve up).
        self.signal_group = signal_group
        self.say = say
        self.log_path = log
        self.stdout_path = stdout or log.with_suffix(".out")
        if fresh:
            for path in {self.log_path, self.stdout_path}:
                path.write_bytes(b"")
        self._log = open(self.log_path, "ab")
        self._out = self._log if self.stdout_path == self.log_path else open(self.stdout_path, "ab")
        self.started = time.monotonic()
        # Own session: a terminal's Ctrl-C reaches only the bench, which then stops the
        # server in order; die_with_parent covers the bench being killed outright.
        self.proc = subprocess.Popen(
            list(argv),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._out,
            stderr=self._log,
            start_new_session=True,
            preexec_fn=die_with_parent,
            cwd=ROOT,
        )
        self._tree: dict[int, str] = {}
        self.snapshot()

    def pids(self) -> list[int]:
        """The tree as it is now (and every pid it had, some perhaps gone)."""
        self.snapshot()
        return list(self._tree)

    def snapshot(self) -> None:
        table = _proc_table()
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        todo = [self.proc.pid]
        while todo:
            pid = todo.pop()
            if pid in table:
                self._tree[pid] = table[pid][1]
            todo += children.get(pid, [])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 30) -> str:
        lines: list[str] = []
        for path in dict.fromkeys((self.stdout_path, self.log_path)):
            with contextlib.suppress(OSError):
                lines += path.read_text(errors="replace").splitlines()[-n:]
        return "\n".join(lines[-n:])

    def stop(self, grace: float) -> None:
        self.terminate()
        self.reap(grace)

    def terminate(self) -> None:
        """SIGTERM to the leader (or its group); ``reap`` waits for the tree to go."""
        with contextlib.suppress(Exception):
            self.snapshot()
        if self.alive():
            self.say(f"stopping {self.name}")
            with contextlib.suppress(ProcessLookupError):
                if self.signal_group:
                    os.killpg(self.proc.pid, signal.SIGTERM)
                else:
                    self.proc.send_signal(signal.SIGTERM)

    def reap(self, grace: float) -> None:
        """Until the leader exits (SIGKILL to its group after ``grace`` seconds), then the
        rest of the tree."""
        if self.alive():
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.say(f"{self.name} did not stop within {grace:.0f}s; killing it")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # Anything of the tree still there after its leader is gone (a worker that missed
        # the signal) gets a short grace, then SIGKILL.
        deadline = time.monotonic() + 5
        while True:
            table = _proc_table()
            left = [p for p, st in self._tree.items() if p in table and table[p][1] == st]
            if not left:
                break
            if time.monotonic() > deadline:
                for pid in left:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                        self.say(f"killed leftover process {pid} of {self.name}")
                break
            time.sleep(0.2)
        self._out.close()
        self._log.close()


# --- a meshserve cluster ----------------------------------------------------------------------


class LocalCluster:
    """A meshserve cluster of its own for a benchmark (see the module's docstring); every
    process of it is a ``Server`` (own session, stopped as a tree)."""

    def __init__(
        self,
        name: str,
        models: Path,
        *,
        pool_size: int,
        settings: Mapping[str, str],
        log: Path,
        env: Mapping[str, str] | None = None,
        second_pool: bool = False,
        log_level: str = "warning",
        nats_url: str | None = None,
        redis_url: str | None = None,
        startup_timeout: float = 900,
        say: Callable[[str], None] = _stderr,
    ) -> None:
        self.name = name
        self.cluster = f"bench-{name}-{uuid.uuid4().hex[:6]}"
        self.models = models
        self.pool_size = pool_size
        self.settings = dict(settings)
        self.extra_env = dict(env or {})
        self.log_path = log
        self.second_pool = second_pool
        self.log_level = log_level
        self.startup_timeout = startup_timeout
        self.say = say
        self.port = free_port()
        self.url = ""  # the API's base URL (…/v1), once up
        self.up: Server | None = None  # `meshserve up`, once started
        self._servers: list[Server] = []
        s = Settings.load()  # the servers the bench runs with, unless given its own
        self.nats_url = nats_url or s.nats_url or ""
        self.redis_url = redis_url or s.redis_url or ""

    def env(self, pool: str, extra: Mapping[str, str] = {}) -> dict[str, str]:
        return process_environment(
            {
                "MESHSERVE_CLUSTER": self.cluster,
                "MESHSERVE_NATS_URL": self.nats_url,
                "MESHSERVE_REDIS_URL": self.redis_url,
                "MESHSERVE_MODELS_DIR": str(self.models),
                "MESHSERVE_HTTP_PORT": str(self.port),
                "MESHSERVE_POOL_ID": pool,
                "MESHSERVE_LOG_LEVEL": self.log_level,
                **{f"MESHSERVE_{k}": v for k, v in {**self.settings, **extra}.items()},
                **self.extra_env,
            }
        )

    def start(self, timeout: float | None = None) -> str:
        """Starts the cluster; its API's base URL once ``meshserve up`` prints it (within
        ``timeout`` seconds, by default ``startup_timeout``). Stops what it started if it
        fails."""
        py, cli = sys.executable, "services.cli"
        try:
            self.up = Server(
                self.name,
                [py, "-m", cli, "up", "--pool-size", str(self.pool_size)],
                self.env("pool-a"),
                self.log_path,
                signal_group=False,
                say=self.say,
            )
            self._servers.append(self.up)
            if self.second_pool:
                self._servers.append(
                    Server(
                        f"{self.name} pool-b",
                        [py, "-m", cli, "task-executor", "--pool-id", "pool-b"],
                        self.env("pool-b", {"POOL_SIZE": str(self.pool_size)}),
                        self.log_path,
                        stdout=self.log_path,
                        fresh=False,
                        signal_group=False,
                        say=self.say,
                    )
                )
            self.url = self._printed_url(self.up, timeout or self.startup_timeout)
        except BaseException:
            self.stop()
            raise
        return self.url

    def _printed_url(self, up: Server, timeout: float) -> str:
        """`meshserve up` prints its API URL on stdout once the cluster is up."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                for line in up.stdout_path.read_text().splitlines():
                    if line.startswith("http"):
                        return line.strip()
            if not up.alive():
                raise RuntimeError(
                    f"{self.name}: the cluster exited with {up.proc.returncode} while starting"
                    f" (log: {self.log_path}):\n{up.log_tail()}"
                )
            time.sleep(0.5)
        raise RuntimeError(
            f"{self.name}: the cluster printed no URL within {timeout:.0f}s"
            f" (log: {self.log_path}):\n{up.log_tail()}"
        )

    def stop(self, grace: float = 60) -> None:
        """SIGTERM to every process started here (the second pool first), then waits."""
        for s in reversed(self._servers):
            s.terminate()
        for s in reversed(self._servers):
            s.reap(grace)
        self._servers.clear()

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def started(self) -> float:
        """When ``meshserve up`` was started (time.monotonic())."""
        assert self.up is not None
        return self.up.started

    def pids(self) -> list[int]:
        """Every process of the cluster (some perhaps gone)."""
        return [pid for s in self._servers for pid in s.pids()]

    def snapshot(self) -> None:
        for s in self._servers:
            s.snapshot()

    def _get(self, path: str) -> bytes:
        with urllib.request.urlopen(self.url.removesuffix("/v1") + path, timeout=5) as r:
            data: bytes = r.read()
        return data

    def health(self) -> dict[str, Any]:
        body: dict[str, Any] = json.loads(self._get("/health"))
        return body

    def metrics(self) -> str:
        return self._get("/metrics").decode()

    def wait(self, ready: Callable[[dict[str, Any]], bool], timeout_s: float = 300) -> None:
        """Until ``ready(health)`` holds."""
        deadline = time.monotonic() + timeout_s
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                last = self.health()
                if ready(last):
                    return
            time.sleep(0.5)
        raise RuntimeError(f"{self.name}: not ready in {timeout_s:.0f} s: {last}")


def instances(health: Mapping[str, Any], states: tuple[str, ...] = ("ready",)) -> dict[str, int]:
    """Per model, the TEs holding it in one of ``states``."""
    counts: dict[str, int] = {}
    for te in health.get("task_executors", ()):
        if te.get("model") and te.get("state") in states:
            counts[te["model"]] = counts.get(te["model"], 0) + 1
    return counts


def counter(metrics: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus counter's samples whose labels include ``labels``."""
    total = 0.0
    for line in metrics.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, rest = head.partition("{")
        if metric not in (name, f"{name}_total"):
            continue
        have = dict(part.split("=", 1) for part in rest.rstrip("}").split(",") if "=" in part)
        if all(have.get(k, "").strip('"') == v for k, v in labels.items()):
            total += float(value)
    return total
