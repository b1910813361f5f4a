"""compose.yaml runs every service through a `meshserve` subcommand that exists."""

from pathlib import Path

import yaml

from services.cli import SERVICE_NAMES

ROOT = Path(__file__).resolve().parents[2]


def test_compose_runs_each_service_once_with_a_real_subcommand():
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    commands = [s["command"][0] for name, s in services.items() if name not in ("nats", "redis")]
    assert sorted(commands) == sorted(SERVICE_NAMES)
    for name, s in services.items():
        if name not in ("nats", "redis"):
            env = s["environment"]
            assert env["MESHSERVE_NATS_URL"].startswith("nats://nats")
            assert env["MESHSERVE_REDIS_URL"].startswith("redis://redis")
