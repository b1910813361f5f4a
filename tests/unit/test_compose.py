"""compose.yaml runs every service through a `meshserve` subcommand that exists, each with a
health check and a restart policy, after the servers it needs are healthy. (tests/docker runs
it for real.)"""

from pathlib import Path

import yaml

from services.cli import SERVICE_NAMES
from shared.access import ROLES

ROOT = Path(__file__).resolve().parents[2]
SERVICES = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
INFRA = ("nats", "redis")
ONE_SHOT = ("secrets", "demo-model")
OBSERVABILITY = ("prometheus", "grafana")


def _meshserve() -> dict[str, dict]:
    return {n: s for n, s in SERVICES.items() if n not in INFRA + ONE_SHOT + OBSERVABILITY}


def test_compose_runs_each_service_once_with_a_real_subcommand():
    default = [s["command"][0] for s in _meshserve().values() if "profiles" not in s]
    assert sorted(default) == sorted(SERVICE_NAMES)


def test_each_service_mounts_its_own_roles_credentials_and_no_other():
    """NATS and Redis admit one user per role (shared/access.py); a container reads its
    role's URLs from the one secrets volume mounted into it."""
    for name, s in _meshserve().items():
        role = SERVICE_NAMES[s["command"][0]].split(".")[-1]
        env = s["environment"]
        assert "MESHSERVE_NATS_URL" not in env and "MESHSERVE_REDIS_URL" not in env
        assert env["MESHSERVE_NATS_URL_FILE"] == "/run/meshserve/nats-url"
        assert env["MESHSERVE_REDIS_URL_FILE"] == "/run/meshserve/redis-url"
        secrets = [v for v in s["volumes"] if v.startswith("secrets-")]
        assert secrets == [f"secrets-{role.replace('_', '-')}:/run/meshserve:ro"], name
    written = {v.split(":")[1] for v in SERVICES["secrets"]["volumes"]}
    assert written >= {f"/secrets/{r}" for r in ROLES} | {"/secrets/nats", "/secrets/redis"}
    assert SERVICES["nats"]["volumes"] == ["secrets-nats:/etc/meshserve:ro"]
    assert SERVICES["redis"]["volumes"] == ["secrets-redis:/etc/meshserve:ro"]


def test_every_long_running_service_is_health_checked_and_restarted():
    for name, s in SERVICES.items():
        if name in ONE_SHOT:
            assert s["restart"] == "no"
            continue
        assert s["restart"] == "unless-stopped", name
        assert s["healthcheck"]["test"], name
    for name, s in _meshserve().items():
        deps = s["depends_on"]
        assert all(deps[i]["condition"] == "service_healthy" for i in INFRA), name


def test_the_models_are_there_before_whoever_reads_them_starts():
    for name in ("cluster-manager", "frontend", "task-executor", "task-executor-gpu"):
        assert SERVICES[name]["depends_on"]["demo-model"] == {
            "condition": "service_completed_successfully"
        }
        assert any(v.endswith(":/models:ro") for v in SERVICES[name]["volumes"]), name


def test_the_observability_profile_mounts_what_the_repository_ships():
    """Prometheus reads deploy/observability (scrape config, alert rules); Grafana its
    provisioning (the Prometheus data source, the dashboard provider) and the dashboard at
    the path the provider reads. Neither starts without the profile; both listen on the
    host's loopback only (Prometheus has no authentication)."""
    for name in OBSERVABILITY:
        s = SERVICES[name]
        assert s["profiles"] == ["observability"], name
        assert all(p.startswith("127.0.0.1:") for p in s["ports"]), name
        for volume in s["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), volume
    prometheus = SERVICES["prometheus"]
    assert "./deploy/observability:/etc/prometheus:ro" in prometheus["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    provisioning = ROOT / "deploy" / "observability" / "grafana"
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    assert source["url"] == "http://prometheus:9090" and source["isDefault"]
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "meshserve.yml").read_text())[
        "providers"
    ]
    dashboard = next(v for v in SERVICES["grafana"]["volumes"] if "grafana-dashboard" in v)
    assert dashboard.split(":")[1].startswith(provider["options"]["path"] + "/")


def test_the_api_published_beyond_loopback_asks_for_keys():
    """The frontend's port is published on every host interface: auth is at its safe default
    (on beyond loopback) unless the operator sets it, and the frontend reads the admin key
    the secrets service generates into its own secrets volume."""
    frontend = SERVICES["frontend"]
    env = frontend["environment"]
    assert env["MESHSERVE_AUTH"] == "${MESHSERVE_AUTH:-auto}"
    assert env["MESHSERVE_ADMIN_KEY_FILE"] == "/run/meshserve/admin-key"
    assert "secrets-frontend:/run/meshserve:ro" in frontend["volumes"]
    assert any(not p.startswith("127.0.0.1:") for p in frontend["ports"])
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "MESHSERVE_HTTP_HOST=0.0.0.0" in dockerfile
