"""Docker where no image registry answers: the engine installed and started where it can be
(root, with apt), a Debian bookworm base image made here (``debootstrap`` and
``docker import``), and the images compose.yaml runs built from it: meshserve's
(``Dockerfile``), NATS, Redis and Prometheus (``docker/local-infra.Dockerfile``).

  python -m devtools.docker_local images   # builds what is missing; prints compose's variables
  eval "$(python -m devtools.docker_local images)" && docker compose up -d

Layers are cached by the engine, so a second build after a code change takes seconds. The
tests in tests/docker use this module; it never pulls an image.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIRROR = "http://deb.debian.org/debian"
# The CPU torch wheel pyproject.toml pins; the Dockerfile takes it from a PEP 503 index.
TORCH = "torch==2.13.0+cpu"
# The index's port is part of the build's cache key (the TORCH_INDEX argument): a fixed one
# lets the next build reuse the torch and dependency layers.
TORCH_INDEX_PORT = 47913
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
IMAGE_CA_BUNDLE = Path("/etc/ssl/host-ca-bundle.pem")  # not rewritten by update-ca-certificates


@dataclass(frozen=True)
class Images:
    base: str = "meshserve-base:bookworm"
    meshserve: str = "meshserve:local"
    nats: str = "meshserve-nats:local"
    redis: str = "meshserve-redis:local"
    prometheus: str = "meshserve-prometheus:local"

    def compose_env(self) -> dict[str, str]:
        """The variables that point compose.yaml at these images."""
        return {
            "MESHSERVE_BASE_IMAGE": self.base,
            "MESHSERVE_IMAGE": self.meshserve,
            "MESHSERVE_NATS_IMAGE": self.nats,
            "MESHSERVE_REDIS_IMAGE": self.redis,
            "MESHSERVE_PROMETHEUS_IMAGE": self.prometheus,
        }


class Unavailable(Exception):
    """No Docker engine here, and none can be installed: the reason, in words."""


@dataclass
class Docker:
    """A Docker engine that answers, and the compose command that drives it."""

    docker: str
    compose: list[str]
    daemon: subprocess.Popen[bytes] | None = None  # dockerd, when this module started it

    def run(
        self, *args: str, check: bool = True, timeout: float = 600, **kw: object
    ) -> subprocess.CompletedProcess[str]:
        return _run([self.docker, *args], check=check, timeout=timeout, **kw)

    def image_exists(self, tag: str) -> bool:
        return self.run("image", "inspect", tag, check=False).returncode == 0

    def stop_daemon(self) -> None:
        """Stop the dockerd this module started (containers are the caller's to remove)."""
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.terminate()
            try:
                self.daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
                self.daemon.wait()


def _run(
    argv: Sequence[str], *, check: bool = True, timeout: float = 600, **kw: object
) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        list(argv),
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,  # type: ignore[call-overload]
    )
    if check and r.returncode != 0:
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-30:])
        raise RuntimeError(f"`{' '.join(argv)}` exited with {r.returncode}:\n{tail}")
    return r


def say(msg: str) -> None:
    print(f"docker-local: {msg}", file=sys.stderr, flush=True)


def _apt_install(packages: Sequence[str]) -> None:
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise Unavailable(
            f"{', '.join(packages)} missing, and they can only be installed as root with "
            "apt-get (apt-get install docker.io docker-compose debootstrap)"
        )
    say(f"apt-get install {' '.join(packages)}")
    install = ["apt-get", "install", "-y", "--no-install-recommends", *packages]
    r = _run(install, check=False)
    if r.returncode != 0:  # stale package lists
        _run(["apt-get", "update"], check=False)
        r = _run(install, check=False)
    if r.returncode != 0:
        raise Unavailable(f"apt-get install {' '.join(packages)} failed: {r.stderr[-500:]}")


def _answers(docker: str) -> bool:
    try:
        return _run([docker, "info"], check=False, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def engine(*, install: bool = True, log_dir: Path | None = None) -> Docker:
    """A Docker engine that answers: the one running, or (``install``, as root with apt)
    Debian's docker.io and docker-compose installed and dockerd started. Raises Unavailable
    with the reason otherwise."""
    missing = [
        pkg
        for pkg, exe in (("docker.io", "dockerd"), ("docker-compose", "docker-compose"))
        if shutil.which(exe) is None
    ]
    docker = shutil.which("docker")
    if docker is None or not _answers(docker):
        if missing:
            if not install:
                raise Unavailable(f"no Docker engine answers and {', '.join(missing)} is missing")
            _apt_install(missing)
    docker = shutil.which("docker")
    if docker is None:
        raise Unavailable("no docker command after installing docker.io")
    daemon = None
    if not _answers(docker):
        dockerd = shutil.which("dockerd")
        if dockerd is None:
            raise Unavailable("no Docker engine answers and there is no dockerd to start")
        if os.geteuid() != 0:
            raise Unavailable("no Docker engine answers, and only root can start dockerd here")
        log = (log_dir or Path(tempfile.gettempdir())) / "dockerd.log"
        say(f"starting dockerd (log: {log})")
        with open(log, "ab") as out:
            daemon = subprocess.Popen(
                [dockerd], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + 60
        while not _answers(docker):
            if daemon.poll() is not None or time.monotonic() > deadline:
                daemon.kill()
                raise Unavailable(f"dockerd did not start; its log: {log}")
            time.sleep(0.5)
    compose = _compose(docker)
    if compose is None and install:
        _apt_install(["docker-compose"])
        compose = _compose(docker)
    if compose is None:
        raise Unavailable("no docker compose plugin and no docker-compose")
    return Docker(docker=docker, compose=compose, daemon=daemon)


def _compose(docker: str) -> list[str] | None:
    """`docker compose` (v2) where the plugin is there, else `docker-compose` (1.29+)."""
    if _run([docker, "compose", "version"], check=False).returncode == 0:
        return [docker, "compose"]
    if exe := shutil.which("docker-compose"):
        return [exe]
    return None


def base_image(d: Docker, tag: str) -> None:
    """A bare Debian bookworm image (``debootstrap --variant=minbase``, about 25 s), made once
    and then kept by the engine."""
    if d.image_exists(tag):
        return
    if shutil.which("debootstrap") is None:
        _apt_install(["debootstrap"])
    with tempfile.TemporaryDirectory(prefix="meshserve-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        say(f"debootstrap --variant=minbase bookworm ({MIRROR})")
        _run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), MIRROR], timeout=900)
        for deb in (rootfs / "var/cache/apt/archives").glob("*.deb"):
            deb.unlink()
        # This host's CA bundle, which trusts whatever proxy its TLS goes through: the builds
        # reach the package registries through this host (--network host).
        changes: list[str] = []
        if HOST_CA_BUNDLE.is_file():
            target = rootfs / IMAGE_CA_BUNDLE.relative_to("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(HOST_CA_BUNDLE, target)
            for var in ("PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"):
                changes += ["--change", f"ENV {var}={IMAGE_CA_BUNDLE}"]
        say(f"docker import → {tag}")
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        _run([d.docker, "import", *changes, "-", tag], stdin=tar.stdout)
        tar.wait()


@contextlib.contextmanager
def torch_index(workdir: Path) -> Iterator[str | None]:
    """A PEP 503 index on 127.0.0.1 serving the CPU torch wheel pip finds on this host (a
    local wheel; seconds), for the Dockerfile's TORCH_INDEX. None where pip finds none: the
    build then takes the Dockerfile's default index."""
    project = workdir / "torch"
    project.mkdir(parents=True, exist_ok=True)
    if not any(project.glob("torch-*.whl")):
        r = _run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(project), TORCH],
            check=False,
            timeout=900,
        )
        if r.returncode != 0:
            say(f"no local {TORCH} wheel: the build downloads it ({r.stderr.strip()[-200:]})")
            yield None
            return
    handler = functools.partial(_QuietHandler, directory=str(workdir))
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", TORCH_INDEX_PORT), handler)
    except OSError:  # taken: any port, and the layers from torch on are built again
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def build(d: Docker, images: Images = Images(), *, workdir: Path | None = None) -> dict[str, float]:
    """The base image (if missing) and the four images, with ``--network host`` (the
    package registries are reached through the host). Returns seconds per image."""
    seconds: dict[str, float] = {}
    t0 = time.monotonic()
    base_image(d, images.base)
    seconds["base"] = time.monotonic() - t0
    work = workdir or Path(tempfile.gettempdir()) / "meshserve-docker-index"
    with torch_index(work) as index:
        t0 = time.monotonic()
        args = ["--build-arg", f"TORCH_INDEX={index}"] if index else []
        say(f"docker build {images.meshserve}")
        d.run(
            "build", "--network", "host", "--force-rm", "--target", "cpu",
            "--build-arg", f"BASE={images.base}", *args,
            "-t", images.meshserve, str(ROOT), timeout=1800,
        )  # fmt: skip
        seconds["meshserve"] = time.monotonic() - t0
    for target, tag in (
        ("nats", images.nats),
        ("redis", images.redis),
        ("prometheus", images.prometheus),
    ):
        t0 = time.monotonic()
        say(f"docker build {tag}")
        d.run(
            "build", "--network", "host", "--force-rm", "--target", target,
            "--build-arg", f"BASE={images.base}",
            "-f", str(ROOT / "docker" / "local-infra.Dockerfile"),
            "-t", tag, str(ROOT / "docker"), timeout=900,
        )  # fmt: skip
        seconds[target] = time.monotonic() - t0
    return seconds


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("images", help="build the local images; print compose's variables")
    args = p.parse_args(argv)
    if args.command == "images":
        try:
            d = engine()
        except Unavailable as e:
            say(str(e))
            return 1
        seconds = build(d)
        say(", ".join(f"{k} {v:.0f} s" for k, v in seconds.items()))
        for k, v in Images().compose_env().items():
            print(f"export {k}={v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
