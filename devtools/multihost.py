"""A meshserve cluster spread over network-namespace hosts (``devtools.netns_hosts``),
started the way an operator starts one on several machines: each service is its own
process (``python -m services.<name>``, what ``meshserve <service>`` and a container run),
given the cluster's NATS servers (with its role's credentials, as ``meshserve infra-secrets
--nats-host`` writes them for a NATS cluster) and Redis Sentinels by the environment.

Layout (three hosts):

    host 0: nats, sentinel, redis replica, frontend, job executor, cluster manager, node pool
    host 1: nats, sentinel,                frontend, job executor, scaler,          node pool
    host 2: nats, sentinel, redis primary,                         cluster manager, scaler,
            node pool

Every host keeps its own host weight cache (in its own /dev/shm: ``devtools.netns_hosts``),
and its weight server and KV server listen on its address, so a fork or a KV pull between
two hosts crosses the shaped links."""

from __future__ import annotations

import contextlib
import datetime
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import redis

from devtools.netns_hosts import Hosts
from services import infra_secrets
from shared.embedded import nats_server_binary, redis_server_binary
from shared.settings import process_environment

REDIS_PORT, SENTINEL_PORT, HTTP_PORT = 6379, 26379, 8080
SCALER_METRICS, CM_METRICS = 9101, 9102
POOL_SIZE = "2"  # TEs a node pool runs, unless the settings say otherwise
MASTER = "meshserve"
REDIS_PRIMARY, REDIS_REPLICA = 2, 0

LAYOUT: dict[int, tuple[str, ...]] = {
    0: ("cluster_manager", "job_executor", "task_executor", "frontend"),
    1: ("scaler", "job_executor", "task_executor", "frontend"),
    2: ("cluster_manager", "scaler", "task_executor"),
}


class MultiHostCluster:
    def __init__(
        self,
        hosts: Hosts,
        models_dir: Path,
        *,
        layout: dict[int, tuple[str, ...]] | None = None,
        **settings: str,
    ) -> None:
        self.hosts = hosts
        self.layout = LAYOUT if layout is None else layout
        self.name = f"mh-{uuid.uuid4().hex[:8]}"
        self.dir = hosts.root / self.name  # its configurations, secrets and logs
        self.dir.mkdir()
        self.models_dir = models_dir
        self.settings = settings
        self.services: dict[tuple[int, str], subprocess.Popen[bytes]] = {}
        self.redis: dict[str, subprocess.Popen[bytes]] = {}
        self.cache_dir = f"/dev/shm/meshserve-weights-{self.name}"  # on each host's own

    # -- addresses -------------------------------------------------------------------------

    def address(self, i: int) -> str:
        return self.hosts[i].address

    def url(self, i: int) -> str:
        """The OpenAI base URL of host ``i``'s frontend."""
        return f"http://{self.address(i)}:{HTTP_PORT}/v1"

    @property
    def addresses(self) -> list[str]:
        return [h.address for h in self.hosts.hosts]

    @property
    def sentinels(self) -> list[str]:
        return [f"{h.address}:{SENTINEL_PORT}" for h in self.hosts.hosts]

    # -- infrastructure --------------------------------------------------------------------

    def write_secrets(self) -> None:
        """``meshserve infra-secrets`` for this cluster: the NATS cluster's configuration
        (every host's address), the Redis ACL, replication and Sentinel configurations (the
        primary on ``REDIS_PRIMARY``), each role's URLs."""
        infra_secrets.write(
            self.dir / "secrets",
            self.name,
            nats_host=",".join(self.addresses),
            redis_host=self.address(REDIS_PRIMARY),
            redis_master=MASTER,
        )

    def start_nats(self) -> None:
        """A server on each host, configured as ``meshserve infra-secrets --nats-host`` with
        every host's address configures a NATS cluster: one user per role, routes between
        the servers with their own secret, pings every second. Each service then connects
        with its role's URLs (all three servers)."""
        conf = json.loads((self.dir / "secrets" / "nats" / "nats.conf").read_text())
        for h in self.hosts.hosts:
            path = self.dir / f"nats-{h.index}.conf"
            path.write_text(json.dumps(conf))
            self.hosts.spawn(h.index, "nats", [nats_server_binary(), "-c", str(path)], {}, self.dir)

    def role_nats_url(self, role: str) -> str:
        return (self.dir / "secrets" / role / "nats-url").read_text().strip()

    def role_redis_url(self, role: str) -> str:
        return (self.dir / "secrets" / role / "redis-url").read_text().strip()

    def start_redis(self) -> None:
        """Redis with the ACL ``infra-secrets`` writes (no default user; replicas and
        Sentinels log in as their own users), a primary and a replica, and a Sentinel on each
        host started from a copy of its ``sentinel.conf``."""
        binary = redis_server_binary()
        secrets = self.dir / "secrets" / "redis"
        primary = self.address(REDIS_PRIMARY)
        for role, i, extra in (
            ("primary", REDIS_PRIMARY, ""),
            ("replica", REDIS_REPLICA, f"replicaof {primary} {REDIS_PORT}\n"),
        ):
            conf = self.dir / f"redis-{role}.conf"
            conf.write_text(
                f'port {REDIS_PORT}\nbind {self.address(i)}\nsave ""\nappendonly no\n'
                f"aclfile {secrets / 'redis.acl'}\ninclude {secrets / 'replication.conf'}\n" + extra
            )
            self.redis[role] = self.hosts.spawn(
                i, f"redis-{role}", [binary, str(conf)], {}, self.dir
            )
        for h in self.hosts.hosts:
            conf = self.dir / f"sentinel-{h.index}.conf"
            conf.write_text(
                f"bind {h.address}\nprotected-mode no\n" + (secrets / "sentinel.conf").read_text()
            )
            self.hosts.spawn(h.index, "sentinel", [binary, str(conf), "--sentinel"], {}, self.dir)

    def _redis(self, host: str, port: int, timeout: float) -> redis.Redis:
        """A client of a Redis server or Sentinel as the cluster manager's user (on a server
        its cluster's keys only; on a Sentinel, lookups only)."""
        url = urlsplit(self.role_redis_url("cluster_manager"))
        return redis.Redis(
            host=host,
            port=port,
            username=unquote(url.username or ""),
            password=unquote(url.password or ""),
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
        )

    def redis_cli(self, i: int, *args: str) -> str:
        """One Redis command to host ``i``'s Redis server, from the test's namespace."""
        r = self._redis(self.address(i), REDIS_PORT, timeout=2)
        try:
            got = r.execute_command(*args)
        finally:
            r.close()
        if isinstance(got, bytes):
            return got.decode()
        return (
            str([g.decode() if isinstance(g, bytes) else g for g in got])
            if isinstance(got, list)
            else str(got)
        )

    def redis_primary(self) -> str:
        """The primary's address as the first Sentinel on a host not cut off names it."""
        for h in self.hosts.reachable():
            with contextlib.suppress(redis.RedisError, OSError):
                r = self._redis(h.address, SENTINEL_PORT, timeout=1)
                try:
                    got = r.execute_command("SENTINEL", "get-master-addr-by-name", MASTER)
                finally:
                    r.close()
                if got:
                    return _text(got[0])
        return ""

    def redis_whole(self) -> bool:
        """Whether every Sentinel on a host not cut off names one primary and knows a
        replica of it, up and linked: a failover could promote it. (A Sentinel learns of
        replicas from the primary's INFO every 10 s; before that it finds no good replica.)"""
        primaries, ok = set(), True
        for h in self.hosts.reachable():
            r = self._redis(h.address, SENTINEL_PORT, timeout=1)
            try:
                primary = r.execute_command("SENTINEL", "get-master-addr-by-name", MASTER)
                replicas = r.execute_command("SENTINEL", "REPLICAS", MASTER)
            except (redis.RedisError, OSError):
                return False
            finally:
                r.close()
            primaries.add(_text(primary[0]) if primary else "")
            ok = ok and any(_good_replica(entry) for entry in replicas)
        return ok and len(primaries) == 1 and "" not in primaries

    # -- meshserve ----------------------------------------------------------------------------

    def env(self, i: int, service: str) -> dict[str, str]:

        h = self.hosts[i]
        env = {
            "MESHSERVE_CLUSTER": self.name,
            "MESHSERVE_NATS_URL": self.role_nats_url(service),
            # Its role's credentials; the primary is found through the Sentinels.
            "MESHSERVE_REDIS_URL": self.role_redis_url(service),
            "MESHSERVE_REDIS_SENTINELS": json.dumps(self.sentinels),
            "MESHSERVE_REDIS_MASTER": MASTER,
            "MESHSERVE_MODELS_DIR": str(self.models_dir),
            "MESHSERVE_HOST_CACHE_DIR": self.cache_dir,
            "MESHSERVE_HOST_CACHE_SERVE_HOST": h.address,
            "MESHSERVE_KV_HOST": h.address,
            "MESHSERVE_HTTP_HOST": h.address,
            "MESHSERVE_HTTP_PORT": str(HTTP_PORT),
            # Beyond loopback the API asks for keys by default; these tests are about hosts.
            "MESHSERVE_AUTH": "off",
            "MESHSERVE_POOL_SIZE": POOL_SIZE,
            "MESHSERVE_POOL_ID": f"pool-h{i}",
            "MESHSERVE_TORCH_THREADS": "1",
            "MESHSERVE_HEARTBEAT_INTERVAL": "0.25",
            "MESHSERVE_LIVENESS_TIMEOUT": "2",
            "MESHSERVE_NATS_PING_INTERVAL": "0.5",
            "MESHSERVE_LEADER_LEASE": "2",
            "MESHSERVE_LOG_LEVEL": "info",
            **{f"MESHSERVE_{k.upper()}": v for k, v in self.settings.items()},
        }
        if service == "scaler":
            env["MESHSERVE_METRICS_PORT"] = str(SCALER_METRICS)
        if service == "cluster_manager":
            env["MESHSERVE_METRICS_PORT"] = str(CM_METRICS)
        return process_environment(env)  # this process's own, these set over it

    def start_services(self) -> None:
        """Every service but the scalers, then the scalers once a frontend sees every node
        pool's TEs: a placement made while some pools' TEs are still starting can only use
        the pools already there (two instances of a model on one host, another host empty a
        second later), which would make what the tests check depend on start-up speed."""
        for i, services in self.layout.items():
            for service in services:
                if service != "scaler":
                    self._spawn(i, service)
        pools = sum("task_executor" in s for s in self.layout.values())
        tes = pools * int(self.settings.get("pool_size", POOL_SIZE))
        via = next((i for i, s in self.layout.items() if "frontend" in s), None)
        if via is not None and pools:
            self.wait(
                f"the {tes} TEs of every pool in the view",
                lambda: len((self.health(via) or {}).get("task_executors", [])) == tes,
                240,
            )
        for i, services in self.layout.items():
            if "scaler" in services:
                self._spawn(i, "scaler")

    def _spawn(self, i: int, service: str) -> None:
        argv = [sys.executable, "-m", f"services.{service}"]
        proc = self.hosts.spawn(i, service, argv, self.env(i, service), self.dir)
        self.services[(i, service)] = proc

    def start(self) -> MultiHostCluster:
        self.write_secrets()
        self.start_nats()
        self.start_redis()
        self.start_services()
        return self

    def stop(self) -> None:
        self.hosts.stop_processes()
        for h in self.hosts.hosts:
            self.hosts.run(h.index, ["rm", "-rf", self.cache_dir])

    # -- looking at it -----------------------------------------------------------------------

    def health(self, i: int) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(
                f"http://{self.address(i)}:{HTTP_PORT}/health", timeout=2
            ) as r:
                body: dict[str, Any] = json.loads(r.read())
                return body
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def instances(self, i: int, model: str = "demo") -> dict[str, str]:
        """TE id -> state, for the TEs holding ``model``, as host ``i``'s frontend sees them."""
        body = self.health(i) or {}
        return {
            t["id"]: t["state"] for t in body.get("task_executors", []) if t.get("model") == model
        }

    def produced(self, i: int, model: str = "demo") -> dict[int, int]:
        """Host -> tokens ``model``'s instances there produced so far (their TEs' counters),
        as host ``i``'s frontend sees them."""
        out: dict[int, int] = {}
        for te in (self.health(i) or {})["task_executors"]:
            if te.get("model") == model:
                out[host_of(te)] = out.get(host_of(te), 0) + te["generated_tokens"]
        return out

    def holds_weights(self, i: int, model: str, te_id: str | None = None) -> bool:
        """Whether the host cache of an instance of ``model`` (``te_id``'s, where given)
        holds every weight of it, as host ``i``'s frontend sees it."""
        for te in (self.health(i) or {}).get("task_executors", []):
            c = te["cached_weights"].get(model)
            if te.get("model") == model and te_id in (None, te["id"]) and c:
                if c["resident_bytes"] >= c["total_bytes"] > 0:
                    return True
        return False

    def metric(self, i: int, port: int, name: str, **labels: str) -> float | None:
        """The first sample of ``name`` (with those label values, where given) that host
        ``i``'s service on ``port`` exposes; None where it is cut off or has no such one."""
        if i in self.hosts.cut_off:
            return None
        try:
            with urllib.request.urlopen(f"http://{self.address(i)}:{port}/metrics", timeout=2) as r:
                text = r.read().decode()
        except (urllib.error.URLError, OSError):
            return None
        want = [f'{k}="{v}"' for k, v in labels.items()]
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                if all(w in line.split(" ", 1)[0] for w in want):
                    return float(line.rsplit(" ", 1)[1])
        return None

    def loads(self) -> list[dict[str, Any]]:
        """Every TE's "model loaded" record (JSON logs): its host, model, seconds and steps
        (``te_load_fetch`` where it forked the weights from another host's cache)."""
        out = []
        for path in sorted(self.dir.glob("h*-task_executor.log")):
            for line in path.read_text(errors="replace").splitlines():
                if '"model loaded"' not in line:
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                out.append(
                    {
                        "host": int(path.name.split("-", 1)[0].removeprefix("h")),  # h<i>-
                        "model": record.get("model"),
                        "role": record.get("role"),
                        "seconds": record.get("seconds"),
                        "steps": record.get("steps", {}),
                    }
                )
        return out

    def fork(self, model: str, host: int | None = None) -> dict[str, Any] | None:
        """The first load of ``model`` (on ``host``, where given) that forked its weights
        from another host's cache: the checkpoint's bytes, the fetch's and the load's
        seconds, and the rate against the link's; None where none did."""
        forks = [
            ld
            for ld in self.loads()
            if ld["model"] == model
            and host in (None, ld["host"])
            and ld["steps"].get("te_load_fetch")
        ]
        if not forks:
            return None
        size = sum(f.stat().st_size for f in (self.models_dir / model).glob("*.safetensors"))
        fetch_s = forks[0]["steps"]["te_load_fetch"]
        link = self.hosts.shaping.rate_bytes_s
        return {
            "model": model,
            "host": forks[0]["host"],
            "checkpoint_bytes": size,
            "fetch_s": fetch_s,
            "load_s": forks[0]["seconds"],
            "rate_bytes_s": size / fetch_s,
            "link_bytes_s": link,
            "of_link": size / fetch_s / link,
        }

    def wait(self, what: str, check: Any, timeout: float) -> Any:
        """What ``check()`` returns once it is neither None nor False (0 is an answer: host
        0), asked every quarter of a second; an error says what was awaited, with the
        services' last log lines."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if (got := check()) is not None and got is not False:
                    return got
            time.sleep(0.25)
        raise AssertionError(f"not within {timeout:g} s: {what}\n{self.tail()}")

    def failure_report(self, since: float, lines: int = 40) -> str:
        """For a failed test: where the logs are, every warning and error the services
        logged since ``since`` (unix seconds), and each log's last lines."""
        out = [f"logs: {self.dir}"]
        for path in sorted(self.dir.glob("h*.log")):
            bad = []
            for line in path.read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError, AttributeError):
                    record = json.loads(line)
                    if record.get("level") in ("warning", "error", "critical") and _after(
                        record.get("timestamp"), since
                    ):
                        bad.append(line)
            if bad:
                out.append(f"== {path.name}: warnings and errors\n" + "\n".join(bad[-200:]))
        return "\n".join([*out, self.tail(lines)])

    def tail(self, lines: int = 15) -> str:
        out = []
        for path in sorted(self.dir.glob("h*.log")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"== {path.name}\n" + "\n".join(text))
        return "\n".join(out)


def _after(stamp: object, since: float) -> bool:
    """A JSON log record's ``timestamp`` (ISO 8601) at or after ``since``; True where it
    has none that parses."""
    if not isinstance(stamp, str):
        return True
    try:
        t = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return True
    if t.tzinfo is None:
        t = t.replace(tzinfo=datetime.UTC)
    return t.timestamp() >= since


def host_of(te: dict[str, Any]) -> int:
    """The host a TE of ``/health`` runs on (its pool is ``pool-h<host>``)."""
    return int(te["pool"].removeprefix("pool-h"))


def _text(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _good_replica(entry: Any) -> bool:
    """A ``SENTINEL REPLICAS`` entry (a dict, or a flat list of names and values) for a
    replica neither down nor unlinked."""
    fields = entry if isinstance(entry, dict) else dict(zip(entry[::2], entry[1::2], strict=True))
    flags = _text(next((v for k, v in fields.items() if _text(k) == "flags"), ""))
    return not {"s_down", "o_down", "disconnected"} & set(flags.split(","))
