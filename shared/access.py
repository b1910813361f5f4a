"""Who may do what on NATS and Redis: one user per service role, each with a secret, the
NATS subjects it may publish and subscribe to and the Redis keys it may touch.

``meshserve up`` turns this on for the NATS and Redis it embeds (``MESHSERVE_INFRA_AUTH``,
on by default): it generates the secrets, starts nats-server with ``nats_config`` and
redis-server with ``redis_acl``, and hands each service URLs carrying its own role's
credentials. Nothing else ever sees a secret: it is not logged, not in ``/health``, not in
an error (``shared.store.redacted``).

Subjects come from the catalogue (``shared.subjects.CATALOGUE``): ``ACCESS`` names, for
each entry, the roles that publish and those that subscribe, and a test holds it complete.
Every role may subscribe to its own reply inboxes, ``<cluster>._INBOX.<role>.>`` (never
another role's replies), and answer the requests it received (``allow_responses``), nothing
more: a TE cannot submit jobs, publish a cluster view or command another TE, a frontend
cannot send a TE a control message.
Redis users reach only their cluster's keys and no administrative or dangerous command.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Literal
from urllib.parse import quote, urlsplit, urlunsplit

from shared.subjects import CATALOGUE, inbox_prefix

Role = Literal["frontend", "job_executor", "cluster_manager", "scaler", "task_executor"]
ROLES: tuple[Role, ...] = (
    "frontend",
    "job_executor",
    "cluster_manager",
    "scaler",
    "task_executor",
)
# Which service runs as which role (the launcher's and compose's service names).
SERVICE_ROLE: Mapping[str, Role] = {r: r for r in ROLES}


@dataclasses.dataclass(frozen=True)
class Access:
    publish: tuple[Role, ...]
    subscribe: tuple[Role, ...]


_EVERYONE: tuple[Role, ...] = ROLES

ACCESS: Mapping[str, Access] = {
    "job_submit": Access(publish=("frontend",), subscribe=("job_executor",)),
    # the JE places tasks, a frontend cancels its own
    "te_task": Access(publish=("job_executor", "frontend"), subscribe=("task_executor",)),
    "task_progress": Access(publish=("task_executor",), subscribe=("job_executor",)),
    "te_train": Access(publish=("job_executor",), subscribe=("task_executor",)),
    "train_progress": Access(publish=("task_executor",), subscribe=("job_executor",)),
    "ft_submit": Access(publish=("frontend",), subscribe=("job_executor",)),
    "te_control": Access(publish=("scaler",), subscribe=("task_executor",)),
    # tokens from TEs, JobTaken and JobHeld notices from JEs, to the frontend that owns the request
    "token_stream": Access(publish=("task_executor", "job_executor"), subscribe=("frontend",)),
    "heartbeat": Access(
        publish=("task_executor", "job_executor", "frontend"), subscribe=("cluster_manager",)
    ),
    "view": Access(publish=("cluster_manager",), subscribe=_EVERYONE),
    "member_down": Access(publish=("cluster_manager",), subscribe=_EVERYONE),
    "get_view": Access(publish=_EVERYONE, subscribe=("cluster_manager",)),
    "kv_events": Access(publish=("task_executor",), subscribe=("job_executor",)),
    "traffic": Access(publish=("job_executor",), subscribe=("scaler",)),
    "outcomes": Access(publish=("frontend",), subscribe=("scaler",)),
    "scale_events": Access(publish=("scaler",), subscribe=("frontend",)),
    "key_revoked": Access(publish=("frontend",), subscribe=("frontend",)),
    "device_views": Access(publish=("task_executor",), subscribe=("task_executor",)),
}


def subject_pattern(template: str, cluster: str) -> str:
    """A catalogue template as a NATS wildcard: every field but the cluster is ``*``."""
    return re.sub(r"\{(?!cluster\})[a-z_]+\}", "*", template).replace("{cluster}", cluster)


def permissions(role: Role, cluster: str) -> dict[str, object]:
    pub = sorted(
        subject_pattern(CATALOGUE[name].template, cluster)
        for name, a in ACCESS.items()
        if role in a.publish
    )
    sub = sorted(
        subject_pattern(CATALOGUE[name].template, cluster)
        for name, a in ACCESS.items()
        if role in a.subscribe
    )
    return {
        "publish": {"allow": pub},
        "subscribe": {"allow": [*sub, f"{inbox_prefix(cluster, role)}.>"]},
        "allow_responses": True,
    }


@dataclasses.dataclass(frozen=True)
class Credentials:
    """A generated secret per role."""

    secrets: Mapping[Role, str]

    @classmethod
    def generate(cls) -> Credentials:
        return cls({role: secrets.token_urlsafe(24) for role in ROLES})

    def url(self, base: str, role: Role) -> str:
        """``base`` (a server URL without credentials) with this role's user and secret."""
        parts = urlsplit(base)
        netloc = f"{role}:{quote(self.secrets[role], safe='')}@{parts.hostname}"
        if parts.port:
            netloc += f":{parts.port}"
        return urlunsplit(parts._replace(netloc=netloc))


ROUTE_PORT = 6222  # where the servers of a NATS cluster meet each other


def derived_secret(creds: Credentials, purpose: str) -> str:
    """A secret for the servers' own users (a NATS cluster's routes, a Redis replica, a
    Sentinel): derived from the roles' secrets, so it is stored nowhere else and changes
    with them."""
    joined = "\n".join(f"{r}={creds.secrets[r]}" for r in sorted(creds.secrets))
    return hashlib.sha256(f"{purpose}\n{joined}".encode()).hexdigest()


def route_secret(creds: Credentials) -> str:
    """The password the servers of a NATS cluster give each other on their routes."""
    return derived_secret(creds, "nats-route")


def nats_config(
    creds: Credentials,
    cluster: str,
    *,
    port: int,
    store_dir: str,
    host: str = "127.0.0.1",
    routes: Sequence[str] = (),
) -> str:
    """A nats-server configuration: on ``host`` (loopback unless a container's), JetStream,
    one user per role. With ``routes`` (the hosts of every server of a NATS cluster, this
    one's too: a server drops the route to itself), no JetStream and a cluster block: the servers route to
    each other on ``ROUTE_PORT`` with ``route_secret``, and ping every second, two missed and
    a route or client is dropped (a cut host's is gone in seconds, not minutes)."""
    users = [
        {"user": role, "password": creds.secrets[role], "permissions": permissions(role, cluster)}
        for role in ROLES
    ]
    config: dict[str, object] = {
        "host": host,
        "port": port,
        "jetstream": {"store_dir": store_dir},
        "authorization": {"users": users},
    }
    if routes:
        # meshserve uses core NATS only; JetStream clustered would need a server_name per
        # server, and this one file serves them all.
        del config["jetstream"]
        secret = route_secret(creds)
        config["ping_interval"] = "1s"
        config["ping_max"] = 2
        config["cluster"] = {
            "name": f"meshserve-{cluster}",
            "host": host,
            "port": ROUTE_PORT,
            "authorization": {"user": "route", "password": secret},
            "routes": [f"nats-route://route:{secret}@{h}:{ROUTE_PORT}" for h in routes],
        }
    # nats-server reads JSON as its configuration syntax.
    return json.dumps(config, indent=2)


# Redis's own users, beside the roles': a replica reads the primary's stream as
# REPLICA_USER, a Sentinel watches and reconfigures the servers as SENTINEL_USER (the
# commands Redis's documentation lists for each).
REPLICA_USER, SENTINEL_USER = "replica", "sentinel"
# On the Sentinels: the roles may only ask where the primary and the replicas are (what a
# client's Sentinel lookup sends), never reconfigure or fail anything over; the Sentinels log
# into each other as SENTINEL_PEER_USER.
SENTINEL_PEER_USER = "sentinel-peer"
_SENTINEL_CLIENT = (
    "-@all +ping +auth +client|setname +sentinel|masters +sentinel|master "
    "+sentinel|get-master-addr-by-name +sentinel|slaves +sentinel|replicas +sentinel|sentinels"
)
_SERVER_USERS = {
    REPLICA_USER: "+psync +replconf +ping",
    SENTINEL_USER: "allchannels +multi +slaveof +ping +exec +subscribe +config|rewrite +role "
    "+publish +info +client|setname +client|kill +script|kill",
}


def redis_server_secret(creds: Credentials, user: str) -> str:
    return derived_secret(creds, f"redis-{user}")


def _sha(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def redis_acl(creds: Credentials, cluster: str) -> str:
    """A Redis ACL file: no default user; each role only its cluster's keys, no
    administrative or dangerous command; a replica's and a Sentinel's users with only what
    replication and failover need. Secrets appear only as their SHA-256."""
    lines = ["user default off"]
    lines += [
        f"user {role} on #{_sha(creds.secrets[role])} ~{cluster}:* resetchannels "
        "+@all -@admin -@dangerous"
        for role in ROLES
    ]
    lines += [
        f"user {user} on #{_sha(redis_server_secret(creds, user))} {commands}"
        for user, commands in _SERVER_USERS.items()
    ]
    return "\n".join(lines) + "\n"


def redis_replication_config(creds: Credentials) -> str:
    """What every Redis server of a primary with replicas includes: how it authenticates
    to the primary when it is (or, after a failover, becomes) a replica."""
    return f"masteruser {REPLICA_USER}\nmasterauth {redis_server_secret(creds, REPLICA_USER)}\n"


def sentinel_config(
    creds: Credentials, *, master: str, primary: str, quorum: int = 2, port: int = 26379
) -> str:
    """A Sentinel's configuration (each Sentinel gets its own copy: it rewrites it): watch
    ``primary`` under the name ``master``, log into the servers as SENTINEL_USER and into the
    other Sentinels as SENTINEL_PEER_USER; no default user, and each role's user (its Redis
    secret) allowed only the lookups of ``_SENTINEL_CLIENT``. Down after 3 s (a cut host is
    promoted away from in seconds: README, Several machines)."""
    peer = redis_server_secret(creds, SENTINEL_PEER_USER)
    users = [f"user {role} on #{_sha(creds.secrets[role])} {_SENTINEL_CLIENT}" for role in ROLES]
    return (
        "\n".join(
            [
                f"port {port}",
                "sentinel resolve-hostnames yes",
                f"sentinel monitor {master} {primary} 6379 {quorum}",
                f"sentinel auth-user {master} {SENTINEL_USER}",
                f"sentinel auth-pass {master} {redis_server_secret(creds, SENTINEL_USER)}",
                f"sentinel down-after-milliseconds {master} 3000",
                f"sentinel failover-timeout {master} 10000",
                "user default off",
                *users,
                f"user {SENTINEL_PEER_USER} on #{_sha(peer)} +@all",
                f"sentinel sentinel-user {SENTINEL_PEER_USER}",
                f"sentinel sentinel-pass {peer}",
            ]
        )
        + "\n"
    )
