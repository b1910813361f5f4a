"""`meshserve up`: a whole local cluster in the foreground.

Starts NATS and Redis (embedded unless MESHSERVE_NATS_URL / MESHSERVE_REDIS_URL name
servers), then the five services as child processes; restarts a service that crashes;
on Ctrl-C or SIGTERM stops every process it started and returns."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

from shared.access import SERVICE_ROLE, Credentials
from shared.embedded import EmbeddedServer, die_with_parent, free_port
from shared.settings import Settings, process_environment
from shared.tenancy import admin_key, auth_on, default_admin_key_file, write_admin_key

# Start order; stop order is the reverse, so the frontend stops taking requests first and
# the cluster manager, which everybody reports to, goes last.
SERVICES: Sequence[str] = ("cluster_manager", "scaler", "job_executor", "task_executor", "frontend")
RESTART_BACKOFF_S = 1.0
# A service that crashes this often within CRASH_WINDOW_S is broken, not unlucky: stop.
MAX_CRASHES = 5
CRASH_WINDOW_S = 60.0


def metrics_port(base: int, service: str) -> int:
    """The ``/metrics`` port of ``service`` on this host where the launcher was given
    ``base``: the base port, then the next ones, in ``SERVICES`` order."""
    return base + SERVICES.index(service)


def say(msg: str) -> None:
    print(f"meshserve: {msg}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    started: float
    crashes: list[float] = dataclasses.field(default_factory=list)


class Launcher:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._servers: list[EmbeddedServer] = []
        self._children: dict[str, Child] = {}
        self._stop = False
        self._crashed = False
        # Embedded servers admit each service as its role (shared/access.py).
        self._creds = Credentials.generate() if settings.auth.infra else None
        self._secured: dict[str, str] = {}  # environment variable -> URL without credentials

    def _request_stop(self, signum: int, _frame: object) -> None:
        self._stop = True

    def _infra(self) -> Settings:
        updates: dict[str, object] = {}
        for kind, field, url in (
            ("nats", "nats_url", self.settings.nats_url),
            ("redis", "redis_url", self.settings.redis_url),
        ):
            if url is None:
                access = (self._creds, self.settings.cluster) if self._creds else None
                server = EmbeddedServer(kind, access).start()
                self._servers.append(server)
                updates[field] = server.url
                if access is not None:
                    self._secured[f"MESHSERVE_{field.upper()}"] = server.url
                secured = ", one user per service" if access is not None else ""
                say(f"started embedded {kind} at {server.url}{secured}")
        if self.settings.frontend.http_port == 0:
            updates["http_port"] = free_port()
        if auth_on(self.settings) and admin_key(self.settings) is None:
            # The key stays in a file only this user reads; never on the terminal or in logs.
            path = self.settings.auth.admin_key_file or default_admin_key_file(self.settings)
            write_admin_key(path)
            updates["admin_key_file"] = str(path)
            say(f"auth is on; a new admin key is in {path}")
        return self.settings.with_values(**updates)

    def _spawn(self, name: str, env: dict[str, str], crashes: list[float] | None = None) -> None:
        if (port := self.settings.metrics.port) and name != "frontend":
            env = {**env, "MESHSERVE_METRICS_PORT": str(metrics_port(port, name))}
        if self._creds is not None:  # its own role's credentials, in the URLs it is given
            role = SERVICE_ROLE[name]
            env = {**env, **{var: self._creds.url(url, role) for var, url in self._secured.items()}}
        # Own session, so a terminal's Ctrl-C reaches only the launcher, which then stops
        # the services in order; die_with_parent covers a launcher killed outright.
        proc = subprocess.Popen(
            [sys.executable, "-m", f"services.{name}"],
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        self._children[name] = Child(name, proc, time.monotonic(), crashes or [])

    def _healthy(self, url: str) -> dict | None:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                body = json.loads(r.read())
        except (urllib.error.URLError, OSError, ValueError):
            return None
        idle_tes = [te for te in body.get("task_executors", [])]
        if body.get("status") == "ok" and body.get("job_executors", 0) > 0 and idle_tes:
            return body
        return None

    def run(self) -> int:
        signal.signal(signal.SIGINT, self._request_stop)
        signal.signal(signal.SIGTERM, self._request_stop)
        try:
            settings = self._infra()
            env = process_environment(settings.env())
            for name in SERVICES:
                self._spawn(name, env)
            base = f"http://{settings.frontend.http_host}:{settings.frontend.http_port}"
            announced = False
            while not self._stop:
                if not announced and (body := self._healthy(base)):
                    announced = True
                    say(f"cluster '{settings.cluster}' is up")
                    say(
                        f"models: {', '.join(body['models']) or f'none (add one under {settings.models_dir})'}"
                    )
                    print(f"{base}/v1", flush=True)
                for child in list(self._children.values()):
                    rc = child.proc.poll()
                    if rc is None or self._stop:
                        continue
                    now = time.monotonic()
                    crashes = [t for t in child.crashes if now - t < CRASH_WINDOW_S] + [now]
                    if len(crashes) >= MAX_CRASHES:
                        say(
                            f"{child.name} crashed {len(crashes)} times in "
                            f"{CRASH_WINDOW_S:.0f}s (last exit {rc}); stopping the cluster"
                        )
                        self._stop = True
                        self._crashed = True
                        break
                    say(f"{child.name} exited with {rc}; restarting it")
                    if now - child.started < RESTART_BACKOFF_S:
                        time.sleep(RESTART_BACKOFF_S)
                    self._spawn(child.name, env, crashes)
                time.sleep(0.2)
            say("stopping")
        finally:
            failed = self._shutdown()
        if failed:
            say(f"not stopped cleanly: {', '.join(failed)}")
        return 1 if failed or self._crashed else 0

    def _shutdown(self) -> list[str]:
        """Stop the services in reverse start order; names of those that did not exit 0."""
        failed: list[str] = []
        for name in reversed(SERVICES):
            # The node pool gives its TEs shutdown_grace + 5 s before killing them.
            grace = self.settings.membership.shutdown_grace.total_seconds() + (
                15 if name == "task_executor" else 5
            )
            child = self._children.get(name)
            if child is None or child.proc.poll() is not None:
                continue
            child.proc.send_signal(signal.SIGTERM)
            try:
                rc = child.proc.wait(grace)
            except subprocess.TimeoutExpired:
                say(f"{name} did not stop within {grace:.0f}s; killing it")
                child.proc.kill()
                rc = child.proc.wait()
            if rc != 0:
                failed.append(f"{name} (exit {rc})")
        for server in self._servers:
            with contextlib.suppress(Exception):
                server.stop()
        say("stopped")
        return failed
