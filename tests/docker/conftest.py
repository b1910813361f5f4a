"""The compose cluster of compose.yaml, built from local images (devtools/docker_local.py)
and brought up under a project name of its own on a free port.

Docker is installed and started where it can be (root, with apt); elsewhere these tests
skip and say why."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools import docker_local
from shared.embedded import free_port

ROOT = Path(__file__).resolve().parents[2]
IMAGES = docker_local.Images()
PROJECT_PREFIX = "meshserve-test-"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.parent == Path(__file__).parent:
            item.add_marker("docker")
            item.add_marker("slow")


@pytest.fixture(scope="session")
def docker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[docker_local.Docker]:
    """An engine with the local images built (cached by the engine between runs)."""
    try:
        d = docker_local.engine(log_dir=tmp_path_factory.mktemp("dockerd"))
    except docker_local.Unavailable as e:
        pytest.skip(f"no Docker here: {e}")
    try:
        _remove_stale_projects(d)
        t0 = time.monotonic()
        seconds = docker_local.build(d, IMAGES)
        print(f"images built in {time.monotonic() - t0:.0f} s: {seconds}")
        yield d
    finally:
        d.stop_daemon()


def _remove_stale_projects(d: docker_local.Docker) -> None:
    """What an earlier run that was killed before its `down` left: its containers restart
    with the engine (`unless-stopped`) and would run beside this one."""
    label = "label=com.docker.compose.project"
    stale = {
        name
        for kind in (("ps", "-a"), ("network", "ls"), ("volume", "ls"))
        for name in d.run(
            *kind, "--filter", label, "--format", '{{.Label "com.docker.compose.project"}}'
        ).stdout.split()
        if name.startswith(PROJECT_PREFIX)
    }
    for project in sorted(stale):
        print(f"removing what an earlier run left: compose project {project}")
        only = f"{label}={project}"
        if ids := d.run("ps", "-a", "-q", "--filter", only).stdout.split():
            d.run("rm", "-f", "-v", *ids)
        if ids := d.run("network", "ls", "-q", "--filter", only).stdout.split():
            d.run("network", "rm", *ids)
        if ids := d.run("volume", "ls", "-q", "--filter", only).stdout.split():
            d.run("volume", "rm", "-f", *ids)


class Compose:
    """`docker compose -p PROJECT -f compose.yaml ...` with the local images' variables."""

    def __init__(self, d: docker_local.Docker, project: str, port: int) -> None:
        self.d = d
        self.project = project
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self._admin_key: str | None = None
        prometheus = free_port()
        self.prometheus_url = f"http://127.0.0.1:{prometheus}"
        # Only the variables compose.yaml is meant to see: none of the test run's MESHSERVE_*.
        env = {k: v for k, v in os.environ.items() if not k.startswith("MESHSERVE_")}
        self.env = {
            **env,
            **IMAGES.compose_env(),
            "MESHSERVE_HTTP_PORT": str(port),
            "MESHSERVE_PROMETHEUS_PORT": str(prometheus),
            "MESHSERVE_GRAFANA_PORT": str(free_port()),
        }

    def __call__(
        self, *args: str, check: bool = True, timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        argv = [*self.d.compose, "-p", self.project, "-f", str(ROOT / "compose.yaml"), *args]
        r = subprocess.run(
            argv, capture_output=True, text=True, env=self.env, cwd=ROOT, timeout=timeout
        )
        if check and r.returncode != 0:
            raise AssertionError(
                f"`{' '.join(argv)}` exited with {r.returncode}:\n{r.stdout[-3000:]}"
                f"{r.stderr[-3000:]}\n--- logs ---\n{self.logs()}"
            )
        return r

    def logs(self, tail: int = 60) -> str:
        r = self("logs", "--no-color", "--tail", str(tail), check=False, timeout=60)
        return r.stdout[-12000:] + r.stderr[-2000:]

    def admin_key(self) -> str:
        """The admin key the secrets service generated (the API is published beyond the
        host's loopback, so it asks for keys), read as the operator does."""
        if self._admin_key is None:
            out = self("exec", "-T", "frontend", "cat", "/run/meshserve/admin-key").stdout
            self._admin_key = out.strip()
        return self._admin_key

    def container(self, service: str) -> str:
        ids = self("ps", "-q", service).stdout.split()
        assert len(ids) == 1, f"{service}: containers {ids}"
        return ids[0]

    def inspect(self, container: str) -> dict:
        return json.loads(self.d.run("inspect", container).stdout)[0]

    def health(self) -> dict:
        with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
            return json.load(r)

    def wait_healthy(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            try:
                body = self.health()
                if body["status"] == "ok" and "demo" in body["models"]:
                    return body
                last = body
            except (OSError, ValueError) as e:
                last = e
            time.sleep(1)
        raise AssertionError(f"frontend not ready in {timeout:.0f} s: {last}\n{self.logs()}")

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=com.docker.compose.project={self.project}"
        return {
            kind: self.d.run(*cmd, "--filter", label).stdout.split()
            for kind, cmd in (
                ("containers", ("ps", "-a", "-q")),
                ("networks", ("network", "ls", "-q")),
                ("volumes", ("volume", "ls", "-q")),
            )
        }


@pytest.fixture(scope="module")
def compose(docker: docker_local.Docker) -> Iterator[Compose]:
    """compose.yaml up (detached) with the demo model generated into its volume, and the
    observability profile's Prometheus (its Grafana has no image here: checked by `config`)
    scraping from the start."""
    c = Compose(docker, f"{PROJECT_PREFIX}{uuid.uuid4().hex[:8]}", free_port())
    try:
        t0 = time.monotonic()
        c("up", "-d", timeout=900)
        c("up", "-d", "prometheus", timeout=300)
        c.wait_healthy(timeout=300)
        print(f"compose up to a ready frontend: {time.monotonic() - t0:.0f} s")
        yield c
    finally:
        c("down", "-v", "--remove-orphans", "--timeout", "10", check=False)
