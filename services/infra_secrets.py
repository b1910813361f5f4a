"""``meshserve infra-secrets DIR``: the per-role credentials of compose.yaml's NATS and Redis,
written where each container finds its own (the one-shot ``secrets`` service).

As ``meshserve up`` does for the servers it embeds (``shared/access.py``), one user per
service role, each with a generated secret and only its permissions. Written:

- ``DIR/nats/nats.conf`` and ``DIR/redis/redis.acl``: the servers' configurations (the
  ``secrets-nats`` and ``secrets-redis`` volumes, each mounted only into its server's
  container; Redis's file holds SHA-256 hashes of the secrets, not the secrets);
- for Redis under Sentinel, ``DIR/redis/replication.conf`` (every Redis server includes it:
  the user and secret a replica logs into the primary with) and ``DIR/redis/sentinel.conf``
  (each Sentinel starts from a copy: the primary ``--redis-host`` watched under
  ``--redis-master``, and the user it logs into the servers with);
- ``DIR/<role>/nats-url`` and ``DIR/<role>/redis-url``: that role's URLs, credentials
  included, mode 0600 and owned by ``--owner`` (the ``secrets-<role>`` volume, mounted only
  into that role's containers, read through ``MESHSERVE_NATS_URL_FILE`` and
  ``MESHSERVE_REDIS_URL_FILE``).

- ``DIR/frontend/admin-key``: the API's admin key (the frontend reads it through
  ``MESHSERVE_ADMIN_KEY_FILE``: compose.yaml's frontend listens beyond loopback, so auth is
  on), which the operator reads with ``docker compose exec frontend cat
  /run/meshserve/admin-key``.

Secrets already there are kept (``DIR/store/credentials.json``, a volume of the secrets
service's own; the admin key where it is), so a second ``up`` does not change them under
running servers or their clients.
"""

from __future__ import annotations

import json
from pathlib import Path

from shared.access import (
    ROLES,
    Credentials,
    nats_config,
    redis_acl,
    redis_replication_config,
    sentinel_config,
)
from shared.files import write_file
from shared.tenancy import read_admin_key, write_admin_key

NATS_PORT = 4222
ADMIN_KEY_FILE = "admin-key"


def credentials(root: Path) -> Credentials:
    """The secrets stored under ``root``, or new ones (then stored)."""
    stored = root / "store" / "credentials.json"
    try:
        known = json.loads(stored.read_text())
        if set(known) == set(ROLES):
            return Credentials(known)
    except (OSError, ValueError):
        pass
    creds = Credentials.generate()
    write_file(stored, json.dumps(dict(creds.secrets)))
    return creds


def write(
    root: Path,
    cluster: str,
    *,
    nats_host: str = "nats",
    redis_host: str = "redis",
    redis_master: str = "meshserve",
    owner: int | None = None,
) -> Credentials:
    """``nats_host``: one host, or the hosts of a NATS cluster's servers, comma-separated
    (each server then runs the one ``nats.conf``, whose cluster block routes them to each
    other, and each role's URL names them all)."""
    creds = credentials(root)
    servers = [h.strip() for h in nats_host.split(",") if h.strip()]
    routes = servers if len(servers) > 1 else []
    # Read by the servers' own users (the official Redis image runs as redis): readable by
    # any user of the one container each volume is mounted into.
    write_file(
        root / "nats" / "nats.conf",
        nats_config(
            creds, cluster, port=NATS_PORT, store_dir="/data", host="0.0.0.0", routes=routes
        ),
        mode=0o644,
    )
    write_file(root / "redis" / "redis.acl", redis_acl(creds, cluster), mode=0o644)
    write_file(root / "redis" / "replication.conf", redis_replication_config(creds), mode=0o644)
    write_file(
        root / "redis" / "sentinel.conf",
        sentinel_config(creds, master=redis_master, primary=redis_host),
        mode=0o644,
    )
    for role in ROLES:
        urls = {
            "nats-url": ",".join(creds.url(f"nats://{h}:{NATS_PORT}", role) for h in servers),
            "redis-url": creds.url(f"redis://{redis_host}:6379/0", role),
        }
        for name, url in urls.items():
            write_file(root / role / name, url + "\n", owner=owner)
    key = root / "frontend" / ADMIN_KEY_FILE
    if read_admin_key(key) is None:
        write_admin_key(key, owner=owner)
    return creds
