"""A whole local cluster, started the way scripts/up starts it (`meshserve up`), on the
test session's NATS and Redis under its own cluster name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from devtools.procs import processes_of  # noqa: F401 (the e2e and fault tests' import)
from shared.embedded import free_port
from tests.infra import nats_url, redis_url  # noqa: F401


class Cluster:
    def __init__(
        self,
        models_dir: Path,
        nats: str,
        redis: str,
        *,
        env: dict[str, str] | None = None,
        stderr: Path | None = None,
        **settings: str,
    ) -> None:
        self.name = f"e2e-{uuid.uuid4().hex[:8]}"
        self.port = free_port()
        self.env = {
            **os.environ,
            "MESHSERVE_CLUSTER": self.name,
            "MESHSERVE_NATS_URL": nats,
            "MESHSERVE_REDIS_URL": redis,
            "MESHSERVE_MODELS_DIR": str(models_dir),
            "MESHSERVE_HTTP_PORT": str(self.port),
            "MESHSERVE_POOL_SIZE": "2",
            "MESHSERVE_HEARTBEAT_INTERVAL": "0.25",
            "MESHSERVE_LIVENESS_TIMEOUT": "2",
            "MESHSERVE_TORCH_THREADS": "1",
            "MESHSERVE_LOG_LEVEL": "warning",
            **{f"MESHSERVE_{k.upper()}": v for k, v in settings.items()},
            **(env or {}),
        }
        self.stderr = stderr
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""

    def start(self, timeout: float = 180) -> Cluster:
        err = self.stderr.open("w") if self.stderr is not None else None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up"],
            env=self.env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
        )
        if err is not None:
            err.close()  # the child has its own copy
        got: list[str] = []
        reader = threading.Thread(
            target=lambda: got.append(self.proc.stdout.readline()), daemon=True
        )
        reader.start()
        reader.join(timeout)
        if not got or not got[0].startswith("http"):
            self.stop()
            raise RuntimeError(f"cluster did not come up within {timeout}s: {got}")
        self.url = got[0].strip()
        return self

    def stop(self, timeout: float = 60) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@pytest.fixture(scope="session")
def e2e_models_dir(tmp_path_factory, demo_model_dir: Path) -> Path:
    d = tmp_path_factory.mktemp("e2e-models")
    (d / "demo").symlink_to(demo_model_dir)
    return d


@pytest.fixture(scope="module")
def cluster_up(e2e_models_dir: Path, nats_url: str, redis_url: str):  # noqa: F811
    c = Cluster(e2e_models_dir, nats_url, redis_url, keep_alive="4").start()
    yield c
    c.stop()
