"""`meshserve infra-secrets`: the files compose.yaml's secrets service writes."""

from __future__ import annotations

import json
import stat
from pathlib import Path

from services import infra_secrets
from shared.access import (
    REPLICA_USER,
    ROLES,
    SENTINEL_PEER_USER,
    SENTINEL_USER,
    redis_server_secret,
)
from shared.settings import Settings
from shared.tenancy import admin_key, auth_on


def test_each_role_gets_its_urls_and_the_servers_their_configurations(tmp_path: Path) -> None:
    creds = infra_secrets.write(tmp_path, "c1")
    for role in ROLES:
        nats_url = (tmp_path / role / "nats-url").read_text().strip()
        assert nats_url == creds.url("nats://nats:4222", role)
        for name in ("nats-url", "redis-url"):
            assert stat.S_IMODE((tmp_path / role / name).stat().st_mode) == 0o600
        # What a service in the container reads through MESHSERVE_*_URL_FILE.
        s = Settings.load(
            {
                "MESHSERVE_NATS_URL_FILE": str(tmp_path / role / "nats-url"),
                "MESHSERVE_REDIS_URL_FILE": str(tmp_path / role / "redis-url"),
            }
        )
        assert s.nats_url == nats_url
        assert s.redis_url == creds.url("redis://redis:6379/0", role)
    conf = json.loads((tmp_path / "nats" / "nats.conf").read_text())
    assert conf["host"] == "0.0.0.0" and conf["jetstream"]["store_dir"] == "/data"
    assert {u["user"] for u in conf["authorization"]["users"]} == set(ROLES)
    acl = (tmp_path / "redis" / "redis.acl").read_text()
    assert "user default off" in acl
    assert not any(secret in acl for secret in creds.secrets.values())


def test_secrets_are_kept_across_runs(tmp_path: Path) -> None:
    first = infra_secrets.write(tmp_path, "c1")
    assert infra_secrets.write(tmp_path, "c1") == first
    (tmp_path / "store" / "credentials.json").write_text("{broken")
    assert infra_secrets.write(tmp_path, "c1") != first


def test_the_frontend_gets_an_admin_key_kept_across_runs(tmp_path: Path) -> None:
    """compose.yaml's frontend listens beyond loopback, so auth is on: its admin key is
    generated once, readable by the frontend's user only, and what it reads as its key."""
    infra_secrets.write(tmp_path, "c1")
    path = tmp_path / "frontend" / "admin-key"
    key = path.read_text().strip()
    assert key.startswith("sk-ms-") and stat.S_IMODE(path.stat().st_mode) == 0o600
    infra_secrets.write(tmp_path, "c1")
    assert path.read_text().strip() == key
    s = Settings.load({"MESHSERVE_ADMIN_KEY_FILE": str(path), "MESHSERVE_HTTP_HOST": "0.0.0.0"})
    assert auth_on(s) and admin_key(s) == key
    assert not any((tmp_path / role / "admin-key").exists() for role in ROLES if role != "frontend")


def test_a_nats_cluster_gets_routes_and_every_role_all_its_servers(tmp_path: Path) -> None:
    creds = infra_secrets.write(tmp_path, "c1", nats_host="n1,n2,n3")
    conf = json.loads((tmp_path / "nats" / "nats.conf").read_text())
    cluster = conf["cluster"]
    assert cluster["port"] == 6222 and cluster["authorization"]["user"] == "route"
    secret = cluster["authorization"]["password"]
    assert cluster["routes"] == [f"nats-route://route:{secret}@n{i}:6222" for i in (1, 2, 3)]
    assert secret not in creds.secrets.values() and conf["ping_max"] == 2
    assert "jetstream" not in conf  # core NATS only: nothing to replicate
    for role in ROLES:
        urls = (tmp_path / role / "nats-url").read_text().strip().split(",")
        assert urls == [creds.url(f"nats://n{i}:4222", role) for i in (1, 2, 3)]
    # One server: no cluster block, as compose.yaml's.
    infra_secrets.write(tmp_path, "c1", nats_host="nats")
    assert "cluster" not in json.loads((tmp_path / "nats" / "nats.conf").read_text())


def test_redis_under_sentinel_gets_users_for_replicas_and_sentinels(tmp_path: Path) -> None:
    """Replicas log into the primary and Sentinels into every server as users of their own,
    with only what replication and failover need; their secrets are derived from the
    roles', written in clear only into the servers' own files, hashed in the ACL."""
    creds = infra_secrets.write(tmp_path, "c1", redis_host="10.0.0.3", redis_master="fleet")
    acl = (tmp_path / "redis" / "redis.acl").read_text().splitlines()
    users = {line.split()[1]: line for line in acl}
    assert set(users) == {"default", *ROLES, REPLICA_USER, SENTINEL_USER}
    # Exactly the commands Redis's documentation lists for each, no keys.
    assert users[REPLICA_USER].split()[4:] == ["+psync", "+replconf", "+ping"]
    assert users[SENTINEL_USER].split()[4:] == [
        "allchannels", "+multi", "+slaveof", "+ping", "+exec", "+subscribe", "+config|rewrite",
        "+role", "+publish", "+info", "+client|setname", "+client|kill", "+script|kill",
    ]  # fmt: skip
    for name in ("redis.acl", "replication.conf", "sentinel.conf"):
        # Read by the server's own user in the one container the volume is mounted into.
        assert stat.S_IMODE((tmp_path / "redis" / name).stat().st_mode) == 0o644
    replica_secret = redis_server_secret(creds, REPLICA_USER)
    sentinel_secret = redis_server_secret(creds, SENTINEL_USER)
    assert replica_secret != sentinel_secret
    assert not any(s in "\n".join(acl) for s in (replica_secret, sentinel_secret))
    replication = (tmp_path / "redis" / "replication.conf").read_text()
    assert replication == f"masteruser replica\nmasterauth {replica_secret}\n"
    sentinel = (tmp_path / "redis" / "sentinel.conf").read_text().splitlines()
    assert "sentinel monitor fleet 10.0.0.3 6379 2" in sentinel
    assert f"sentinel auth-pass fleet {sentinel_secret}" in sentinel
    assert "sentinel auth-user fleet sentinel" in sentinel
    # On the Sentinels: no default user; each role (its Redis secret) may only look up where
    # the primary is, never fail it over; the Sentinels log into each other as their own user.
    assert "user default off" in sentinel
    on_sentinels = {line.split()[1]: line for line in sentinel if line.startswith("user ")}
    assert set(on_sentinels) == {"default", *ROLES, SENTINEL_PEER_USER}
    for role in ROLES:
        rules = on_sentinels[role].split()[4:]
        assert rules[0] == "-@all" and "+sentinel|get-master-addr-by-name" in rules
        assert not {"+sentinel|failover", "+sentinel|set", "+@all"} & set(rules)
    peer = redis_server_secret(creds, SENTINEL_PEER_USER)
    assert f"sentinel sentinel-pass {peer}" in sentinel
    assert not any(peer in line for line in on_sentinels.values())  # hashed there
    # The same secrets on the next run: the servers keep working.
    assert infra_secrets.write(tmp_path, "c1") == creds
    assert redis_server_secret(creds, REPLICA_USER) == replica_secret
