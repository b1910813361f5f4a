"""A local cluster for a benchmark: ``meshserve up`` (and optionally a second node pool) as
child processes on the NATS and Redis the bench runs with, under a cluster name of its own.

    with LocalCluster("combined", models, pool_size=3, settings={"ROUTING": "combined"},
                      log=work / "combined.log") as cluster:
        cluster.wait(lambda health: ...)
        replay(cluster.url, ...)
        text = cluster.metrics()

``settings`` are MESHSERVE_* variables without their prefix; the clusters' processes get
them through ``settings.process_environment``, like any child of the project.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from bench.common import ROOT
from shared.embedded import free_port
from shared.settings import Settings, process_environment


class LocalCluster:
    def __init__(
        self,
        name: str,
        models: Path,
        *,
        pool_size: int,
        settings: Mapping[str, str],
        log: Path,
        second_pool: bool = False,
        log_level: str = "warning",
        nats_url: str | None = None,
        redis_url: str | None = None,
    ) -> None:
        self.name = name
        self.cluster = f"bench-{name}-{uuid.uuid4().hex[:6]}"
        self.models = models
        self.pool_size = pool_size
        self.settings = dict(settings)
        self.log_path = log
        self.second_pool = second_pool
        self.log_level = log_level
        self.port = free_port()
        self.url = ""  # the API's base URL (…/v1), once up
        self._procs: list[subprocess.Popen[str]] = []
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
            }
        )

    def __enter__(self) -> LocalCluster:
        log = self.log_path.open("w")
        up = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up", "--pool-size", str(self.pool_size)],
            env=self.env("pool-a"),
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            cwd=ROOT,
        )
        self._procs.append(up)
        if self.second_pool:
            self._procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "services.cli", "task-executor", "--pool-id", "pool-b"],
                    env=self.env("pool-b", {"POOL_SIZE": str(self.pool_size)}),
                    stdout=log,
                    stderr=log,
                    text=True,
                    cwd=ROOT,
                )
            )
        try:
            url = up.stdout.readline().strip() if up.stdout else ""
            if not url.startswith("http"):
                raise RuntimeError(f"{self.name}: the cluster did not start; see {self.log_path}")
            self.url = url
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for p in reversed(self._procs):
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        for p in reversed(self._procs):
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        self._procs.clear()

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
