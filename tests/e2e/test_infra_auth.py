"""`meshserve up` with its own embedded NATS and Redis: each service connects as its role,
with a generated secret, and may use only its own subjects and its cluster's keys; nobody
else gets in; no secret shows in a log, /health or an error."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import nats
import openai
import pytest
import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from tests.e2e.conftest import Cluster, processes_of

pytestmark = [pytest.mark.e2e]

MSGS = [{"role": "user", "content": "Tell me about the license of this program."}]


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(x.decode(errors="replace").split("=", 1) for x in raw if b"=" in x)


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")


@pytest.fixture(scope="module")
def embedded(e2e_models_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("infra") / "stderr.log"
    c = Cluster(e2e_models_dir, "", "", stderr=logs, log_level="info")
    del c.env["MESHSERVE_NATS_URL"], c.env["MESHSERVE_REDIS_URL"]  # embedded ones
    c.start()
    c.logs = logs
    yield c
    c.stop()


def service_urls(cluster: Cluster) -> dict[str, dict[str, str]]:
    """Each service's NATS and Redis URLs, as the launcher gave them."""
    out = {}
    for pid in processes_of(cluster.name):
        try:
            argv = cmdline(pid)
            env = environ(pid)
        except FileNotFoundError:  # a short-lived child that exited since it was listed
            continue
        if len(argv) > 2 and argv[1] == "-m" and argv[2].startswith("services."):
            if "MESHSERVE_NATS_URL" in env:
                out.setdefault(argv[2].removeprefix("services."), env)
    return out


def test_the_cluster_serves_with_every_service_in_its_role(embedded):
    client = openai.OpenAI(base_url=embedded.url, api_key="unused", max_retries=0, timeout=120)
    r = client.chat.completions.create(model="demo", messages=MSGS, max_tokens=8, temperature=0)
    assert r.usage.completion_tokens > 0
    chunks = list(
        client.chat.completions.create(
            model="demo", messages=MSGS, max_tokens=8, temperature=0, stream=True
        )
    )
    assert chunks[-1].choices[0].finish_reason
    urls = service_urls(embedded)
    assert set(urls) >= {"frontend", "job_executor", "cluster_manager", "scaler", "task_executor"}
    for name, env in urls.items():
        for var in ("MESHSERVE_NATS_URL", "MESHSERVE_REDIS_URL"):
            assert urlsplit(env[var]).username == name.split(".")[0], (name, var)
    # Serving used no subject outside its role's permissions (runs before the tests that
    # break them on purpose).
    log = nats_log(embedded).read_text()
    assert "authorization" not in log.lower() or "violation" not in log.lower(), log[-2000:]


def nats_log(cluster: Cluster) -> Path:
    for pid in processes_of(cluster.name):
        argv = cmdline(pid)
        if argv[0].endswith("nats-server") and "-c" in argv:
            return Path(argv[argv.index("-c") + 1]).parent / "server.log"
    raise AssertionError("no embedded nats-server with a configuration")


def _secrets(cluster: Cluster) -> list[str]:
    return [
        urlsplit(env[var]).password
        for env in service_urls(cluster).values()
        for var in ("MESHSERVE_NATS_URL", "MESHSERVE_REDIS_URL")
    ]


async def test_roles_are_held_to_their_subjects(embedded):
    urls = service_urls(embedded)
    te_url = urls["task_executor"]["MESHSERVE_NATS_URL"]
    anonymous = re.sub(r"//[^@]*@", "//", te_url)
    with pytest.raises(Exception, match=r"(?i)authoriz"):
        await asyncio.wait_for(
            nats.connect(anonymous, allow_reconnect=False, connect_timeout=2), 10
        )
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    te = await nats.connect(te_url, error_cb=on_error, allow_reconnect=False)
    c = embedded.name
    try:
        await te.publish(f"{c}.je.submit", b"x")  # jobs come from frontends only
        await te.publish(f"{c}.cm.view", b"x")  # the view from the cluster manager only
        await te.subscribe(f"{c}.cm.heartbeat")  # only the cluster manager reads them
        await te.subscribe(f"{c}._INBOX.frontend.>")  # another role's replies
        await te.flush()
        await te.publish(f"{c}.cm.heartbeat", b"")  # its own: allowed
        await te.flush()
        await asyncio.sleep(0.5)
    finally:
        await te.close()
    text = " ".join(errors).lower()
    assert text.count("permissions violation") == 4, errors
    assert "je.submit" in text and "cm.view" in text and "subscription" in text
    assert "_inbox.frontend" in text

    fe_url = urls["frontend"]["MESHSERVE_NATS_URL"]
    errors.clear()
    fe = await nats.connect(fe_url, error_cb=on_error, allow_reconnect=False)
    try:
        await fe.publish(f"{c}.te.te-1.control", b"x")  # only the scaler commands TEs
        await fe.flush()
        await asyncio.sleep(0.5)
    finally:
        await fe.close()
    assert len(errors) == 1 and "permissions violation" in errors[0].lower()


async def test_redis_users_reach_only_their_cluster_keys(embedded):
    urls = service_urls(embedded)
    te_url = urls["task_executor"]["MESHSERVE_REDIS_URL"]
    anonymous = aioredis.from_url(re.sub(r"//[^@]*@", "//", te_url))
    with pytest.raises((AuthenticationError, ResponseError)):
        await anonymous.get("x")
    await anonymous.aclose()
    r = aioredis.from_url(te_url)
    try:
        own = f"{embedded.name}:test-auth-probe"  # any key of its own cluster
        await r.set(own, b"1")
        assert await r.get(own) == b"1"
        await r.delete(own)
        with pytest.raises(NoPermissionError):
            await r.set("another-cluster:x", b"1")
        with pytest.raises(NoPermissionError):
            await r.flushall()
        with pytest.raises(NoPermissionError):
            await r.config_get("*")
    finally:
        await r.aclose()


def test_no_secret_in_logs_health_or_errors(embedded):
    secrets = _secrets(embedded)
    assert all(secrets) and len(set(secrets)) == 5  # one per role
    with urllib.request.urlopen(embedded.url.removesuffix("/v1") + "/health", timeout=5) as resp:
        health = resp.read().decode()
    logs = embedded.logs.read_text()
    assert "one user per service" in logs
    for secret in secrets:
        assert secret not in health and secret not in logs
    json.loads(health)
