"""compose.yaml runs every service through a `meshserve` subcommand that exists, each with a
health check and a restart policy, after the servers it needs are healthy. (tests/docker runs
it for real.)"""

from pathlib import Path

import yaml

from services.cli import SERVICE_NAMES

ROOT = Path(__file__).resolve().parents[2]
SERVICES = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
INFRA = ("nats", "redis")


def _meshserve() -> dict[str, dict]:
    return {n: s for n, s in SERVICES.items() if n not in INFRA and n != "demo-model"}


def test_compose_runs_each_service_once_with_a_real_subcommand():
    default = [s["command"][0] for s in _meshserve().values() if "profiles" not in s]
    assert sorted(default) == sorted(SERVICE_NAMES)
    for s in _meshserve().values():
        env = s["environment"]
        assert env["MESHSERVE_NATS_URL"].startswith("nats://nats")
        assert env["MESHSERVE_REDIS_URL"].startswith("redis://redis")


def test_every_long_running_service_is_health_checked_and_restarted():
    for name, s in SERVICES.items():
        if name == "demo-model":
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
